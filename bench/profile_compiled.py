"""The compiled loops against the paths they replace, one thread, the same inputs (issue 21's fourth and fifth rounds).

Why a separate script: the merge benchmarks time whole merges; this one times each compiled loop beside the
torch/numpy code it stands in for, through the module switches the tests use, on one row block of bench-like
data: keyed_merge's totals and merge passes (dare_ties, 2 task vectors, rescale), keyed_random's Philox draws,
sort_select's replay (TIES' selection of half of a task vector of bf16 magnitudes), bf16_mix's subtraction and
masking of a bf16 task vector, task_vector_mix's bf16 mix (TIES, sum consensus, normalize), and weighted_sum's
linear average (3 bf16 models, and 3 float32 ones), and reductions' pairwise block sums of DARE's L1 norms (beside
torch's own float32 block sums, which are not the same on every device). Process CPU
time, one torch thread, after a warm-up call (which compiles or loads the loops).

Usage::

    python bench/profile_compiled.py
    python bench/profile_compiled.py --rows 2048 --cols 5632 --reps 5
    python bench/profile_compiled.py --only linear
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("MERGESMITH_KERNELS", "wait")  # the compiled column must time the compiled loops (compiled.py)

import torch  # noqa: E402
from profile_task_vectors import per_entry  # bench/ is on the path when a script here runs

from mergesmith.kernels import (
    bf16_mix,
    keyed_merge,
    keyed_random,
    reductions,
    sort_select,
    task_vector_mix,
    weighted_sum,
)
from mergesmith.kernels.keyed_random import MaskStream
from mergesmith.methods.linear import linear_average


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default="", help="time only the stages whose name contains this (e.g. linear)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shape, n = (args.rows, args.cols), args.rows * args.cols
    base = (torch.randn(shape, generator=g) * 0.02).bfloat16()
    tuned = [(base.float() + torch.randn(shape, generator=g) * 0.002).bfloat16() for _ in range(2)]
    tensors = [base, *tuned]
    vectors = [keyed_merge.Vector(1, 0, 0.5, 0.5), keyed_merge.Vector(2, 1, 0.5, 0.5)]
    mix = keyed_merge.Mix("sum", True, True, 1.0)
    deltas = torch.stack([t - base for t in tuned])
    magnitudes = (tuned[0] - base).abs().reshape(-1)
    keep = sort_select.sorted_window_mask(magnitudes.clone(), 0, n // 2, True).reshape(shape)
    scratch = torch.empty_like(base)

    def subtract_and_mask() -> None:
        bf16_mix.keep_masked(bf16_mix.subtract(tuned[0], base, scratch), keep)

    def totals() -> keyed_merge.Totals:
        return keyed_merge.finish(keyed_merge.gather(None, tensors, 0, vectors, MaskStream(3), 0))

    floats = [t.float() for t in tensors]
    mags32 = magnitudes.float()

    def stages() -> dict[str, float]:
        done = totals()
        def totals_by_steps() -> keyed_merge.Totals:
            keyed_merge.TOTALS_IN_ONE_LOOP = False
            try:
                return totals()
            finally:
                keyed_merge.TOTALS_IN_ONE_LOOP = True

        timed = {
            "keyed totals pass (dare_ties)": totals,
            "keyed totals pass, step by step": totals_by_steps,
            "keyed merge pass (dare_ties)": lambda: keyed_merge.merge(tensors, 0, vectors, mix, MaskStream(3), 0, done),
            "Philox draws, one task vector": lambda: MaskStream(3).draws(0, 0, n),
            "TIES selection, half of one vector": lambda: sort_select.sorted_window_mask(
                magnitudes.clone(), 0, n // 2, True
            ),
            "bf16 subtract + mask, one vector": subtract_and_mask,
            "bf16 mix, TIES (2 vectors)": lambda: task_vector_mix.merge_task_vectors(
                base, deltas, [0.5, 0.5], consensus="sum", normalize=True
            ),
            "linear average, 3 bf16 models": lambda: linear_average(tensors, [0.5, 0.3, 0.2], True),
            "linear average, 3 float32 models": lambda: linear_average(floats, [0.5, 0.3, 0.2], True),
            "block sums, pairwise (keyed L1 norms)": lambda: reductions.tree_block_sums(mags32),
            "block sums, torch float32 .sum": lambda: mags32.view(-1, reductions.BLOCK).sum(dim=1),
        }
        return {
            stage: per_entry(fn, n, args.reps)
            for stage, fn in timed.items()
            if args.only in stage
        }

    switches = (
        (keyed_merge, "FUSED"),
        (keyed_random, "COMPILED"),
        (sort_select, "COMPILED"),
        (task_vector_mix, "COMPILED_MIX"),
        (bf16_mix, "ELEMENTWISE"),
        (weighted_sum, "ENABLED"),
        (reductions, "COMPILED_TREE"),
    )
    results = {}
    for compiled in (False, True):
        for module, name in switches:
            setattr(module, name, compiled)
        results[compiled] = stages()
    print(f"bfloat16 {args.rows}x{args.cols}, 1 torch thread; ns of CPU per entry")
    print(f"{'stage':38s} {'torch/numpy':>12s} {'compiled':>9s}")
    for stage in results[False]:
        print(f"{stage:38s} {results[False][stage]:12.1f} {results[True][stage]:9.1f}")


if __name__ == "__main__":
    main()
