"""Seconds per unit of SVD work of the SVD-based methods (tsv, iso_c, iso_cts), for `plan`'s time estimate.

    python bench/svd_rate.py [--tasks 2] [--repeats 2] [--scale 1]

Times each method's merge function on one float32 matrix of several shapes (the 1b bench model's shapes divided
by 4, times --scale: attention 512x512, GQA key/value 64x512, MLP 1408x512 and 512x1408, embedding 8000x512) with
--tasks task vectors, on one torch thread (a merge's worker has one where workers = cores:
runtime/intra_op_threads.py), and prints the wall seconds per unit of the method's `svd_work` (sum of m n min(m, n)
over its SVDs), per shape and method, and their median over all: the value for
engine.time_estimate.SVD_SECONDS_PER_UNIT. Small sizes only: about a minute on a 2-core VM.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mergesmith.methods import MergeInputs, get_method

SHAPES = ((512, 512), (64, 512), (1408, 512), (512, 1408), (8000, 512))
PARAMS = {
    "tsv": {"alpha": 1.0},
    "iso_c": {"scaling_factor": 1.0},
    "iso_cts": {"scaling_factor": 1.0, "common_space_fraction": 0.8},
}


def _inputs(shape: tuple[int, int], tasks: int, method: str) -> MergeInputs:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g)
    tensors = [base] + [base + 0.01 * torch.randn(shape, generator=g) for _ in range(tasks)]
    return MergeInputs(tensors, 0, [{}] + [{"weight": 1.0}] * tasks, PARAMS[method], tensor_name="w")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rates: list[float] = []
    print(f"torch {torch.__version__}, 1 thread, {args.tasks} task vectors, float32; best of {args.repeats}")
    print(f"{'method':8} {'shape':>11} {'seconds':>8} {'units':>10} {'s/unit':>10}")
    for method in PARAMS:
        spec = get_method(method)
        assert spec is not None and spec.svd_work is not None
        for m, n in SHAPES:
            shape = (int(m * args.scale), int(n * args.scale))
            inputs = _inputs(shape, args.tasks, method)
            spec.merge(inputs)  # warm: first-call allocations and LAPACK's set-up
            best = min(_timed(spec.merge, inputs) for _ in range(args.repeats))
            units = spec.svd_work(shape, args.tasks)
            rates.append(best / units)
            print(f"{method:8} {f'{shape[0]}x{shape[1]}':>11} {best:8.3f} {units:10.3g} {best / units:10.3g}")
    print(f"median seconds per unit: {statistics.median(rates):.3g} (min {min(rates):.3g}, max {max(rates):.3g})")


def _timed(fn, inputs: MergeInputs) -> float:
    started = time.perf_counter()
    fn(inputs)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
