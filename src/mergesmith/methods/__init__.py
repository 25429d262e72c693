"""Merge methods: pure tensor math, one module per family, registered once with their parameters.

Importing this package registers every built-in method.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from . import (  # noqa: F401  (registration side effect)
    arcee_fusion,
    karcher,
    linear,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    ram,
    sce,
    slerp,
    task_arithmetic,
)
from .registry import MergeFn, MergeInputs, MethodSpec, ParamSpec, get_method, method_names, register

if TYPE_CHECKING:
    from ..config import MergeConfiguration

__all__ = [
    "MergeFn",
    "MergeInputs",
    "MethodSpec",
    "ParamSpec",
    "get_method",
    "method_names",
    "register",
    "require_method",
    "check_parameter_names",
    "validate_method_usage",
]


def require_method(name: str, source: str = "config") -> MethodSpec:
    """The registered method, or a ConfigError with a did-you-mean and the known names."""
    spec = get_method(name)
    if spec is None:
        hint = difflib.get_close_matches(name, method_names(), n=1)
        suggestion = f" (did you mean `{hint[0]}`?)" if hint else ""
        raise ConfigError(
            f"{source}: `merge_method`: unknown method {name!r}{suggestion}; known: {', '.join(method_names())}"
        )
    return spec


def validate_method_usage(config: MergeConfiguration, source: str = "config") -> None:
    """Checks that need the method's spec but no checkpoint: base model present, model counts."""
    spec = require_method(config.merge_method, source)
    groups: list[tuple[str, list[str], str | None]] = []
    if config.models:
        groups.append(("models", [m.model for m in config.models], config.base_model))
    for i, s in enumerate(config.slices or []):
        groups.append((f"slices[{i}].sources", [src.model for src in s.sources], s.base_model or config.base_model))
    for key, models, base in groups:
        if spec.requires_base and not base:
            raise ConfigError(f"{source}: `base_model`: method {spec.name!r} requires a base model")
        base_appended = bool(base) and spec.uses_base_in_models and base not in models
        has_base = bool(base) and (base in models or base_appended)
        problem = spec.count_problem(len(models) + int(base_appended), has_base=has_base)
        if problem:
            raise ConfigError(f"{source}: `{key}`: {problem}")
    check_parameter_names(config, spec, source)


def check_parameter_names(config: MergeConfiguration, spec: MethodSpec, source: str = "config") -> None:
    """Every key of every `parameters` mapping must be a parameter the method declares.

    A misspelled name (`normalise`, `densty`) would otherwise be ignored without a word and the merge
    would quietly use the default. The top level and a slice may set any of the method's parameters
    (a per-model one there applies to every model); a `models` entry or slice source only per-model
    ones, since the method's global parameters are never read from there (as in mergekit). Keys only:
    the values (numbers, gradients, `filter`/`value` lists) are checked by the schema and the planner.
    """
    every = [p.name for p in (*spec.params, *spec.model_params)]
    per_model = [p.name for p in spec.model_params]
    levels: list[tuple[str, Any, list[str]]] = [("parameters", config.parameters, every)]
    for i, m in enumerate(config.models or []):
        levels.append((f"models[{i}].parameters", m.parameters, per_model))
    for i, s in enumerate(config.slices or []):
        levels.append((f"slices[{i}].parameters", s.parameters, every))
        for j, src in enumerate(s.sources):
            levels.append((f"slices[{i}].sources[{j}].parameters", src.parameters, per_model))
    for where, params, allowed in levels:
        for name in params or {}:
            if name in allowed:
                continue
            if name in every:
                raise ConfigError(
                    f"{source}: `{where}.{name}`: {name!r} is a parameter of the whole merge for method "
                    f"{spec.name!r}, not of one model; set it under the top-level or a slice's `parameters`"
                )
            hint = difflib.get_close_matches(name, allowed, n=1) or difflib.get_close_matches(name, every, n=1)
            if hint:
                detail = f" (did you mean `{hint[0]}`?)"
            elif allowed:
                detail = f"; its parameters here: {', '.join(allowed)}"
            else:
                detail = " (it takes no parameters here)"
            raise ConfigError(f"{source}: `{where}.{name}`: method {spec.name!r} has no parameter {name!r}{detail}")
