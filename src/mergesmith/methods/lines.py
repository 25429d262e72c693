"""LiNeS, layer-increasing network scaling of task vectors: a method, and an option of every task-vector method.

Wang, Dimitriadis, Favero, Ortiz-Jimenez, Fleuret & Frossard, "LiNeS: Post-training Layer Scaling Prevents
Forgetting and Enhances Model Merging", ICLR 2025 (arXiv:2410.17146). A merged task vector tau (what a merge adds
to the base) is scaled by the depth of the layer it belongs to, l = 1..L over the output's L layers:

    lambda(l) = alpha + beta * (l - 1) / (L - 1)
    out       = base + lambda(l) * tau

so shallow layers, whose features are general, stay near the base (alpha), and the deepest layer keeps
alpha + beta of the task vectors. Where the paper leaves a choice, its authors' code (github.com/wang-kee/LiNeS,
`LiNeS_scaling`) decides:
- tensors outside the layer stack (embeddings, the final norm, lm_head) are scaled by alpha, as the reference
  scales every parameter whose name matches no block; with a single output layer (L = 1), lambda = alpha;
- l is the OUTPUT layer's depth (engine.plan.TensorRecipe.depth): a frankenmerge's first layer is shallow
  whatever source layer it came from; in a `modules:` merge each module's stack (a vision tower) has its own L;
  a raw state-dict merge (`mergesmith raw`) knows no layers, so every tensor there gets alpha.

The method `lines` is task arithmetic scaled so (the paper's "Task Arithmetic + LiNeS"), with per-model weights:

    tau = sum_i w_i (x_i - base)                 (w_i = `weight`, default 1)

Defaults: for multi-task merging the reference sets alpha = ||sum_t tau_t||_1 / ||tau_MTL||_1 / T over T task
vectors, which for task arithmetic (tau_MTL = sum_t tau_t) is 1/T: the shallow layers get the average of the task
vectors. So `alpha` defaults to 1/T (the count of models besides the base). The paper tunes beta on held-out data
over 0.1, 0.2, ..., 1.0 (the reference's grid); `beta` defaults to 0.5, the middle of that grid.

The option: every registered method whose spec says `task_vector` (its output is base + a merged task vector)
takes `lines_alpha` and `lines_beta`; with either set for a tensor, its output becomes

    out = base + lambda(l) * (merged - base)

with lambda as above (a missing `lines_alpha` is 0 and a missing `lines_beta` 1, the defaults of the reference's
scaling function: nothing of the task vectors at the first layer, all of them at the last). Unset, the method
runs untouched. The scaling is one number per tensor applied entrywise, so a method's row-block and totals paths
stay exact: each block is scaled as the whole tensor would be. It runs in float32 (float64 stays float64) in
chunks over the method's output, so it adds a few MB, not a tensor; on bfloat16 compute the method's output is
rounded once before the scaling (set `dtype: float32` to avoid the second rounding, as for any method).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .registry import MergeInputs, MethodSpec, ParamSpec
from .task_arithmetic import FAMILY

OPTION_NAMES = ("lines_alpha", "lines_beta")
OPTION_DEFAULTS = {"lines_alpha": 0.0, "lines_beta": 1.0}
"""The option's value where only the other parameter is set: the reference scaling function's defaults."""

_CHUNK = 1 << 20  # entries scaled at a time: float32 temporaries of a few MB, whatever the tensor's size


@dataclasses.dataclass(frozen=True)
class NumberParam(ParamSpec):
    """A parameter that is a number when given; its default may be None (absent: the method decides)."""

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {value!r}"
        return None


# ----- the depth and the scale ----------------------------------------------------------------------------------


def depth_fraction(depth: tuple[int, int] | None) -> float:
    """(l - 1) / (L - 1) of an output layer given as (0-based index, layer count); 0 outside the layer stack
    (None) and for a single layer."""
    if depth is None:
        return 0.0
    index, count = depth
    return 0.0 if count <= 1 else index / (count - 1)


def layer_scale(alpha: float, beta: float, depth: tuple[int, int] | None) -> float:
    """lambda(l) = alpha + beta * (l - 1) / (L - 1): the share of the task vector a tensor at `depth` keeps."""
    return alpha + beta * depth_fraction(depth)


def option_scale(params: dict[str, Any], depth: tuple[int, int] | None) -> float | None:
    """The option's lambda for one tensor, or None where neither `lines_alpha` nor `lines_beta` is set."""
    given = {name: params.get(name) for name in OPTION_NAMES}
    if all(value is None for value in given.values()):
        return None
    alpha, beta = (float(OPTION_DEFAULTS[n] if given[n] is None else given[n]) for n in OPTION_NAMES)
    return layer_scale(alpha, beta, depth)


