"""NuSLERP: spherical interpolation of two models, optionally of their task vectors over a base.

The interpolation is the slerp of Shoemake 1985 (see slerp.py), with mergekit's three additions
(mergekit docs, "NuSLERP"):

- the factor comes from per-model weights: t = w2 / (w1 + w2) (0.5 when the weights sum to ~0);
- with a `base_model`, the two task vectors d_i = x_i - base are interpolated and added back:
  out = base + slerp(d1, d2; t);
- `nuslerp_flatten` (default true) treats the whole tensor as one vector; when false the tensor is
  interpolated as a set of vectors: along its last dimension (each row of a 2-D weight), or with
  `nuslerp_row_wise: true` along its first dimension (each column).

Nearly collinear vector pairs (1 - cos^2 <= eps^2) fall back to linear interpolation, per vector.
Unlike `slerp`, t and the coefficients stay in the compute dtype (no float32 upcast), as in
mergekit 0.1.5, and the normalisation clamps norms at 1e-7.
"""

from __future__ import annotations

import torch

from ..kernels.reductions import norm_along, sum_along
from .common import as_bool, check_same_shape, non_base_values
from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec, WorkingMemory


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / norm_along(x, dim=-1, keepdim=True).clamp(min=1e-7)


def nuslerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, *, flatten: bool = True, row_wise: bool = False, eps: float = 1e-8
) -> torch.Tensor:
    """Slerp v0 (t = 0) to v1 (t = 1), as one vector (`flatten`) or vector by vector."""
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)

    cos_omega = sum_along(_unit(v0) * _unit(v1), dim=-1, keepdim=True).clamp(-1, 1)
    collinear = (1 - cos_omega.square()) <= eps**2
    omega = torch.acos(torch.where(collinear, 0, cos_omega))
    spherical = (torch.sin((1 - t) * omega) * v0 + torch.sin(t * omega) * v1) / torch.sin(omega)
    out = torch.where(collinear, (1 - t) * v0 + t * v1, spherical)

    if row_wise and not flatten:
        out = out.transpose(0, -1)
    return out.reshape(shape)


def interpolation_factor(w1: float, w2: float) -> float:
    """t = w2 / (w1 + w2), or 0.5 when the weights cancel."""
    total = w1 + w2
    return 0.5 if abs(total) < 1e-6 else w2 / total


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "nuslerp")
    others = inputs.others()
    if len(others) != 2:
        raise ValueError(
            f"nuslerp: tensor {inputs.tensor_name!r}: needs exactly two models besides the base, got {len(others)}"
        )
    w1, w2 = (float(w) for w in non_base_values(inputs, "weight"))
    t = interpolation_factor(w1, w2)
    flatten = as_bool(inputs.params["nuslerp_flatten"], "nuslerp_flatten")
    row_wise = as_bool(inputs.params["nuslerp_row_wise"], "nuslerp_row_wise")
    x1, x2 = inputs.tensors[others[0]], inputs.tensors[others[1]]
    base = inputs.base
    if base is None:
        return nuslerp(t, x1, x2, flatten=flatten, row_wise=row_wise)
    return base + nuslerp(t, x1 - base, x2 - base, flatten=flatten, row_wise=row_wise)


METHODS = (
    MethodSpec(
        name="nuslerp",
        description="slerp of two models (or of their task vectors over an optional base) weighted by `weight`",
        merge=_merge,
        params=(ParamSpec("nuslerp_flatten", True), ParamSpec("nuslerp_row_wise", False)),
        model_params=(ParamSpec("weight", required=True, non_base=True),),
        models=ModelCount(min_models=2, max_models=3, min_non_base=2, max_non_base=2),
        elementwise=False,
        memory=WorkingMemory(per_input=2, fixed=2, bytes=4),
    ),
)
