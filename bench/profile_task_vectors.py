"""CPU cost per entry of the randomised task-vector methods, whole and by stage (issue 21's profile).

Why a separate script: the merge benchmarks measure a whole merge, whose CPU-seconds mix reading, writing and
every method's arithmetic; this one times the method on one row block (1 M entries, the executor's block size) in
process CPU time on one torch thread (so a shared machine's load and OpenMP spinning do not count), and splits it
into the stages the issue asks about: drawing the masks, the rescale, the sign election, conversions and copies.

Usage::

    python bench/profile_task_vectors.py                 # bf16 (the bench configs' dtype), 2 task vectors
    python bench/profile_task_vectors.py --dtype float32 --reps 10
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mergesmith.kernels import keyed_merge as km
from mergesmith.kernels.keyed_random import MaskStream
from mergesmith.kernels.reductions import BlockedTotal
from mergesmith.kernels.task_vector_mix import merge_task_vectors
from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs

METHODS = ("dare_ties", "dare_linear", "della", "della_linear")


def per_entry(fn: Callable[[], object], entries: int, reps: int) -> float:
    """ns of process CPU time per entry of one call of `fn` (after one warm-up call)."""
    fn()
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps / entries * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = (args.rows, args.cols)
    n = args.rows * args.cols
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g) * 0.02
    models = [base.to(dtype)] + [(base + 0.002 * torch.randn(shape, generator=g)).to(dtype) for _ in range(2)]
    model_params = [{}] + [{"weight": 0.5, "density": 0.5, "epsilon": 0.1}] * 2

    print(f"{args.dtype} block {args.rows}x{args.cols}, 2 task vectors, {args.threads} torch thread(s); ns per entry")
    print(f"{'method':14s} {'whole, torch generator':>24s} {'keyed, totals + merge':>24s}")
    for method in METHODS:
        spec = get_method(method)
        params = {p.name: p.default for p in spec.params} | {"normalize": True}

        def legacy(spec=spec, params=params) -> object:
            generator = torch.Generator().manual_seed(1)
            return spec.merge(MergeInputs(models, 0, model_params, params, generator, "t"))

        def keyed(spec=spec, params=params) -> object:
            state = spec.totals.gather(None, MergeInputs(models, 0, model_params, params, None, "t",
                                                         stream=MaskStream(1)))
            totals = spec.totals.finish(state)
            return spec.merge(MergeInputs(models, 0, model_params, params, None, "t", stream=MaskStream(1),
                                          totals=totals))

        print(f"{method:14s} {per_entry(legacy, n, args.reps):24.1f} {per_entry(keyed, n, args.reps):24.1f}")

    stream = MaskStream(3)
    delta = models[1] - models[0]
    probs = torch.full(shape, 0.5, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
    rows = delta.abs()
    f32 = [m.float() for m in models]
    d32 = f32[1] - f32[0]
    buf, mags = torch.empty(shape), torch.empty(shape)
    keep = km.keep_flags(stream, km.Vector(1, 0, 0.5, 0.5), 0, d32)
    dare, della = km.Vector(1, 0, 0.5, 0.5), km.Vector(1, 0, 0.5, 0.5, 0.1)
    weighted = [d32.clone(), (f32[2] - f32[0])]
    mix_sum, mix_lin = km.Mix("sum", False, True, 1.0), km.Mix(None, False, True, 1.0)
    stages: list[tuple[str, Callable[[], object]]] = [
        ("before: torch.bernoulli (mergekit's draw)", lambda: torch.bernoulli(probs, generator=g)),
        ("before: DELLA ranks, torch argsort per row", lambda: torch.argsort(rows, dim=1)),
        ("before: mix with sign election, bf16", lambda: merge_task_vectors(
            models[0], torch.stack([delta, models[2] - models[0]]), [0.5, 0.5], consensus="sum", normalize=True)),
        ("task vector: float32 copy - base", lambda: buf.copy_(models[1]).sub_(f32[0])),
        ("keyed draw (Philox) + compare", lambda: km.keep_flags(stream, dare, 0, d32)),
        ("DELLA keep: rank sort + draw + compare", lambda: km.keep_flags(stream, della, 0, d32)),
        ("mask x delta, x weight*rescale", lambda: buf.copy_(d32).mul_(keep).mul_(0.7)),
        ("L1 norms: abs, blocked sums", lambda: BlockedTotal().add(torch.abs(d32, out=mags))),
        ("mix, sign election (2 vectors)", lambda: km._mix([w.clone() for w in weighted], [0.5, 0.5], mix_sum)),
        ("mix, plain sum (2 vectors)", lambda: km._mix([w.clone() for w in weighted], [0.5, 0.5], mix_lin)),
        ("  (the clones in the two mixes above)", lambda: [w.clone() for w in weighted]),
        ("base + mix, rounded to the output dtype", lambda: buf.add_(f32[0]).to(dtype)),
    ]
    print("\nstages, on whole 1024x1024 tensors (the merge works on chunks of keyed_merge.CHUNK_ELEMENTS, in cache)")
    print("(ns per entry of one task vector, or of the output for the mix):")
    for label, fn in stages:
        print(f"  {label:44s} {per_entry(fn, n, args.reps):6.1f}")


if __name__ == "__main__":
    main()
