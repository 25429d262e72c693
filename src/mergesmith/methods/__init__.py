"""Merge methods: pure tensor math, one module per family, registered once, here, with their parameters.

A method module only defines its MethodSpecs (a `METHODS` tuple); importing it registers nothing. BUILT_IN below
is the one list of the built-in families, registered in that order; then come the methods of installed
third-party packages: each entry point of the `mergesmith.methods` group names a function, called without
arguments, that returns a MethodSpec or a sequence of them (see the README, "Adding a merge method as a package").
Entry points are the packaging standard's plugin mechanism (importlib.metadata reads them); a plugin
that fails to load, returns something else, or takes a name already registered is skipped, and the
reason is given if its method is asked for: a broken plugin never stops a merge that does not use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from importlib.metadata import entry_points

from ..errors import ConfigError
from . import (
    arcee_fusion,
    consensus,
    isotropic,
    karcher,
    linear,
    lines,
    magmax,
    model_stock,
    multislerp,
    nearswap,
    nuslerp,
    passthrough,
    pcb,
    ram,
    regmean,
    sce,
    slerp,
    task_arithmetic,
    task_singular,
    wudi,
)
from .registry import (
    MergeFn,
    MergeInputs,
    MethodSpec,
    ModelCount,
    ParamSpec,
    WorkingMemory,
    get_method,
    method_names,
    register,
)

__all__ = [
    "BUILT_IN",
    "MergeFn",
    "MergeInputs",
    "MethodSpec",
    "ModelCount",
    "ParamSpec",
    "WorkingMemory",
    "get_method",
    "method_names",
    "register",
    "require_method",
    "all_parameter_names",
]

BUILT_IN: tuple[MethodSpec, ...] = (
    *linear.METHODS,  # linear
    *task_arithmetic.METHODS,  # task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs(_ties), della(_linear)
    *consensus.METHODS,  # consensus_ta, consensus_ties
    *magmax.METHODS,  # magmax
    *pcb.METHODS,  # pcb
    *wudi.METHODS,  # wudi
    *sce.METHODS,  # sce
    *slerp.METHODS,  # slerp
    *nuslerp.METHODS,  # nuslerp
    *multislerp.METHODS,  # multislerp
    *karcher.METHODS,  # karcher
    *model_stock.METHODS,  # model_stock
    *nearswap.METHODS,  # nearswap
    *arcee_fusion.METHODS,  # arcee_fusion
    *ram.METHODS,  # ram, ramplus_tl
    *regmean.METHODS,  # regmean (its Grams come from the regmean feature's step)
    *passthrough.METHODS,  # passthrough
    *lines.METHODS,  # lines
    *task_singular.METHODS,  # tsv
    *isotropic.METHODS,  # iso_c, iso_cts
)
"""Every built-in method: a new family's module adds its METHODS here."""

# Every task-vector method, built-in or a plugin's, takes LiNeS' `lines_alpha`/`lines_beta` (methods/lines.py).
for _spec in BUILT_IN:
    register(lines.with_lines_option(_spec))


PLUGIN_GROUP = "mergesmith.methods"
# entry point name -> why it was not registered (said when a config asks for a method of that name)
PLUGIN_PROBLEMS: dict[str, str] = {}


def _plugin_specs(loaded: object) -> list[MethodSpec]:
    """The MethodSpecs an entry point's function returned (TypeError for anything else)."""
    result = loaded() if callable(loaded) else loaded
    specs = [result] if isinstance(result, MethodSpec) else list(result) if isinstance(result, Iterable) else None
    if specs is None or not specs or not all(isinstance(s, MethodSpec) for s in specs):
        raise TypeError(f"it returned {type(result).__name__}, not a MethodSpec or a sequence of them")
    return specs


def _register_plugins() -> None:
    for point in entry_points(group=PLUGIN_GROUP):
        where = f"entry point `{point.name} = {point.value}`"
        if point.dist is not None:
            where += f" of the package {point.dist.metadata['Name']}"
        try:
            specs = _plugin_specs(point.load())
            taken = [n for s in specs for n in (s.name, *s.aliases) if get_method(n) is not None]
            if taken:
                raise ValueError(f"{', '.join(map(repr, taken))} is already a merge method")
        except Exception as exc:  # noqa: BLE001 - a third party's code: any failure only skips that plugin
            PLUGIN_PROBLEMS[point.name] = f"the {where} was not loaded ({type(exc).__name__}: {exc})"
            continue
        for spec in specs:
            register(lines.with_lines_option(spec))


_register_plugins()


def require_method(name: str, source: str = "config") -> MethodSpec:
    """The registered method, or a ConfigError with a did-you-mean and the known names (and, where a
    plugin of that name failed to load, why)."""
    spec = get_method(name)
    if spec is None:
        if name in PLUGIN_PROBLEMS:
            raise ConfigError(f"{source}: `merge_method`: unknown method {name!r}: {PLUGIN_PROBLEMS[name]}")
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
