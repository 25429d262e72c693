"""The merge-config schema (mergekit's format, unchanged): the pydantic models and the key tables the lenient
reader prunes by (see compat.py). Checks that need a method's spec live beside it (method_usage.py,
parameter_values.py); reading and reporting are in `config` itself (config/__init__.py).
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..errors import ConfigError
from .compat import Schema

ScalarOrGradient = Union[bool, int, float, str, list[Union[bool, int, float, str]]]


def known_dtype_name(value: str | None) -> str | None:
    """A config dtype name the planner can use (for pydantic validators of merge and MoE configs), checked while
    the config is read so that a typo fails before any model is opened."""
    if value is None:
        return value
    from ..io.dtypes import parse_config_dtype  # imports torch: only for configs that name a dtype

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
