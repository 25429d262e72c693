"""Linear (weighted-average) merge: out = sum_i w_i * x_i / sum_i w_i (normalize) or sum_i w_i * x_i.

Wortsman et al. 2022, "Model soups". With `normalize` (default) the weights are divided by their sum;
a zero sum leaves them as they are, rather than dividing by zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .registry import MergeInputs, MethodSpec, ParamSpec, register


def linear_average(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool) -> torch.Tensor:
    """Weighted sum of same-shaped tensors, optionally normalised by the sum of weights."""
    stacked = torch.stack(list(tensors), dim=0)
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device)
    w = w.view(-1, *([1] * (stacked.dim() - 1)))
    out = (stacked * w).sum(dim=0)
    if normalize:
        total = float(sum(weights))
        if total != 0.0:
            out = out / total
    return out


def _merge(inputs: MergeInputs) -> torch.Tensor:
    weights = [float(p["weight"]) for p in inputs.model_params]
    return linear_average(inputs.tensors, weights, bool(inputs.params["normalize"]))


register(
    MethodSpec(
        name="linear",
        merge=_merge,
        params=(ParamSpec("normalize", True),),
        model_params=(ParamSpec("weight", required=True),),
        uses_base_in_models=False,
        description="weighted average of the models' tensors",
    )
)
