"""Multi-SLERP: a weighted spherical barycentre of any number of models.

Goddard, "Multislerp" (https://goddard.blog/posts/multislerp-wow-what-a-cool-idea); mergekit docs:
"barycentric interpolation on a hypersphere ... projects points onto a tangent space at their weighted
Euclidean mean, performs interpolation, and projects back". With x_i the flattened tensors (task
vectors x_i - base when a base is given), w_i the weights (divided by their sum unless
`normalize_weights: false`) and u_i = x_i / (|x_i| + eps):

    m  = sum_i w_i u_i / |sum_i w_i u_i|            (the tangent point, on the unit sphere)
    v  = sum_i w_i (u_i - <u_i, m> m)                (weighted mean of the tangent projections)
    r  = cos|v| m + sin|v| v / |v|                   (exponential map back to the sphere; |v| += eps)
    out = (sum_i w_i |x_i|) r  (+ base)

One model returns itself. When the weighted mean of the unit vectors vanishes (antipodal inputs with
balancing weights) two models fall back to the linear mix and more models are an error, as in
mergekit 0.1.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.reductions import l2, norm_along, sum_along
from .common import as_bool, check_same_shape, non_base_values
from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec, WorkingMemory


def multislerp(
    tensors: Sequence[torch.Tensor],
    weights: Sequence[float],
    base: torch.Tensor | None = None,
    normalize_weights: bool = True,
    eps: float = 1e-8,
    tensor_name: str = "",
) -> torch.Tensor:
    """Spherical weighted average of `tensors` (of their offsets from `base` when given)."""
    if len(tensors) == 1:
        return tensors[0]
    points = torch.stack(list(tensors), dim=0)
    if base is not None:
        points = points - base
    flat = points.view(points.shape[0], -1)

    w = torch.tensor(list(weights), dtype=points.dtype, device=points.device)
    if normalize_weights:
        w = w / w.sum()

    norms = norm_along(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w.view(-1, 1)).sum(0)
    mean_norm = l2(mean)
    if mean_norm < eps:
        if len(tensors) == 2:
            linear = (points[0] * w[0] + points[1] * w[1]).view(points.shape[1:])
            return linear if base is None else linear + base
        raise ValueError(
            f"multislerp: tensor {tensor_name!r}: the weighted mean of the models' directions is zero "
            "(antipodal tensors with balancing weights); choose other weights"
        )
    mean = mean / mean_norm

    tangents = units - sum_along(units * mean, dim=-1, keepdim=True) * mean
    tangent = (tangents * w.view(-1, 1)).sum(0)
    length = l2(tangent) + eps
    on_sphere = mean * torch.cos(length) + tangent * (torch.sin(length) / length)

    out = (on_sphere * (norms.squeeze(-1) * w).sum()).view(points.shape[1:])
    return out if base is None else out + base


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "multislerp")
    others = inputs.others()
    if not others:
        raise ValueError(f"multislerp: tensor {inputs.tensor_name!r}: needs at least one model besides the base")
    return multislerp(
        [inputs.tensors[i] for i in others],
        [float(w) for w in non_base_values(inputs, "weight")],
        base=inputs.base,
        normalize_weights=as_bool(inputs.params["normalize_weights"], "normalize_weights"),
        eps=float(inputs.params["eps"]),
        tensor_name=inputs.tensor_name,
    )


METHODS = (
    MethodSpec(
        name="multislerp",
        description="weighted spherical barycentre of the models (of their task vectors over an optional base)",
        merge=_merge,
        params=(ParamSpec("normalize_weights", True), ParamSpec("eps", 1e-8)),
        model_params=(ParamSpec("weight", required=True, non_base=True),),
        models=ModelCount(min_models=1, min_non_base=1),
        elementwise=False,
        memory=WorkingMemory(per_input=6.5, fixed=1, bytes=0),
    ),
)
