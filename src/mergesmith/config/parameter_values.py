"""Every number a config gives a merge parameter, checked before any checkpoint is opened.

Why here and not where a value is resolved for a tensor: a gradient is interpolated and a `filter` list picks
one condition per tensor, so a value the resolution never reaches (a filter that matches nothing, a gradient
point between layers) would slip through; and one line naming the config key is clearer than one naming a
tensor. Checking each value as written is exact for the ranges below, since they are intervals and a
gradient only interpolates between its points.

What is refused (one ConfigError line naming the key), and what mergekit 0.1.5 does with it (measured with
`mergekit-yaml` on tiny llama models, see README "Input validation"):
- a value that is not finite (`.nan`, `.inf`, in any parameter): mergekit merges it into an all-NaN or
  all-inf model and exits 0;
- a negative `density`: mergekit's DARE fails on it mid-merge (torch.bernoulli), its TIES, DELLA and
  breadcrumbs silently zero that model's task vector;
- a negative `epsilon` (DELLA's spread of keep probabilities, RAM's threshold on changes): DELLA's ranks
  are then inverted, small entries kept more often than large ones, and mergekit fails mid-merge when the
  spread leaves [0, 1]; RAM counts every entry as changed.
What only warns (mergekit accepts it and the result is defined; `--strict` refuses):
- `density: 0` (the model's task vector is dropped entirely) and `density` above 1 (the same as 1);
- SLERP's `t` outside [0, 1] (extrapolates past one of the two models).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from .schema import ConditionalParameter, MergeConfiguration, Parameters

_EPSILON_METHODS = frozenset({"della", "della_linear", "ram", "ramplus"})
_T_UNIT_METHODS = frozenset({"slerp"})


def _numbers(setting: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(key path, value) of every scalar in a setting: a scalar, a gradient, a `{filter, value}` condition or a
    list of them (whose values may be gradients)."""
    if isinstance(setting, ConditionalParameter):
        yield from _numbers(setting.value, f"{path}.value")
    elif isinstance(setting, list):
        conditions = bool(setting) and all(isinstance(c, ConditionalParameter) for c in setting)
        for i, item in enumerate(setting):
            inner = f"{path}[{i}].value" if conditions else f"{path}[{i}]"
            yield from _numbers(item.value if conditions else item, inner)
    else:
        yield path, setting


def _levels(config: MergeConfiguration) -> Iterator[tuple[str, Parameters | None]]:
    yield "parameters", config.parameters
    for i, m in enumerate(config.models or []):
        yield f"models[{i}].parameters", m.parameters
    for i, s in enumerate(config.slices or []):
        yield f"slices[{i}].parameters", s.parameters
        for j, src in enumerate(s.sources):
            yield f"slices[{i}].sources[{j}].parameters", src.parameters


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_parameter_values(config: MergeConfiguration, source: str = "config") -> list[str]:
    """Refuse (ConfigError) a parameter value that is not finite or out of its method's range; return a
    warning per value that mergekit accepts but that is most likely a mistake (see the module docstring)."""
    method = config.merge_method
    warnings: list[str] = []
    for i, s in enumerate(config.slices or []):
        if s.residual_weight is not None and not math.isfinite(s.residual_weight):
            raise ConfigError(f"{source}: `slices[{i}].residual_weight`: {s.residual_weight} is not a finite number")
    for where, params in _levels(config):
        for name, setting in (params or {}).items():
            for path, value in _numbers(setting, f"{where}.{name}"):
                if not _is_number(value):
                    continue  # switches and names: the method's own checks judge them
                if not math.isfinite(value):
                    raise ConfigError(f"{source}: `{path}`: {value} is not a finite number")
                problem, warning = _range(method, name, float(value))
                if problem:
                    raise ConfigError(f"{source}: `{path}`: {problem}")
                if warning:
                    warnings.append(f"{source}: `{path}`: {warning}")
    return warnings


def _range(method: str, name: str, value: float) -> tuple[str | None, str | None]:
    """(why the value is refused, why it is suspicious) for parameter `name` of `method`; None for each
    that does not apply."""
    if name == "density":
        if value < 0:
            return f"density must not be negative, got {value:g} (a density is the fraction of entries kept)", None
        if value == 0:
            return None, "density 0 drops this model's task vector entirely (as in mergekit); leave the model out"
        if value > 1:
            return None, f"density {value:g} is above 1: the task vector is kept whole, as with density 1"
    if name == "epsilon" and method in _EPSILON_METHODS and value < 0:
        return f"epsilon must be 0 or more, got {value:g}", None
    if name == "t" and method in _T_UNIT_METHODS and not 0 <= value <= 1:
        return None, f"t {value:g} is outside [0, 1]: {method} extrapolates past one of the two models"
    return None, None
