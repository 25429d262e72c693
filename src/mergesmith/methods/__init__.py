"""Merge methods: pure tensor math, one module per family, registered once with their parameters.

Importing this package registers every built-in method.
"""

from __future__ import annotations

import difflib

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

__all__ = [
    "MergeFn",
    "MergeInputs",
    "MethodSpec",
    "ParamSpec",
    "get_method",
    "method_names",
    "register",
    "require_method",
    "all_parameter_names",
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


def all_parameter_names() -> set[str]:
    """Every parameter name some registered merge method takes."""
    names: set[str] = set()
    for name in method_names():
        spec = get_method(name)
        if spec is not None:
            names |= spec.param_names()
    return names
