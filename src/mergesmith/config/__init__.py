"""Merge configs (mergekit's format, unchanged): read, validated with pydantic, and reported one line per problem.

Validation that needs no checkpoint happens here, so a bad config fails before any file is opened:
`models`, `slices` and `modules` together, unknown methods, a missing base model, a slice whose sources
cover different numbers of layers. Unknown keys and leftover parameters are warnings, as mergekit
ignores them (see compat.py; `strict` makes them errors). Checks that need the models' headers
(layer ranges past the end, shape mismatches) happen in the planner.

The package, by layer: `schema` (the pydantic models), `compat` (reading as leniently as mergekit),
`method_usage` and `parameter_values` (checks against the methods' registry), and here the reading
itself. The schema's names are importable from `mergesmith.config`, where every reader of a config looks.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from ..io.safe_yaml import YamlLimitError, load_documents
from .compat import Findings, copy_document, prune
from .schema import (
    _ALL_SCHEMAS,
    _TOP_NOTES,
    _TOP_SCHEMA,
    ConditionalParameter,
    InputModelDefinition,
    InputSliceDefinition,
    MergeConfiguration,
    OutputModuleDefinition,
    OutputSliceDefinition,
    Parameters,
    ParameterSetting,
    ScalarOrGradient,
    TokenEmbeddingConfig,
    TokenizerConfig,
    known_dtype_name,
)

__all__ = [
    "ConditionalParameter",
    "InputModelDefinition",
    "InputSliceDefinition",
    "MergeConfiguration",
    "OutputModuleDefinition",
    "OutputSliceDefinition",
    "ParameterSetting",
    "Parameters",
    "ScalarOrGradient",
    "TokenEmbeddingConfig",
    "TokenizerConfig",
    "dump_config",
    "known_dtype_name",
    "lenient_document",
    "load_config",
    "parse_config",
    "read_yaml",
]

def lenient_document(data: dict[str, Any], findings: Findings) -> dict[str, Any]:
    """The document with what mergekit ignores removed (one warning each, in `findings`), numbers written as
    text read as numbers and `revision:` folded into the model reference (multi/stages.py takes a stage's `name` off
    before this)."""
    from ..methods import all_parameter_names

    data = copy_document(data)
    return prune(data, _TOP_SCHEMA, "", findings, _ALL_SCHEMAS, all_parameter_names(), _TOP_NOTES)


_UNION_LABELS = {"bool", "int", "float", "str", "ConditionalParameter"}


def _known_keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The allowed keys of the pydantic model that sits at `loc` (for did-you-mean hints)."""
    if "ConditionalParameter" in loc or "list[ConditionalParameter]" in loc:
        return list(ConditionalParameter.model_fields)
    model: Any = MergeConfiguration
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _inner_model(field.annotation)
    return list(getattr(model, "model_fields", {}).keys()) if model else []


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """Find the BaseModel inside Optional[list[Model]]-style annotations."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _UNION_LABELS or "[" in str(part) or str(part).startswith("function-"):
            continue  # pydantic's union-branch labels say nothing to a user
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _first_error_line(err: ValidationError, source: str) -> str:
    errors = err.errors()
    # Prefer the most specific error: an unknown key or a failed check over union noise.
    errors.sort(key=lambda e: (e["type"] != "extra_forbidden", e["type"] != "value_error", -len(e["loc"])))
    e = errors[0]
    loc = tuple(e["loc"])
    key = _format_loc(loc)
    if e["type"] == "extra_forbidden":
        known = _known_keys_at(loc)
        hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
        suggestion = f" (did you mean `{hint[0]}`?)" if hint else ""
        return f"{source}: unknown key `{key}`{suggestion}"
    if e["type"] == "missing":
        return f"{source}: missing required key `{key}`"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{source}: `{key}`: {msg}" if loc else f"{source}: {msg}"


def parse_config(data: Any, source: str = "config", *, strict: bool = False) -> MergeConfiguration:
    """Validate a loaded YAML document; any problem becomes one ConfigError line naming the key.

    What mergekit would ignore (unknown keys, parameters the method does not use) is left out with a
    warning each, kept in `config.warnings`; `strict` makes the first of them the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    models = data.get("models")
    for i, entry in enumerate(models if isinstance(models, list) else []):
        if isinstance(entry, str):
            raise ConfigError(
                f"{source}: `models[{i}]`: each entry is a mapping: write `- model: {entry}` "
                "(with optional `parameters:`)"
            )
    findings = Findings(source)
    data = lenient_document(data, findings)
    try:
        config = MergeConfiguration.model_validate(data)
    except ValidationError as err:
        raise ConfigError(findings.with_hint(_first_error_line(err, source))) from None
    from .method_usage import validate_method_usage

    findings.warnings.extend(validate_method_usage(config, source))
    from .parameter_values import check_parameter_values

    check_parameter_values(config, source)  # refusals here; the planner repeats it for the warnings
    findings.apply_strict(strict)
    config._warnings = findings.warnings
    return config


def read_yaml(path: str | Path, *, all_documents: bool = False) -> tuple[Any, str]:
    """The YAML at `path` (a list of its documents with `all_documents`) and its text; an unreadable
    or malformed file is one ConfigError line naming the file (and line and column)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.__class__.__name__})") from None
    try:
        data = load_documents(text, all_documents=all_documents)
    except YamlLimitError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if not all_documents and isinstance(exc, yaml.composer.ComposerError) and "another document" in problem:
            raise ConfigError(
                f"{path}: has more than one YAML document (another starts with `---`{where}); "
                "for a multi-stage merge use `mergesmith multi`"
            ) from None
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None or (all_documents and all(d is None for d in data)):
        raise ConfigError(f"{path}: the config file is empty")
    return data, text


def load_config(path: str | Path, *, strict: bool = False) -> MergeConfiguration:
    """Read and validate a YAML merge config from disk (`strict`: see `parse_config`)."""
    data, _text = read_yaml(path)
    return parse_config(data, str(path), strict=strict)


def dump_config(config: MergeConfiguration) -> str:
    """The config as YAML, without unset keys, for `mergekit_config.yml` and the model card."""
    return yaml.safe_dump(config.model_dump(exclude_none=True), sort_keys=False)
