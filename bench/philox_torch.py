"""The keyed Philox draws three ways on the CPU: numpy's generator, keyed_kernels' compiled copy, torch integers.

Why: keyed_random_torch computes the stream with torch integer operations so a GPU can draw its own masks; on the
CPU keyed_random keeps numpy's (or the compiled) generator. This times the three on the same draws (4M by default:
16 keyed chunks, one stream), one torch thread, best of `--reps` after a warm-up, and checks they agree.

Usage::

    python bench/philox_torch.py
    python bench/philox_torch.py --draws 1048576 --reps 5 --device cuda
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("MERGESMITH_KERNELS", "wait")  # time the compiled loop, not its background compilation

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mergesmith.kernels import keyed_random, keyed_random_torch  # noqa: E402
from mergesmith.kernels.keyed_random import CHUNK, MaskStream  # noqa: E402


def best_ns(fn, draws: int, reps: int) -> float:
    """Best wall time of `fn` over `reps` calls after a warm-up one, in ns per draw."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) / draws * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=1 << 22)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the torch stream also runs (cuda: synchronised)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, start = args.draws, 12345
    rows = []
    keyed_random.COMPILED = False
    rows.append(("numpy Philox (keyed_random)", best_ns(lambda: MaskStream(3).draws(1, start, n), n, args.reps)))
    reference = MaskStream(3).draws(1, start, n).astype(np.int64)
    keyed_random.COMPILED = keyed_random.keyed_kernels.AVAILABLE
    if keyed_random.COMPILED:
        rows.append(("compiled (keyed_kernels)", best_ns(lambda: MaskStream(3).draws(1, start, n), n, args.reps)))
    for device in dict.fromkeys(["cpu", args.device]):
        def run(device=device):
            out = keyed_random_torch.draws(3, 1, start, n, CHUNK, device)
            if out.device.type == "cuda":
                torch.cuda.synchronize()
            return out

        assert np.array_equal(run().cpu().numpy(), reference), device
        rows.append((f"torch integers ({device})", best_ns(run, n, args.reps)))
    print(f"{n} draws, one thread, {torch.__version__}")
    for name, ns in rows:
        print(f"  {name:30s} {ns:7.2f} ns/draw")


if __name__ == "__main__":
    main()
