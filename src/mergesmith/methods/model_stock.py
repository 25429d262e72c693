"""Model Stock: interpolate between the base and the average of fine-tuned models by their geometry.

Jang et al. 2024, "Model Stock: All we need is just a few fine-tuned models" (arXiv:2403.19522), eq. (2):
for N >= 2 fine-tuned models whose task vectors d_i = x_i - base meet at an average angle theta,

    t = N cos(theta) / (1 + (N - 1) cos(theta)),     out = t * mean_i(x_i) + (1 - t) * base

cos(theta) is the mean over all pairs i < j of cos(d_i, d_j) (each norm product clamped at 1e-6). With
`filter_wise: true` this is done per row of the tensor (per output filter) instead of once per tensor.
Where 1 + (N - 1) cos(theta) is ~0 there is no finite estimate and the base is kept (t = 0), as in
mergekit 0.1.5.
"""

from __future__ import annotations

import torch

from ..kernels.reductions import norm_along, sum_along
from .common import as_bool, check_same_shape, require_base
from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec, WorkingMemory


def model_stock(base: torch.Tensor, models: list[torch.Tensor], filter_wise: bool = False) -> torch.Tensor:
    """t * mean(models) + (1 - t) * base, t from the mean pairwise cosine of the task vectors."""
    shape = base.shape
    if filter_wise:
        if base.dim() == 1:
            base, models = base.unsqueeze(0), [x.unsqueeze(0) for x in models]
    else:
        base, models = base.reshape(-1), [x.reshape(-1) for x in models]

    deltas = [x - base for x in models]
    cosines = []
    for i, d_i in enumerate(deltas):
        for d_j in deltas[i + 1 :]:
            norms = norm_along(d_i, dim=-1) * norm_along(d_j, dim=-1)
            cosines.append((sum_along(d_i * d_j, dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cosines).mean(dim=0).unsqueeze(-1)

    n = len(models)
    denominator = 1 + (n - 1) * cos_theta
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, 0, (n * cos_theta) / torch.where(singular, 1, denominator))
    average = sum(models) / n
    return (t * average + (1 - t) * base).reshape(shape)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "model_stock")
    base = require_base(inputs, "model_stock")
    others = inputs.others()
    if len(others) < 2:
        raise ValueError(
            f"model_stock: tensor {inputs.tensor_name!r}: needs at least two models besides the base, got {len(others)}"
        )
    return model_stock(
        inputs.tensors[base], [inputs.tensors[i] for i in others], as_bool(inputs.params["filter_wise"], "filter_wise")
    )


METHODS = (
    MethodSpec(
        name="model_stock",
        description="Model Stock: base-to-average interpolation from the task vectors' mean angle",
        merge=_merge,
        params=(ParamSpec("filter_wise", False),),
        requires_base=True,
        models=ModelCount(min_models=3),
        elementwise=False,
        memory=WorkingMemory(per_input=3.5, fixed=1, bytes=4),
    ),
)
