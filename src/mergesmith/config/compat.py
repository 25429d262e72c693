"""Reading mergekit configs as leniently as mergekit 0.1.5 does, but out loud.

mergekit's config models ignore every key they do not know, at every level, and its merge methods
ignore every parameter they do not use, so published configs are full of leftovers: `weight` on a
`slerp` merge, `density` left after switching to `linear`, `name:` in a single-document file,
`revision:` beside a model. Refusing them would break the promise that a mergekit config runs
unchanged; ignoring them silently would hide the one leftover that is a typo. So this module turns
each into a warning that names its place (and, for a key, the key it probably meant), and `--strict`
turns every warning into an error. The one exception is a parameter name that no merge method knows
but that is a near miss of one this method uses (`densty`, `wieght`): mergekit would merge with the
default without a word, so that stays an error.

Also here, because YAML 1.1 reads them as text: numbers such as `1e-5` (no dot, so PyYAML keeps a
string) are numbers wherever a parameter value is expected, as mergekit's parameter validation reads
them; and `revision: X` beside a model is folded into the model reference as `model@X`.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

_NUMBER_RE = re.compile(r"^\s*[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")
"""A decimal number as YAML 1.2 writes it (`1e-5`, `1E3`, `.5e-2`, `+2.`); NaN and infinities are not
matched: they are not numbers a merge can use, and their check belongs to the parameter's range."""


def as_number(value: Any) -> Any:
    """`value` as a float when it is text that spells a decimal number, else unchanged."""
    if isinstance(value, str) and _NUMBER_RE.match(value):
        return float(value.replace("_", ""))
    return value


@dataclass
class Findings:
    """What a lenient read found: warnings (each one line, naming its place) in the order met."""

    source: str
    warnings: list[str] = field(default_factory=list)

    def warn(self, where: str, message: str) -> None:
        place = f"`{where}`: " if where else ""
        self.warnings.append(f"{self.source}: {place}{message}")

    def with_hint(self, error: str) -> str:
        """An error about a missing key or parameter, with the ignored near miss that probably meant it
        (`merge_methd` ignored, then `merge_method` missing): the one line then says what to fix."""
        return error + ignored_near_miss(error, self.warnings)

    def apply_strict(self, strict: bool) -> None:
        """Under --strict, the first warning is the error."""
        if strict and self.warnings:
            raise ConfigError(f"{self.warnings[0]} (an error under --strict)")


def ignored_near_miss(error: str, warnings: list[str]) -> str:
    """' (`where` was ignored: did you mean `key`?)' when a warning ignored a near miss of a key `error` names
    (or of `parameters`, which holds a missing parameter): the error is then most likely that near miss."""
    named = [part.split(".")[-1] for part in re.findall(r"`([^`]+)`", error)]
    for key in [*named, "parameters"]:
        for warning in warnings:
            if f"did you mean `{key}`" in warning and "`" in warning:
                return f" (`{warning.split('`')[1]}` was ignored: did you mean `{key}`?)"
    return ""


