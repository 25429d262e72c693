"""Recipe operations beyond `copy` and `merge`: how an output tensor is assembled from its inputs.

Planners other than the merge planner (MoE assembly, ...) need to build one output tensor from
several inputs without any merge math, e.g. stacking dense MLP weights into a fused expert tensor.
Each op is a pure function of the recipe and a loader that returns an input tensor; registering it
here is all the executor needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .plan import InputRef, TensorRecipe

Loader = Callable[[InputRef], torch.Tensor]
OpFn = Callable[[TensorRecipe, Loader], torch.Tensor]

_OPS: dict[str, OpFn] = {}


def register_op(name: str, fn: OpFn) -> OpFn:
    if name in _OPS or name in ("copy", "merge"):
        raise ValueError(f"recipe op {name!r} registered twice")
    _OPS[name] = fn
    return fn


def get_op(name: str) -> OpFn:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown recipe op {name!r}") from None


def stack_op(recipe: TensorRecipe, load: Loader) -> torch.Tensor:
    """Stack inputs along a new dim 0, after concatenating each run of `group` inputs along `cat_dim`.

    params: `group` (default 1), `cat_dim` (default 0), `transpose` (swap the last two dims of each
    input first; default False). With group=2 this turns per-expert (gate, up) pairs into a fused
    [experts, 2*intermediate, hidden] tensor.
    """
    params = dict(recipe.params)
    group = int(params.get("group", 1))
    cat_dim = int(params.get("cat_dim", 0))
    transpose = bool(params.get("transpose", False))
    tensors = [load(ref) for ref in recipe.inputs]
    if transpose:
        tensors = [t.transpose(-1, -2) for t in tensors]
    if len(tensors) % group:
        raise ValueError(f"{recipe.name}: {len(tensors)} inputs do not split into groups of {group}")
    parts = [
        torch.cat(tensors[i : i + group], dim=cat_dim) if group > 1 else tensors[i]
        for i in range(0, len(tensors), group)
    ]
    return torch.stack(parts, dim=0)


register_op("stack", stack_op)
