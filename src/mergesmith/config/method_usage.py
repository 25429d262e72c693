"""Checks of a merge config against its method's spec that need no checkpoint: a base model where the method
requires one, the number of models it takes, and every `parameters` key sorted into used, ignored (a
warning, as mergekit ignores it) or a typo (an error).

Here rather than in methods/: the methods are pure tensor math and know nothing of configs; the config
layer sits above them and asks their registry.
"""

from __future__ import annotations

import difflib
from typing import Any

from ..errors import ConfigError
from ..methods import MethodSpec, all_parameter_names, require_method
from .schema import MergeConfiguration


def _groups(config: MergeConfiguration) -> list[tuple[str, list[str], str | None]]:
    """(config key, models, base) of every group of models merged together: `models`, each slice, and
    the same inside each module of the `modules:` form."""
    groups: list[tuple[str, list[str], str | None]] = []
    holders: list[tuple[str, Any]] = [("", config)]
    holders += [(f"modules.{name}.", module) for name, module in (config.modules or {}).items()]
    for prefix, holder in holders:
        if holder.models:
            groups.append((f"{prefix}models", [m.model for m in holder.models], config.base_model))
        for i, s in enumerate(holder.slices or []):
            groups.append(
                (f"{prefix}slices[{i}].sources", [src.model for src in s.sources], s.base_model or config.base_model)
            )
    return groups


def validate_method_usage(config: MergeConfiguration, source: str = "config") -> list[str]:
    """Checks that need the method's spec but no checkpoint: base model present, model counts, parameter
    names. Returns the warnings about parameters the method ignores (see `check_parameter_names`)."""
    spec = require_method(config.merge_method, source)
    for key, models, base in _groups(config):
        if spec.requires_base and not base:
            raise ConfigError(f"{source}: `base_model`: method {spec.name!r} requires a base model")
        base_appended = bool(base) and spec.uses_base_in_models and base not in models
        has_base = bool(base) and (base in models or base_appended)
        problem = spec.count_problem(len(models) + int(base_appended), has_base=has_base)
        if problem:
            raise ConfigError(f"{source}: `{key}`: {problem}")
    return check_parameter_names(config, spec, source)


def _parameter_levels(config: MergeConfiguration) -> list[tuple[str, Any, bool]]:
    """(where, parameters, per-model level) of every `parameters` mapping of the config."""
    levels: list[tuple[str, Any, bool]] = [("parameters", config.parameters, False)]
    holders: list[tuple[str, Any]] = [("", config)]
    for name, module in (config.modules or {}).items():
        levels.append((f"modules.{name}.parameters", module.parameters, False))
        holders.append((f"modules.{name}.", module))
    for prefix, holder in holders:
        for i, m in enumerate(holder.models or []):
            levels.append((f"{prefix}models[{i}].parameters", m.parameters, True))
        for i, s in enumerate(holder.slices or []):
            levels.append((f"{prefix}slices[{i}].parameters", s.parameters, False))
            for j, src in enumerate(s.sources):
                levels.append((f"{prefix}slices[{i}].sources[{j}].parameters", src.parameters, True))
    return levels


def check_parameter_names(config: MergeConfiguration, spec: MethodSpec, source: str = "config") -> list[str]:
    """Sort every key of every `parameters` mapping into used, ignored (a warning) or a typo (an error).

    mergekit reads a method's parameters and nothing else: a name this method does not take is ignored,
    and so is a merge-wide parameter (`t`, `lambda`) set on one model, since merge-wide ones are read only
    from a slice, a module and the top level. Published configs are full of such leftovers (`weight` on a
    `slerp` merge), so each is a warning naming its place. A name no method knows that is a near miss of
    one this method takes (`densty`, `wieght`) is an error: mergekit would quietly merge with the default.
    Keys only: the values (numbers, gradients, `filter`/`value` lists) are checked by the schema and the
    planner.
    """
    every = [p.name for p in (*spec.params, *spec.model_params)]
    per_model = [p.name for p in spec.model_params]
    known = all_parameter_names()
    warnings: list[str] = []
    for where, params, model_level in _parameter_levels(config):
        allowed = per_model if model_level else every
        for name in params or {}:
            if name in allowed:
                continue
            here = f"{source}: `{where}.{name}`"
            if name in every:
                warnings.append(
                    f"{here}: {name!r} is a parameter of the whole merge for method {spec.name!r}, not of one "
                    "model; ignored here (set it under the top-level, a module's or a slice's `parameters`)"
                )
                continue
            if name in known:
                warnings.append(f"{here}: method {spec.name!r} does not use {name!r}; ignored")
                continue
            hint = difflib.get_close_matches(name, every, n=1)
            if hint:
                raise ConfigError(f"{here}: method {spec.name!r} has no parameter {name!r} (did you mean `{hint[0]}`?)")
            takes = f"its parameters: {', '.join(every)}" if every else "it takes no parameters"
            warnings.append(f"{here}: unknown parameter {name!r} ({takes}); ignored")
    return warnings
