"""How close DARE's output is to the exact result on the same masks: float32 once (now) against stepwise bf16 (before).

Why: keyed_merge.py computes the randomised task-vector methods in float32 and rounds once, where the code before it
did every step in the compute dtype (bf16 in the bench configs), rounding ~10 times. This measures both against a
float64 evaluation of the same formula with the same keep masks, on bench-like data (base N(0, 0.02), task
vectors N(0, 0.002), bf16), and reports the error in units of the output's last place (ulp of the exact value).

Usage::

    python bench/accuracy_keyed.py                # dare_ties and dare_linear, 2 task vectors, 1024x2048
"""

from __future__ import annotations

import argparse
import math

import torch

from mergesmith.kernels.keyed_merge import Vector, keep_flags
from mergesmith.kernels.keyed_random import MaskStream
from mergesmith.kernels.reductions import total
from mergesmith.kernels.task_vector_mix import merge_task_vectors
from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs


def reference(models, masks, weights, consensus: bool) -> torch.Tensor:
    """float64: base + mix of d_i * mask_i * |d_i|_1 / |d_i mask_i|_1 (DARE, rescale on, normalize off)."""
    base = models[0].double()
    ws = []
    for x, m, w in zip(models[1:], masks, weights):
        d = x.double() - base
        kept = d * m.double()
        ws.append(w * kept * (d.abs().sum() / kept.abs().sum()))
    stacked = torch.stack(ws)
    if not consensus:
        return base + stacked.sum(0)
    pos = stacked.clamp(min=0).sum(0)
    neg = stacked.clamp(max=0).sum(0)
    return base + torch.where(pos + neg >= 0, pos, neg)


def stepwise(models, masks, weights, consensus: bool) -> torch.Tensor:
    """The code before keyed_merge.py: every step in the compute dtype (total() norms, merge_task_vectors)."""
    base = models[0]
    deltas = []
    for x, m in zip(models[1:], masks):
        work = x - base
        before = total(work.abs())
        work = work * m.to(work.dtype)
        after = total(work.abs())
        deltas.append(work * (before / after))
    return merge_task_vectors(base, torch.stack(deltas), weights, consensus="sum" if consensus else None,
                              normalize=False)


def ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of the last place of `out`'s dtype at ref (bf16: 8 significant bits)."""
    digits = 1 - int(math.log2(torch.finfo(out.dtype).eps))  # significant bits: 8 for bf16
    _, exponent = torch.frexp(ref)  # |ref| in [2**(e-1), 2**e)
    spacing = torch.ldexp(torch.ones_like(ref), exponent - digits)
    return (out.double() - ref).abs() / spacing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shape = (args.rows, args.cols)
    base = torch.randn(shape, generator=g) * 0.02
    models = [base.bfloat16()] + [(base + 0.002 * torch.randn(shape, generator=g)).bfloat16() for _ in range(2)]
    weights = [0.5, 0.5]
    stream = MaskStream(11)
    masks = [keep_flags(stream, Vector(i + 1, i, w, args.density), 0, models[0]) for i, w in enumerate(weights)]
    print(f"bf16 {shape}, 2 task vectors, density {args.density}; error against float64 on the same masks")
    print(f"{'method':12s} {'arithmetic':26s} {'max ulp':>8s} {'mean ulp':>9s} {'correctly rounded':>18s}")
    for method, consensus in (("dare_ties", True), ("dare_linear", False)):
        ref = reference(models, masks, weights, consensus)
        spec = get_method(method)
        params = {p.name: p.default for p in spec.params}
        mp = [{}] + [{"weight": w, "density": args.density} for w in weights]
        now = spec.merge(MergeInputs(models, 0, mp, params, None, "t", stream=MaskStream(11)))
        before = stepwise(models, masks, weights, consensus)
        for label, out in (("stepwise bf16 (before)", before), ("float32, one rounding (now)", now)):
            e = ulps(out, ref)
            exact = (out == ref.to(out.dtype)).double().mean().item()
            print(f"{method:12s} {label:26s} {e.max().item():8.2f} {e.mean().item():9.3f} {exact:18.4f}")


if __name__ == "__main__":
    main()
