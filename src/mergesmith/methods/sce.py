"""SCE: Select, Calculate, Erase, the task-vector merge of FuseChat.

Wan et al. 2024, "FuseChat: Knowledge Fusion of Chat Models" (arXiv:2408.07990), section 3.3. With task
vectors d_i = x_i - base stacked over the N models:

1. Select: keep only the `select_topk` fraction of positions (counted among positions whose variance is not
   zero) with the largest variance across the models, Var_i(d_i) (population variance); zero the rest in
   every d_i. `select_topk: 1` (the default) keeps everything.
2. Calculate: one coefficient per model and tensor, eta_i = mean(d_i^2) / sum_j mean(d_j^2) (uniform 1/N when
   the sum is ~0).
3. Erase: TIES sign election by sum (see task_arithmetic.py; kernels/task_vector_mix.py computes it): entries
   whose sign disagrees with the sign of sum_i d_i are dropped.

out = base + sum_i eta_i m_i d_i / max(sum_i eta_i m_i, 1e-6), m_i the election mask. Models have no
`weight` in SCE: the coefficients come from the task vectors themselves. `int8_mask` only changes the mask's
dtype, not the result.
"""

from __future__ import annotations

import torch

from ..kernels.task_vector_mix import sign_consensus_mask
from .common import as_bool, check_same_shape, require_base
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory


def variance_mask(deltas: torch.Tensor, fraction: float, dtype: torch.dtype) -> torch.Tensor:
    """1 at the floor(fraction * #nonzero-variance) positions of highest variance across models, else 0."""
    if fraction <= 0:
        return torch.zeros_like(deltas[0], dtype=dtype)
    if fraction >= 1:
        return torch.ones_like(deltas[0], dtype=dtype)
    variance = torch.var(deltas, dim=0, unbiased=False)
    k = int(torch.count_nonzero(variance) * fraction)
    mask = torch.zeros_like(variance, dtype=dtype)
    if k == 0:
        return mask
    top = torch.topk(variance.abs().view(-1), k=k, largest=True).indices
    mask.view(-1)[top] = 1
    return mask


def matrix_coefficients(deltas: torch.Tensor) -> torch.Tensor:
    """eta_i = mean(d_i^2) / sum_j mean(d_j^2), uniform when all task vectors are ~0."""
    energy = deltas.square().reshape(deltas.shape[0], -1).mean(dim=1)
    total = torch.sum(energy).item()
    if abs(total) < 1e-6:
        return torch.ones_like(energy) / energy.shape[0]
    return energy / total


def sce(base: torch.Tensor, models: list[torch.Tensor], select_topk: float = 1.0, int8_mask: bool = False):
    """base + the SCE mix of the models' task vectors."""
    if not models:
        return base
    mask_dtype = torch.int8 if int8_mask else base.dtype
    deltas = torch.stack([x - base for x in models], dim=0)
    if select_topk < 1:
        deltas = deltas * variance_mask(deltas, select_topk, mask_dtype).unsqueeze(0)
    agree = sign_consensus_mask(deltas, "sum", int8_mask)
    eta = matrix_coefficients(deltas).view(-1, *([1] * base.dim()))
    kept = eta * agree
    return base + (deltas * kept).sum(dim=0) / torch.sum(kept, dim=0).clamp(min=1e-6)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "sce")
    base = require_base(inputs, "sce")
    return sce(
        inputs.tensors[base],
        [inputs.tensors[i] for i in inputs.others()],
        select_topk=float(inputs.params["select_topk"]),
        int8_mask=as_bool(inputs.params["int8_mask"], "int8_mask"),
    )


METHODS = (
    MethodSpec(
        name="sce",
        description="SCE (FuseChat): variance selection, energy coefficients, sign election",
        merge=_merge,
        params=(ParamSpec("select_topk", 1.0), ParamSpec("int8_mask", False)),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        memory=WorkingMemory(per_input=6.5, fixed=1, bytes=0),
    ),
)
