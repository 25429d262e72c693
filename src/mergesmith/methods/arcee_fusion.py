"""Arcee Fusion: keep the other model's changes only where they are unusually important.

Arcee, "MergeKit v0.1: Arcee Fusion" (mergekit docs: "calculates importance scores based on parameter
differences and KL divergence, then uses a dynamic threshold to create a fusion mask"). With a the base
and b the other model:

    importance = |b - a| * KL(softmax(b) || softmax(a))      (softmax and KL along the last dimension,
                                                             one KL per row; 1e-8 added to both
                                                             distributions; in float64, as a sum of
                                                             nonnegative terms: see row_kl)
    threshold  = median + 1.5 * (q3 - q1)                    (the upper Tukey fence of the importances)
    out        = a + (b - a) * [importance >= threshold]

Quantiles are read off the sorted importances at index floor(q * (n - 1)). For tensors of more than
1,000,000 entries mergekit estimates them from 1,000,000 entries sampled with replacement; here the
sample is drawn from the per-tensor generator, so the method is marked randomised (for smaller tensors
nothing is drawn and the values are exact and identical to mergekit's). The output has the merge's
dtype: with `dtype: bfloat16` this writes bf16 where mergekit 0.1.5 writes float32 (measured with
`tests/reference/measure_differences.py --cases arcee_fusion`; pinned by
tests/test_mergekit_differences.py), since a model whose config says bfloat16 should hold bf16 tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.reductions import sum_along
from .common import base_and_other, require_generator
from .registry import MergeInputs, MethodSpec, ModelCount, WorkingMemory

QUANTILE_SAMPLE = 1_000_000
"""Above this many entries the quantiles are estimated from a sample of this size."""


KL_CHUNK = 1 << 20
"""Entries per block of rows whose KL is computed at once: bounds the float64 temporaries (~40 bytes an entry)."""


def row_kl(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row (keepdim), p = softmax(b) + 1e-8, q = softmax(a) + 1e-8, in `other`'s dtype, computed
    without cancellation in float64 and rounded once.

    Why not sum p log(p / q) as written: a fine-tune is close to its base, so the terms are of size |b - a| and of
    both signs while their sum is of size |b - a|^2; in float32 the sum keeps only a few digits, and those depend
    on the order the device adds in (measured: reversing a row's summation moved the KL by 1.5e-5 relative, and
    the float32 KL was 0.4 % off; on CUDA 2 of 60,000 entries of a test tensor crossed the threshold and came out
    different from the CPU's). Since sum p = sum q, KL = sum q (r log r - r + 1) with r = p / q, a sum of
    nonnegative terms q phi(d), d = log r, phi(d) = d e^d - expm1(d) >= 0: no cancellation between terms. In
    float64 the result differs between summation orders by ~1e-15 relative, so once rounded to the compute dtype
    it is the same on every device, and so are the scores (|b - a| times it: exactly rounded operations) and the
    selection. Rows go in blocks of KL_CHUNK entries to bound the float64 temporaries."""
    width = max(base.shape[-1], 1) if base.dim() else 1
    flat_a, flat_b = base.reshape(-1, width), other.reshape(-1, width)
    rows = max(1, KL_CHUNK // width)
    out = torch.empty((flat_a.shape[0], 1), dtype=other.dtype, device=other.device)
    for start in range(0, flat_a.shape[0], rows):
        a = flat_a[start : start + rows].to(torch.float64)
        b = flat_b[start : start + rows].to(torch.float64)
        log_p = torch.log(F.softmax(b, dim=-1) + 1e-8)
        log_q = torch.log(F.softmax(a, dim=-1) + 1e-8)
        d = log_p - log_q
        terms = torch.exp(log_q) * (d * torch.exp(d) - torch.expm1(d))
        out[start : start + rows] = sum_along(terms, dim=-1, keepdim=True).to(other.dtype)
    return out.reshape(*base.shape[:-1], 1) if base.dim() else out.reshape(())


def importance(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """|b - a| times the row-wise KL divergence of softmax(b) from softmax(a) (see row_kl)."""
    return (other - base).abs() * row_kl(base, other)


def quantiles(values: torch.Tensor, qs: torch.Tensor, generator: torch.Generator | None, name: str) -> torch.Tensor:
    """Lower empirical quantiles (sorted[floor(q (n - 1))]), from a sample for very large tensors."""
    flat = values.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE:
        gen = require_generator(generator, "arcee_fusion", name)
        picks = torch.randint(flat.numel(), (QUANTILE_SAMPLE,), generator=gen)  # on the CPU, as the generator
        flat = flat[picks.to(flat.device)]
    ordered = torch.sort(flat).values
    return ordered[(qs.to(ordered.device) * (ordered.numel() - 1)).long()]


def arcee_fusion(
    base: torch.Tensor, other: torch.Tensor, generator: torch.Generator | None = None, name: str = ""
) -> torch.Tensor:
    scores = importance(base, other)
    q1, median, q3 = quantiles(scores, torch.tensor([0.25, 0.5, 0.75]), generator, name)
    threshold = median + 1.5 * (q3 - q1)
    mask = (scores >= threshold).float()
    return (base + (other - base) * mask).to(base.dtype)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    base, other = base_and_other(inputs, "arcee_fusion")
    return arcee_fusion(base, other, inputs.generator, inputs.tensor_name)


METHODS = (
    MethodSpec(
        name="arcee_fusion",
        description="take the other model's changes where their importance passes a Tukey fence",
        merge=_merge,
        requires_base=True,
        models=ModelCount(min_models=2, max_models=2),
        randomized=True,
        elementwise=False,
        # row_kl's float64 temporaries (~40-46 bytes an entry, measured in tests/test_planner_checks2.py) over at
        # most KL_CHUNK entries at a time, counted in units of the compute dtype's size
        memory=WorkingMemory(per_input=2, fixed=1, bytes=20, chunked=(0.0, 28.0), chunk_elements=KL_CHUNK),
    ),
)
