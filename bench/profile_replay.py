"""Time TIES' introsort replay alone, one thread, on a real task vector's magnitudes (or synthetic ones).

    python bench/profile_replay.py                        # the 1b bench's model.layers.3.mlp.up_proj.weight
    python bench/profile_replay.py --tensor NAME --runs 5
    python bench/profile_replay.py --synthetic 4000000     # no bench models needed

The task vector is model1 - model0 of the bench set (`bench/make_models.py --size 1b`), its bf16 magnitudes the
keys, the window TIES' top half (density 0.5), as sort_select hands them to introsort_replay.replay. Prints the
replay's ns an entry following nothing and following the split key's entries by ids (min of --runs), the share
followed, and whether block_stops gathers by compress (see its docstring) on this CPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from mergesmith.kernels import block_stops, introsort_replay, sort_select

BENCH_MODELS = Path.home() / ".cache" / "mergesmith" / "bench-models" / "1b"


def _bench_tensor(model: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in sorted((BENCH_MODELS / model).glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise SystemExit(f"error: {name} is not in {BENCH_MODELS / model} (run bench/make_models.py --size 1b)")


def magnitudes(args: argparse.Namespace) -> torch.Tensor:
    if args.synthetic:
        g = torch.Generator().manual_seed(0)
        return (torch.randn(args.synthetic, generator=g) * 0.003).bfloat16().abs()
    return (_bench_tensor("model1", args.tensor) - _bench_tensor("model0", args.tensor)).abs().view(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", default="model.layers.3.mlp.up_proj.weight")
    parser.add_argument("--synthetic", type=int, default=0, help="this many random bf16 magnitudes instead")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not introsort_replay.warm():
        raise SystemExit("error: the compiled replay is not available (numba?)")
    keys = magnitudes(args).view(torch.int16).numpy().copy()
    n, hi = keys.size, keys.size // 2
    counts = sort_select._narrow_key_counts(keys, 0x7F80)
    _, split = sort_select._narrow_window_keys(counts, 0, hi, True)
    split_keys = sorted(split)
    followed = np.flatnonzero(np.isin(keys, split_keys)).astype(np.int64)
    low, high = keys.dtype.type(split_keys[0]), keys.dtype.type(split_keys[-1])
    ids = np.empty(n, dtype=np.int32)
    budget = sort_select.depth_budget(n)
    print(f"{n} entries, {followed.size / n:.2%} followed, stops by {'compress' if block_stops.COMPRESS else 'loop'}")
    for way in ("none", "ids"):
        best = float("inf")
        for _ in range(args.runs):
            entries, window = keys.copy(), np.zeros(n, dtype=np.bool_)
            start = time.perf_counter()
            if way == "ids":
                done = introsort_replay.replay(entries, 0, hi, True, 0, low, high, followed, window, budget, ids)
            else:
                done = introsort_replay.replay(entries, 0, hi, True, 0, low, high, followed[:0], window, budget)
            best = min(best, time.perf_counter() - start)
            if not done:
                raise SystemExit("the replay gave up (a spent depth budget)")
        print(f"following {way}: {best / n * 1e9:.2f} ns an entry")


if __name__ == "__main__":
    main()