def scale_task_vector(out: torch.Tensor, inputs: MergeInputs, scale: float) -> torch.Tensor:
    """base + scale * (out - base), computed in float32 (float64 stays float64) a chunk at a time and written over
    `out` unless `out` shares memory with an input (a method may return the base itself: then a new tensor)."""
    if inputs.base_index is None:
        raise ValueError(f"lines: tensor {inputs.tensor_name!r}: the LiNeS scaling needs a base model")
    if scale == 1.0:
        return out
    base = inputs.tensors[inputs.base_index]
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    held = {t.untyped_storage().data_ptr() for t in inputs.tensors}
    result = out if out.is_contiguous() and out.untyped_storage().data_ptr() not in held else torch.empty_like(
        out, memory_format=torch.contiguous_format
    )
    flat_out, flat_base, flat_result = out.reshape(-1), base.reshape(-1), result.view(-1)
    for start in range(0, flat_out.numel(), _CHUNK):
        end = start + _CHUNK
        moved = flat_out[start:end].to(work, copy=True)
        origin = flat_base[start:end].to(work)
        flat_result[start:end].copy_(moved.sub_(origin).mul_(scale).add_(origin))
    return result


# ----- the option on every task-vector method -------------------------------------------------------------------


def with_lines_option(spec: MethodSpec) -> MethodSpec:
    """`spec` taking `lines_alpha`/`lines_beta` when it is a task-vector method (`spec.task_vector`), else as it
    is. Applied where methods are registered (methods/__init__.py), to built-in and third-party methods alike,
    so a new task-vector method has the option without a line of its own."""
    if not spec.task_vector or spec.name == "lines" or spec.param_names() & set(OPTION_NAMES):
        return spec
    inner = spec.merge

    def merge(inputs: MergeInputs) -> torch.Tensor:
        scale = option_scale(inputs.params, inputs.depth)
        if scale is None:
            return inner(inputs)
        own = {k: v for k, v in inputs.params.items() if k not in OPTION_NAMES}
        return scale_task_vector(inner(dataclasses.replace(inputs, params=own)), inputs, scale)

    merge.__doc__ = f"{spec.name}, its merged task vector scaled by LiNeS where `lines_alpha`/`lines_beta` are set"
    option = tuple(NumberParam(name, None) for name in OPTION_NAMES)
    return dataclasses.replace(spec, merge=merge, params=(*spec.params, *option))


# ----- the method ------------------------------------------------------------------------------------------------

_TASK_ARITHMETIC = next(member for member in FAMILY if member.name == "task_arithmetic")


def _merge_lines(inputs: MergeInputs) -> torch.Tensor:
    """base + lambda(l) * sum_i w_i (x_i - base): task arithmetic whose lambda is the tensor's LiNeS scale (one
    rounding, the family's own mix and its memory)."""
    alpha = inputs.params.get("alpha")
    tasks = max(1, len(inputs.others()))
    alpha = 1.0 / tasks if alpha is None else float(alpha)
    scale = layer_scale(alpha, float(inputs.params["beta"]), inputs.depth)
    params = {"normalize": False, "rescale": False, "lambda": scale, "int8_mask": False}
    return _TASK_ARITHMETIC.merge(dataclasses.replace(inputs, params=params))


METHODS = (
    MethodSpec(
        name="lines",
        description="LiNeS: task arithmetic scaled from alpha (shallow layers) to alpha + beta (deepest)",
        merge=_merge_lines,
        params=(NumberParam("alpha", None), NumberParam("beta", 0.5)),
        model_params=(NumberParam("weight", 1.0, non_base=True),),
        requires_base=True,
        task_vector=True,
        elementwise=True,
        memory=_TASK_ARITHMETIC.memory,
        warm_up=lambda params, seeded: _TASK_ARITHMETIC.kernel_groups(params, seeded),
    ),
)
