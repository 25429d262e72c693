"""Merge methods: pure tensor math, one module per family, registered once with their parameters.

Importing this package registers every built-in method.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

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
