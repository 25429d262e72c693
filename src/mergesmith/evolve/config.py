"""The evolve config: mergekit-evolve's `genome` + `tasks` file, read unchanged, plus mergesmith's
built-in task kinds.

mergekit-evolve's format (learned from its docs, not copied): a `genome` (models, merge_method,
base_model, tokenizer_source, layer_granularity, normalize, allow_negative_weights, filters, smooth),
a list of `tasks` (a name or {name, weight, metric}) and harness options (limit, num_fewshot, shuffle,
random_init, apply_chat_template, fewshot_as_multiturn). A task with a `type` (exact_match,
multiple_choice, loglikelihood) and a `data` file is one of our built-in evaluators, which need
neither network nor lm-evaluation-harness; any other task name is an lm-eval task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError

BUILTIN_KINDS = ("exact_match", "multiple_choice", "loglikelihood")
LMEVAL_DEFAULT_METRIC = "acc,none"  # mergekit-evolve's default metric


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenomeDefinition(_Strict):
    models: list[str] = Field(min_length=1)
    merge_method: str
    base_model: str | None = None
    tokenizer_source: str | None = None
    layer_granularity: int = Field(default=0, ge=0)
    normalize: bool | None = None
    allow_negative_weights: bool = False
    filters: list[str] | None = None
    smooth: bool = False

    @model_validator(mode="before")
    @classmethod
    def _model_refs(cls, value: Any) -> Any:
        """mergekit accepts `- model: path` entries as well as plain strings."""
        if isinstance(value, dict) and isinstance(value.get("models"), list):
            value = dict(value)
            value["models"] = [m["model"] if isinstance(m, dict) and "model" in m else m for m in value["models"]]
        return value


class TaskDefinition(_Strict):
    name: str
    weight: float = 1.0
    metric: str | None = None
    # mergesmith's built-in evaluators (mergekit ignores keys it does not know, so a genome using them
    # still parses there; it would look the name up in lm-eval)
    type: Literal["exact_match", "multiple_choice", "loglikelihood"] | None = None
    data: str | None = None
    max_new_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _plain_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _builtin_needs_data(self) -> TaskDefinition:
        if self.type is not None and not self.data:
            raise ValueError(f"task {self.name!r}: a built-in `{self.type}` task needs a `data` file")
        if self.type is None and self.data is not None:
            raise ValueError(f"task {self.name!r}: `data` is only for built-in tasks: add `type: exact_match`, "
                             "`multiple_choice` or `loglikelihood`")
        return self

    @property
    def builtin(self) -> bool:
        return self.type is not None


class EvolveConfiguration(_Strict):
    genome: GenomeDefinition
    tasks: list[TaskDefinition] = Field(min_length=1)
    limit: int | None = Field(default=None, ge=1)
    num_fewshot: int | None = Field(default=None, ge=0)
    shuffle: bool = False
    random_init: bool = False
    apply_chat_template: bool = True
    fewshot_as_multiturn: bool = True


def _first_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in e["loc"]).replace(".[", "[")
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key `{loc}`"
    if e["type"] == "missing":
        return f"{source}: missing required key `{loc}`"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{source}: `{loc}`: {msg}" if loc else f"{source}: {msg}"


def parse_evolve_config(data: Any, source: str) -> EvolveConfiguration:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with `genome` and `tasks`, got {type(data).__name__}")
    try:
        return EvolveConfiguration.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_first_error(err, source)) from None


def load_evolve_config(path: str | Path) -> tuple[EvolveConfiguration, dict[str, Any]]:
    """The parsed config and the raw document (relative `data` paths are resolved against the file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: genome file not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read genome file ({exc.__class__.__name__})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}") from None
    config = parse_evolve_config(data, str(path))
    tasks = []
    for task in config.tasks:
        if task.data is not None and not Path(task.data).is_absolute():
            resolved = (path.parent / task.data) if (path.parent / task.data).exists() else Path(task.data)
            task = task.model_copy(update={"data": str(resolved)})
        tasks.append(task)
    config = config.model_copy(update={"tasks": tasks})
    return config, data
