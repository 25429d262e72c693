"""Memory and CPU time of one TIES selection (kernels/sort_select.sorted_window_mask) on a bench-sized task vector.

Why: the blocked TIES merge (kernels/magnitude_blocks.py) keeps every task vector's 16-bit magnitudes and selects
them one at a time, so the selection's own arrays (mask, tracker, partition scratch) are the rest of its peak.
numpy reports its buffers to tracemalloc, so the peak here is the selection's numpy memory beside the keys.

    python bench/selection_memory.py            # 32000 x 1024 entries, like the 0.25b set's embedding
    python bench/selection_memory.py --entries 5000000 --delta 0.01
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import torch

from mergesmith.kernels import sort_select


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=32000 * 1024)
    ap.add_argument("--delta", type=float, default=0.1, help="fine-tune delta std relative to the weights' (0.1: "
                    "the bench models; 0.01: few distinct bf16 deltas, many ties at the cut)")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(args.entries, generator=g) * 0.02).bfloat16()
    tuned = (base.float() + torch.randn(args.entries, generator=g) * 0.02 * args.delta).bfloat16()
    keys = (tuned - base).abs()
    k = max(1, int(args.density * args.entries))
    for _ in range(args.runs):
        work = keys.clone()
        tracemalloc.start()
        start = time.process_time()
        sort_select.sorted_window_mask(work, 0, k, True, remake=lambda: keys.clone(), zeros_free=True)
        cpu = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{args.entries / 1e6:.1f} M entries: {cpu:.2f} CPU s, numpy peak {peak / 1e6:.0f} MB "
              f"({peak / args.entries:.2f} bytes an entry)")


if __name__ == "__main__":
    main()
