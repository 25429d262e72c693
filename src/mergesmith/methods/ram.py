"""RAM and RAM+ (tensor-local): average task-vector entries only where several models changed them.

"Reinforced Agent Merging" (arXiv:2601.13572), as mergekit 0.1.5 implements it. With task vectors
d_i = x_i - base, an entry counts as changed by model i when |d_i| > epsilon, and c is the number of
models that changed it:

    ram:         out = base + sum_i [c == 1] d_i + [c > 1] d_i / c        (changed entries only)

so an entry changed by one model keeps that model's whole change (a plain average would dilute it by N),
and an entry changed by several gets their mean. RAM+ additionally boosts each model's unique entries by
how much of its change it shares with the others, per tensor ("tensor-local"):

    ramplus_tl:  rho_i = #shared changed entries of i / max(#unique changed entries of i, epsilon)
                 unique entries of model i are scaled by 1 + r * clamp(rho_i, 0, alpha)

Both need a base; with no other model the base is returned.
"""

from __future__ import annotations

import torch

from .common import check_same_shape, require_base
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory


def _changes(base: torch.Tensor, models: list[torch.Tensor], epsilon: float):
    """Flattened task vectors, which entries each model changed, how many models changed each entry."""
    deltas = torch.stack([x - base for x in models], dim=0).view(len(models), -1)
    changed = deltas.abs() > epsilon
    count = changed.sum(dim=0, keepdim=True)
    return deltas, changed, count


def ram(base: torch.Tensor, models: list[torch.Tensor], epsilon: float = 1e-5) -> torch.Tensor:
    """Unique changes kept whole, shared changes averaged over the models that made them."""
    if not models:
        return base
    deltas, changed, count = _changes(base, models, epsilon)
    kept = deltas * changed
    merged = ((kept * (count == 1)) + (kept * (count > 1) / count.clamp(min=1))).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def ramplus_tl(
    base: torch.Tensor, models: list[torch.Tensor], r: float = 0.1, alpha: float = 0.2, epsilon: float = 1e-5
) -> torch.Tensor:
    """RAM with each model's unique changes scaled by 1 + r * clamp(shared/unique ratio, 0, alpha)."""
    if not models:
        return base
    deltas, changed, count = _changes(base, models, epsilon)
    unique, shared = count == 1, count > 1
    ratio = (changed & shared).sum(dim=1) / (changed & unique).sum(dim=1).clamp(min=epsilon)
    boost = 1 + r * ratio.clamp(min=0, max=alpha)
    kept = deltas * changed
    merged = ((kept * unique * boost.unsqueeze(-1)) + (kept * shared / count.clamp(min=1))).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def _models(inputs: MergeInputs, method: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    check_same_shape(inputs, method)
    base = require_base(inputs, method)
    return inputs.tensors[base], [inputs.tensors[i] for i in inputs.others()]


def _merge_ram(inputs: MergeInputs) -> torch.Tensor:
    base, models = _models(inputs, "ram")
    return ram(base, models, float(inputs.params["epsilon"]))


def _merge_ramplus(inputs: MergeInputs) -> torch.Tensor:
    base, models = _models(inputs, "ramplus_tl")
    p = inputs.params
    return ramplus_tl(base, models, float(p["r"]), float(p["alpha"]), float(p["epsilon"]))


METHODS = (
    MethodSpec(
        name="ram",
        description="RAM: unique task-vector changes kept whole, shared ones averaged",
        merge=_merge_ram,
        params=(ParamSpec("epsilon", 1e-5),),
        requires_base=True,
        elementwise=True,
        memory=WorkingMemory(per_input=8.5, fixed=1, bytes=4),
    ),
    MethodSpec(
        name="ramplus_tl",
        description="RAM+ (tensor-local): RAM with unique changes boosted by each model's overlap ratio",
        merge=_merge_ramplus,
        params=(ParamSpec("r", 0.1), ParamSpec("alpha", 0.2), ParamSpec("epsilon", 1e-5)),
        requires_base=True,
        elementwise=False,
        memory=WorkingMemory(per_input=10, fixed=1, bytes=32),
    ),
)