def _join(loc: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{loc}[{key}]"
    return f"{loc}.{key}" if loc else str(key)


# ----- numbers written as text ---------------------------------------------------------------------
def _numbers_in_setting(setting: Any) -> Any:
    if isinstance(setting, list):
        return [_numbers_in_setting(v) for v in setting]
    if isinstance(setting, dict):
        out = dict(setting)
        if "value" in out:
            out["value"] = _numbers_in_setting(out["value"])
        return out
    return as_number(setting)


def numbers_in_parameters(params: Any) -> Any:
    """A `parameters` mapping with every number written as text (`1e-5`) read as a number."""
    if not isinstance(params, dict):
        return params
    return {name: _numbers_in_setting(setting) for name, setting in params.items()}


# ----- `revision:` beside a model ------------------------------------------------------------------
def fold_revision(entry: Any, key: str, where: str, findings: Findings) -> Any:
    """`{model: org/x, revision: r}` -> `{model: org/x@r}` (what `org/x@r` means: that revision of a hub
    model, from the cache or downloaded). A reference that already names a revision keeps it, with a warning."""
    if not isinstance(entry, dict) or "revision" not in entry:
        return entry
    entry = dict(entry)
    revision = entry.pop("revision")
    ref = entry.get(key)
    if revision is None or not isinstance(ref, str):
        return entry
    if not isinstance(revision, str | int) or isinstance(revision, bool) or not str(revision).strip():
        raise ConfigError(f"{findings.source}: `{where}.revision`: must be a branch, tag or commit, got {revision!r}")
    base, _plus, lora = ref.partition("+")
    if "@" in base:
        findings.warn(f"{where}.revision", f"{ref!r} already names a revision; `revision: {revision}` ignored")
        return entry
    entry[key] = f"{base}@{revision}" + (f"+{lora}" if lora else "")
    return entry


# ----- unknown keys --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schema:
    """The keys one level of a config may hold and how to read its nested levels."""

    label: str  # where such a mapping sits, for "it belongs under ..." hints
    keys: tuple[str, ...]
    lists: dict[str, Schema] = field(default_factory=dict)  # key -> schema of each list item
    maps: dict[str, Schema] = field(default_factory=dict)  # key -> schema of each mapping value
    nested: dict[str, Schema] = field(default_factory=dict)  # key -> schema of the mapping itself
    parameters: tuple[str, ...] = ()  # keys that hold a `parameters` mapping
    models: tuple[str, ...] = ()  # keys whose value names a model (a `revision:` beside them is folded in)


_CONDITION_KEYS = ("filter", "value")


def known_keys_elsewhere(schemas: list[Schema], key: str, here: Schema) -> list[str]:
    return [s.label for s in schemas if key in s.keys and s is not here]


def prune(
    data: Any,
    schema: Schema,
    where: str,
    findings: Findings,
    all_schemas: list[Schema],
    parameter_names: set[str],
    notes: dict[str, str] | None = None,
) -> Any:
    """`data` with the keys `schema` does not know removed (one warning each), nested levels pruned too,
    numbers as text in `parameters` read as numbers and `revision:` folded into the model reference."""
    if not isinstance(data, dict):
        return data  # the schema check reports a wrong kind of value in one line
    for model_key in schema.models:
        data = fold_revision(data, model_key, where or "(top level)", findings)
    out: dict[str, Any] = {}
    for key, value in data.items():
        here = _join(where, key)
        if key not in schema.keys:
            findings.warn(here, _unknown_key_message(str(key), schema, all_schemas, parameter_names, notes))
            continue
        if key in schema.parameters:
            value = _prune_parameters(value, here, findings)
        elif key in schema.lists and isinstance(value, list):
            value = [
                prune(v, schema.lists[key], _join(here, i), findings, all_schemas, parameter_names)
                for i, v in enumerate(value)
            ]
        elif key in schema.maps and isinstance(value, dict):
            value = {
                k: prune(v, schema.maps[key], _join(here, k), findings, all_schemas, parameter_names)
                for k, v in value.items()
            }
        elif key in schema.nested:
            value = prune(value, schema.nested[key], here, findings, all_schemas, parameter_names)
        out[key] = value
    return out


def _prune_parameters(params: Any, where: str, findings: Findings) -> Any:
    """Numbers as text read as numbers; unknown keys of a `{filter, value}` condition dropped."""
    if not isinstance(params, dict):
        return params
    out = {}
    for name, setting in params.items():
        conditions = setting if isinstance(setting, list) else [setting]
        if all(isinstance(c, dict) for c in conditions) and conditions:
            kept = []
            for i, cond in enumerate(conditions):
                cond_where = _join(_join(where, name), i) if isinstance(setting, list) else _join(where, name)
                extra = [k for k in cond if k not in _CONDITION_KEYS]
                for k in extra:
                    hint = difflib.get_close_matches(str(k), _CONDITION_KEYS, n=1)
                    suggestion = f" (did you mean `{hint[0]}`?)" if hint else ""
                    findings.warn(_join(cond_where, k), f"unknown key{suggestion}; ignored")
                kept.append({k: v for k, v in cond.items() if k in _CONDITION_KEYS})
            setting = kept if isinstance(setting, list) else kept[0]
        out[name] = _numbers_in_setting(setting)
    return out


def _unknown_key_message(
    key: str, schema: Schema, all_schemas: list[Schema], parameter_names: set[str], notes: dict[str, str] | None
) -> str:
    if notes and key in notes:
        return notes[key]
    if key in parameter_names and "parameters" in schema.keys:
        return f"{key!r} is a merge parameter, read only under `parameters`; ignored here"
    elsewhere = known_keys_elsewhere(all_schemas, key, schema)
    if elsewhere:
        return f"unknown key here (it belongs to {' or '.join(elsewhere)}); ignored"
    hint = difflib.get_close_matches(key, schema.keys, n=1)
    if hint:
        return f"unknown key (did you mean `{hint[0]}`?); ignored"
    return "unknown key; ignored"


def copy_document(data: Any) -> Any:
    """A deep copy: pruning must never change the caller's document (multi-stage files reuse theirs)."""
    return copy.deepcopy(data)
