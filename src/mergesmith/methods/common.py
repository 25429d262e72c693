"""Checks and small helpers shared by the merge methods: parameters read as switches or lists, the work dtype,
the generator a randomised method needs. (The shape and base checks live with MergeInputs, in
kernels.merge_inputs, since the blocked machinery makes them too; they are re-exported here.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.merge_inputs import MergeInputs, check_same_shape, require_base

__all__ = [
    "TaskVectors",
    "as_bool",
    "base_and_other",
    "as_float_list",
    "check_same_shape",
    "non_base_values",
    "require_base",
    "require_generator",
    "stacked_task_vectors",
    "work_dtype",
]


def base_and_other(inputs: MergeInputs, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, other) for a method of the base and exactly one other model (slerp, nearswap, arcee_fusion), after
    the shape check; a ValueError naming the method and tensor otherwise."""
    check_same_shape(inputs, method)
    base = require_base(inputs, method)
    others = inputs.others()
    if len(others) != 1:
        raise ValueError(
            f"{method}: tensor {inputs.tensor_name!r}: needs the base and exactly one other model, "
            f"got {len(inputs.tensors)} models"
        )
    return inputs.tensors[base], inputs.tensors[others[0]]


@dataclass(frozen=True)
class TaskVectors:
    """The task vectors of one tensor, stacked: `deltas[t]` = model `others[t]` - base, in the work dtype
    (`wide` is the base in it). Methods that need all of them at once (consensus, pcb, wudi) start here."""

    base: torch.Tensor
    wide: torch.Tensor
    deltas: torch.Tensor
    others: list[int]


def stacked_task_vectors(inputs: MergeInputs, method: str) -> TaskVectors:
    """Check the shapes and the base, then stack every non-base model's difference from the base (releasing
    each input as soon as its difference is taken: see MergeInputs.done_with). `deltas` has 0 rows when only
    the base contributes."""
    check_same_shape(inputs, method)
    base = inputs.tensors[require_base(inputs, method)]
    others = inputs.others()
    dtype = work_dtype(*inputs.tensors)
    wide = base.to(dtype)
    deltas = torch.empty((len(others), *base.shape), dtype=dtype, device=base.device)
    for row, i in enumerate(others):
        torch.sub(inputs.tensors[i].to(dtype), wide, out=deltas[row])
        inputs.done_with(i)
    return TaskVectors(base, wide, deltas, others)


def non_base_values(inputs: MergeInputs, name: str) -> list[Any]:
    """The per-model parameter `name` of each non-base model, in model order."""
    return [inputs.model_params[i][name] for i in inputs.others()]


def require_generator(generator: torch.Generator | None, method: str, tensor_name: str) -> torch.Generator:
    """Randomised methods draw only from the per-tensor generator, never from torch's global RNG."""
    if generator is None:
        raise ValueError(
            f"{method}: tensor {tensor_name!r}: a random draw is needed but no generator was given "
            "(randomised methods never use the global RNG)"
        )
    return generator


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32 where a method upcasts."""
    return torch.float64 if all(t.dtype == torch.float64 for t in tensors) else torch.float32


def as_float_list(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values]


_TRUE = {"true", "yes", "on", "1", "t", "y"}
_FALSE = {"false", "no", "off", "0", "f", "n"}


def as_bool(value: Any, name: str) -> bool:
    """A switch parameter: bools, 0/1, and the strings YAML or pydantic accept ("false" is False, not truthy)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"parameter `{name}` must be true or false, got {value!r}")
