"""Checks and small helpers shared by the merge methods.

Every method merges tensors of one shape; the planner aligns vocabulary rows before a method runs, so
any other mismatch is a real error and is reported with the tensor's name rather than as a broadcast
error deep inside torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .registry import MergeInputs


def check_same_shape(inputs: MergeInputs, method: str) -> None:
    """Raise ValueError naming the tensor when the inputs' shapes differ."""
    shapes = [tuple(t.shape) for t in inputs.tensors]
    if any(s != shapes[0] for s in shapes[1:]):
        name = inputs.tensor_name or "<unnamed tensor>"
        raise ValueError(f"{method}: tensor {name!r}: the models' shapes differ: {shapes}")


def require_base(inputs: MergeInputs, method: str) -> int:
    """The base's index; a missing base reaching a method is a planner bug, reported clearly."""
    if inputs.base_index is None:
        raise ValueError(f"{method}: tensor {inputs.tensor_name!r}: this method requires a base model")
    return inputs.base_index


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
