"""Arcee Fusion: keep the other model's changes only where they are unusually important.

Arcee, "MergeKit v0.1: Arcee Fusion" (mergekit docs: "calculates importance scores based on parameter
differences and KL divergence, then uses a dynamic threshold to create a fusion mask"). With a the base
and b the other model:

    importance = |b - a| * KL(softmax(b) || softmax(a))      (softmax and KL along the last dimension,
                                                             one KL per row; 1e-8 added to both
                                                             distributions)
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


def importance(base: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """|b - a| times the row-wise KL divergence of softmax(b) from softmax(a)."""
    p = F.softmax(other, dim=-1) + 1e-8
    q = F.softmax(base, dim=-1) + 1e-8
    kl = sum_along(p * torch.log(p / q), dim=-1, keepdim=True)
    return (other - base).abs() * kl


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
        memory=WorkingMemory(per_input=2, fixed=1, bytes=20),
    ),
)
