"""Karcher mean: the Riemannian barycentre of the models' directions on the unit sphere.

Karcher 1977, "Riemannian center of mass and mollifier smoothing"; mergekit docs: "Computes the
Karcher mean (also known as the Riemannian barycenter or Frechet mean) of the input model
parameters". Each flattened tensor x_i is split into a norm |x_i| and a direction u_i = x_i / |x_i|.
The mean direction m minimises sum_i a_i d(m, u_i)^2 (d the great-circle distance, a_i = 1/N); it is
found by Riemannian gradient descent from the normalised Euclidean mean:

    v  = sum_i a_i theta_i / sin(theta_i) (u_i - cos(theta_i) m),  cos(theta_i) = <m, u_i>
    m <- cos|v| m + sin|v| v / |v|     (then renormalised), until |v| < tol or `max_iter` steps

and the result is (sum_i a_i |x_i|) m. Directions whose norm is at most `tol` do not take part in the
mean (their weights are renormalised over the others); all-zero inputs give zero.

Every model in the group takes part equally, the base model included when one is configured (mergekit
0.1.5 ignores the base's special role for this method but still feeds it in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.reductions import dot, l2
from .common import check_same_shape, work_dtype
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory


def karcher_mean(
    tensors: Sequence[torch.Tensor], alphas: Sequence[float], max_iter: int = 10, tol: float = 1e-5
) -> torch.Tensor:
    """Weighted Karcher mean of the tensors' directions, scaled by their weighted mean norm."""
    if len(tensors) == 1:
        return tensors[0]
    dtype = work_dtype(tensors[0])
    norms = [l2(x.to(dtype)) for x in tensors]
    units = [torch.zeros_like(x) if n.item() == 0.0 else (x / n).to(x.dtype) for x, n in zip(tensors, norms)]

    kept = [i for i, n in enumerate(norms) if n.item() > tol]
    if not kept:
        return sum(x * 0 for x in tensors)
    kept_total = sum(alphas[i] for i in kept)
    weights = [alphas[i] / kept_total for i in kept]
    directions = [units[i] for i in kept]

    mean = torch.zeros_like(directions[0])
    for a, u in zip(weights, directions):
        mean += a * u
    mean_norm = l2(mean.to(dtype))
    mean = directions[0].clone() if mean_norm.item() < tol else (mean / mean_norm).to(mean.dtype)

    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for a, u in zip(weights, directions):
            cos_theta = torch.clamp(dot(mean, u), -1.0, 1.0)
            theta = torch.arccos(cos_theta)
            if theta.item() < tol:
                continue  # u coincides with the mean: log map is zero
            step += a * (theta / torch.sin(theta)) * (u - cos_theta * mean)
        step_norm = l2(step.to(dtype))
        if step_norm.item() < tol:
            break
        mean = (torch.cos(step_norm) * mean + torch.sin(step_norm) * (step / step_norm)).to(mean.dtype)
        length = l2(mean.to(dtype))
        if length.item() > tol:
            mean = (mean / length).to(mean.dtype)

    scale = sum(a * n for a, n in zip(alphas, norms))
    return scale * mean


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "karcher")
    n = len(inputs.tensors)
    return karcher_mean(
        inputs.tensors,
        [1.0 / n] * n,
        max_iter=int(inputs.params["max_iter"]),
        tol=float(inputs.params["tol"]),
    )


METHODS = (
    MethodSpec(
        name="karcher",
        description="Riemannian (Karcher) mean of the models' directions, scaled by their mean norm",
        merge=_merge,
        params=(ParamSpec("max_iter", 10), ParamSpec("tol", 1e-5)),
        elementwise=False,
        memory=WorkingMemory(per_input=3, fixed=1, bytes=12),
    ),
)
