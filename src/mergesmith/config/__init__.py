"""The merge-config schema (mergekit's format, unchanged), parsed and validated with pydantic.

Validation that needs no checkpoint happens here, so a bad config fails before any file is opened:
`models`, `slices` and `modules` together, unknown methods, a missing base model, a slice whose sources
cover different numbers of layers. Unknown keys and leftover parameters are warnings, as mergekit
ignores them (see config_compat.py; `strict` makes them errors). Checks that need the models' headers
(layer ranges past the end, shape mismatches) happen in the planner.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .config_compat import Findings, Schema, copy_document, prune
from .errors import ConfigError
from .validation.safe_yaml import YamlLimitError, load_documents

ScalarOrGradient = Union[bool, int, float, str, list[Union[bool, int, float, str]]]


def known_dtype_name(value: str | None) -> str | None:
    """A config dtype name the planner can use (for pydantic validators of merge and MoE configs), checked while
    the config is read so that a typo fails before any model is opened."""
    if value is None:
        return value
    from .io.dtypes import parse_config_dtype  # imports torch: only for configs that name a dtype

    try:
        parse_config_dtype(value, "dtype")
    except ConfigError:
        raise ValueError(f"unknown dtype {value!r} (use one of bfloat16, float16, float32, float64)") from None
    return value


class ConditionalParameter(BaseModel):
    """A value that applies to tensors whose name contains `filter` (or to all, without a filter)."""

    model_config = ConfigDict(extra="forbid")
    filter: str | None = None
    value: ScalarOrGradient


ParameterSetting = Union[ScalarOrGradient, ConditionalParameter, list[ConditionalParameter]]
Parameters = dict[str, ParameterSetting]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class InputModelDefinition(_Strict):
    model: str
    parameters: Parameters | None = None


class InputSliceDefinition(_Strict):
    model: str
    layer_range: tuple[int, int]
    parameters: Parameters | None = None

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        start, end = value
        if start < 0 or end <= start:
            raise ValueError(f"must be [start, end) with 0 <= start < end, got [{start}, {end}]")
        return value


class OutputSliceDefinition(_Strict):
    sources: list[InputSliceDefinition] = Field(min_length=1)
    base_model: str | None = None
    residual_weight: float | None = None
    parameters: Parameters | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> OutputSliceDefinition:
        lengths = {s.layer_range[1] - s.layer_range[0] for s in self.sources}
        if len(lengths) > 1:
            ranges = ", ".join(f"{s.model} {list(s.layer_range)}" for s in self.sources)
            raise ValueError(f"layer_range: sources cover different numbers of layers ({ranges})")
        return self


class OutputModuleDefinition(_Strict):
    """One module of a multi-module model (mergekit's `modules:` form): its own `models` or `slices` and
    `parameters`, which sit between a slice's and the top level's in precedence."""

    slices: list[OutputSliceDefinition] | None = None
    models: list[InputModelDefinition] | None = None
    parameters: Parameters | None = None

    @model_validator(mode="after")
    def _models_or_slices(self) -> OutputModuleDefinition:
        if bool(self.models) == bool(self.slices):
            raise ValueError("give either `models` or `slices` (exactly one)")
        return self

    def referenced_models(self) -> list[str]:
        names = [m.model for m in self.models or []]
        for s in self.slices or []:
            if s.base_model:
                names.append(s.base_model)
            names.extend(src.model for src in s.sources)
        return names

    def first_model(self) -> str:
        if self.models:
            return self.models[0].model
        assert self.slices
        return self.slices[0].sources[0].model


class TokenEmbeddingConfig(_Strict):
    source: str | dict[str, Any] | None = None
    force: bool = False


class TokenizerConfig(_Strict):
    source: str = "union"  # mergekit's default when a `tokenizer` section is given
    tokens: dict[str, TokenEmbeddingConfig] | None = None
    pad_to_multiple_of: int | None = None


class MergeConfiguration(_Strict):
    merge_method: str
    slices: list[OutputSliceDefinition] | None = None
    models: list[InputModelDefinition] | None = None
    modules: dict[str, OutputModuleDefinition] | None = None
    parameters: Parameters | None = None
    base_model: str | None = None
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    tokenizer: TokenizerConfig | None = None
    chat_template: str | None = None
    _warnings: list[str] = PrivateAttr(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """What reading the config ignored (unknown keys, leftover parameters), one line each."""
        return self._warnings

    @field_validator("dtype", "out_dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        return known_dtype_name(value)

    @model_validator(mode="after")
    def _models_or_slices(self) -> MergeConfiguration:
        given = [key for key in ("models", "slices", "modules") if getattr(self, key)]
        if len(given) == 2:
            raise ValueError(f"give either `{given[0]}` or `{given[1]}`, not both")
        if len(given) == 3:
            raise ValueError("give only one of `models`, `slices` or `modules`")
        if not given:
            raise ValueError("one of `models`, `slices` or `modules` is required")
        if self.tokenizer is not None and self.tokenizer_source is not None:
            raise ValueError("give either `tokenizer` or `tokenizer_source`, not both")
        return self

    def referenced_models(self) -> list[str]:
        """Every model the config names, base first, each once, in order of appearance."""
        names: list[str] = []
        if self.base_model:
            names.append(self.base_model)
        if self.models:
            names.extend(m.model for m in self.models)
        for s in self.slices or []:
            if s.base_model:
                names.append(s.base_model)
            names.extend(src.model for src in s.sources)
        for module in (self.modules or {}).values():
            names.extend(module.referenced_models())
        return list(dict.fromkeys(names))

    def base_or_first_model(self) -> str:
        """The model whose config.json and non-layer tensor names the output inherits."""
        if self.base_model:
            return self.base_model
        if self.models:
            return self.models[0].model
        if self.modules:
            return next(iter(self.modules.values())).first_model()
        assert self.slices
        return self.slices[0].sources[0].model


def _schema(model: type[BaseModel], label: str, **nested: Any) -> Schema:
    keys = tuple(model.model_fields)
    params = ("parameters",) if "parameters" in keys else ()
    models = ("model",) if "model" in keys else ()
    return Schema(label, keys, parameters=params, models=models, **nested)


_SOURCE_SCHEMA = _schema(InputSliceDefinition, "a slice source")
_SLICE_SCHEMA = _schema(OutputSliceDefinition, "a slice", lists={"sources": _SOURCE_SCHEMA})
_MODEL_SCHEMA = _schema(InputModelDefinition, "a `models` entry")
_MODULE_SCHEMA = _schema(OutputModuleDefinition, "a module", lists={"slices": _SLICE_SCHEMA, "models": _MODEL_SCHEMA})
_TOKEN_SCHEMA = _schema(TokenEmbeddingConfig, "a `tokenizer.tokens` entry")
_TOKENIZER_SCHEMA = _schema(TokenizerConfig, "`tokenizer`", maps={"tokens": _TOKEN_SCHEMA})
_TOP_SCHEMA = _schema(
    MergeConfiguration,
    "the top level",
    lists={"slices": _SLICE_SCHEMA, "models": _MODEL_SCHEMA},
    maps={"modules": _MODULE_SCHEMA},
    nested={"tokenizer": _TOKENIZER_SCHEMA},
)
_ALL_SCHEMAS = [
    _TOP_SCHEMA,
    _SLICE_SCHEMA,
    _SOURCE_SCHEMA,
    _MODEL_SCHEMA,
    _MODULE_SCHEMA,
    _TOKENIZER_SCHEMA,
    _TOKEN_SCHEMA,
]
_TOP_NOTES = {
    "name": "`name` names a stage of a multi-stage file (run those with `mergesmith multi`); ignored in a single merge",
}


def lenient_document(data: dict[str, Any], findings: Findings) -> dict[str, Any]:
    """The document with what mergekit ignores removed (one warning each, in `findings`), numbers written as
    text read as numbers and `revision:` folded into the model reference (multi/stages.py takes a stage's `name` off
    before this)."""
    from .methods import all_parameter_names

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
    from .methods import validate_method_usage

    findings.warnings.extend(validate_method_usage(config, source))
    from .validation.parameter_values import check_parameter_values

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
    """The config as YAML, without unset keys, for `mergesmith_config.yml` and the model card."""
    return yaml.safe_dump(config.model_dump(exclude_none=True), sort_keys=False)
