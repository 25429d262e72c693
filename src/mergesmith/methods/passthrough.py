"""Passthrough: the single source's tensor, unchanged (optionally multiplied by `scale`).

Used for frankenmerges, where slices stack layers of several models; each slice has one source.
"""

from __future__ import annotations

import torch

from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec


def scaled(tensor: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The tensor itself, or the tensor times `scale` when a scale other than 1 is set."""
    if scale is None or float(scale) == 1.0:
        return tensor
    return tensor * float(scale)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    if len(inputs.tensors) != 1:
        raise ValueError(f"passthrough takes exactly one source tensor, got {len(inputs.tensors)}")
    return scaled(inputs.tensors[0], inputs.model_params[0].get("scale"))


METHODS = (
    MethodSpec(
        name="passthrough",
        description="copy one source's tensors (frankenmerges)",
        merge=_merge,
        model_params=(ParamSpec("scale", None),),
        uses_base_in_models=False,
        models=ModelCount(min_models=1, max_models=1),
    ),
)
