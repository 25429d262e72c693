"""Resolving a parameter for one tensor: precedence, name filters and gradients.

A setting is a scalar, a gradient (a list of numbers interpolated linearly over t in [0, 1]; a list
of booleans or strings steps through its values instead), or a list of `{filter, value}` conditions
where the first whose filter is a substring of the tensor name (or is absent or `*`) wins. Levels
are searched most specific first (slice source > slice > model > top level); a level whose
conditions match nothing falls through to the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config import ConditionalParameter, Parameters

_MISSING = object()


def interpolate_gradient(values: Sequence[float], t: float) -> float:
    """Piecewise-linear interpolation of equally spaced `values` at t in [0, 1]."""
    if len(values) == 1:
        return float(values[0])
    t = min(max(float(t), 0.0), 1.0)
    scaled = t * (len(values) - 1)
    lower = min(int(scaled), len(values) - 2)
    frac = scaled - lower
    return float(values[lower]) * (1.0 - frac) + float(values[lower + 1]) * frac


def evaluate_setting(setting: Any, tensor_name: str, t: float) -> Any:
    """The value of one setting for a tensor at position t, or _MISSING if no condition matches."""
    if isinstance(setting, ConditionalParameter):
        setting = [setting]
    if isinstance(setting, list) and setting and all(isinstance(c, ConditionalParameter) for c in setting):
        for cond in setting:
            if cond.filter in (None, "*") or cond.filter in tensor_name:
                return evaluate_setting(cond.value, tensor_name, t)
        return _MISSING
    if isinstance(setting, list):
        if not setting:
            return _MISSING
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in setting):
            return interpolate_gradient(setting, t)
        # switches and names cannot be interpolated: step through them as t advances
        return setting[int(min(max(float(t), 0.0), 1.0) * (len(setting) - 1))]
    return setting


def resolve(name: str, levels: Sequence[Parameters | None], tensor_name: str, t: float) -> Any:
    """The first defined value of `name` across `levels` (most specific first), else _MISSING."""
    for level in levels:
        if level and name in level:
            value = evaluate_setting(level[name], tensor_name, t)
            if value is not _MISSING:
                return value
    return _MISSING


def is_missing(value: Any) -> bool:
    return value is _MISSING
