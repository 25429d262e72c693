"""NearSwap: take the other model's value where it is already near the base's.

From alchemonaut's QuartetAnemoi-70B-t0.0001 model card (the method's only reference; mergekit docs,
"Nearswap"): per entry, with a the base and b the other model,

    w = clamp(t / |a - b|, 0, 1),      out = w * b + (1 - w) * a

so entries closer than t are swapped completely, and farther ones move towards b by t / |a - b|.
|a - b| is clamped at 1e-6 to avoid dividing by zero (equal entries give w = 1, i.e. b = a).
"""

from __future__ import annotations

import torch

from .common import base_and_other
from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec, WorkingMemory


def nearswap(base: torch.Tensor, other: torch.Tensor, t: float) -> torch.Tensor:
    weight = (t / torch.abs(base - other).clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * other + (1 - weight) * base


def _merge(inputs: MergeInputs) -> torch.Tensor:
    base, other = base_and_other(inputs, "nearswap")
    return nearswap(base, other, float(inputs.params["t"]))


METHODS = (
    MethodSpec(
        name="nearswap",
        description="swap in the other model's entries where they lie within t of the base's",
        merge=_merge,
        params=(ParamSpec("t", required=True),),
        requires_base=True,
        models=ModelCount(min_models=2, max_models=2),
        elementwise=True,
        memory=WorkingMemory(per_input=2, fixed=2, bytes=4),
    ),
)
