"""The mergekit-moe config schema (unchanged), parsed and validated without opening any model.

As mergekit-moe does, an unknown key is ignored, but never silently: a warning names it and the key it
probably meant (a misspelt `positive_prompt` ignored leaves an expert without prompts, which the prompt
check then refuses, naming the near miss); `strict` makes each warning an error. `revision:` beside a
`source_model` selects that revision, as `model@revision` does. Checks that need the models
(architectures, sizes) live in the MoE planner.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ..config import known_dtype_name, read_yaml
from ..config.compat import Findings, Schema, copy_document, prune
from ..errors import ConfigError

GateMode = Literal["hidden", "cheap_embed", "random", "uniform_random", "hidden_avg", "hidden_last"]
PROMPT_MODES = ("hidden", "cheap_embed", "hidden_avg", "hidden_last")
"""Gate modes that derive router weights from prompts (the rest draw them at random)."""
RANDOM_MODES = ("random", "uniform_random")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Expert(_Strict):
    """One dense model whose MLP becomes an expert (or the shared expert) in every layer."""

    source_model: str
    positive_prompts: list[str] | None = None
    negative_prompts: list[str] | None = None
    noise_scale: float | None = Field(default=None, ge=0)
    residual_scale: float | None = None


class MoEConfiguration(_Strict):
    """mergekit-moe's config: attention and norms from `base_model`, MLPs from `experts`."""

    base_model: str
    experts: list[Expert] = Field(min_length=1)
    gate_mode: GateMode = "hidden"
    dtype: str | None = None
    experts_per_token: int = 2
    shared_experts: list[Expert] | None = None
    architecture: str | None = None
    _warnings: list[str] = PrivateAttr(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """What reading the config ignored (unknown keys), one line each."""
        return self._warnings

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        return known_dtype_name(value)

    def referenced_models(self) -> list[str]:
        """Every model the config names, base first, each once."""
        names = [self.base_model, *(e.source_model for e in self.experts)]
        names.extend(e.source_model for e in self.shared_experts or [])
        return list(dict.fromkeys(names))

    @property
    def uses_prompts(self) -> bool:
        return self.gate_mode in PROMPT_MODES

    def needs_seed(self) -> bool:
        """Random gates or expert noise draw random numbers, so the merge needs (and records) a seed."""
        noisy = any(e.noise_scale for e in [*self.experts, *(self.shared_experts or [])])
        return self.gate_mode in RANDOM_MODES or noisy


def looks_like_moe(data: Any) -> bool:
    """An MoE config has `experts` and no `merge_method` (merge configs always have one)."""
    return isinstance(data, dict) and "experts" in data and "merge_method" not in data


def _loc_text(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("literal[", "function-")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _error_line(err: ValidationError, source: str) -> str:
    errors = sorted(err.errors(), key=lambda e: (e["type"] != "extra_forbidden", -len(e["loc"])))
    e = errors[0]
    loc = tuple(e["loc"])
    key = _loc_text(loc)
    if e["type"] == "extra_forbidden":
        in_expert = any(p in ("experts", "shared_experts") for p in loc[:-1])
        model: type[BaseModel] = Expert if in_expert else MoEConfiguration
        hint = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
        return f"{source}: unknown key `{key}`" + (f" (did you mean `{hint[0]}`?)" if hint else "")
    if e["type"] == "missing":
        return f"{source}: missing required key `{key}`"
    return f"{source}: `{key}`: {e['msg'].removeprefix('Value error, ')}"


_EXPERT_SCHEMA = Schema("an expert", tuple(Expert.model_fields), models=("source_model",))
_MOE_SCHEMA = Schema(
    "the top level",
    tuple(MoEConfiguration.model_fields),
    lists={"experts": _EXPERT_SCHEMA, "shared_experts": _EXPERT_SCHEMA},
)


def parse_moe_config(
    data: Any, source: str = "config", *, allow_all_same: bool = False, strict: bool = False
) -> MoEConfiguration:
    """Validate a loaded YAML document as an MoE config; any problem is one ConfigError line naming the key.
    Unknown keys are left out with a warning each (`config.warnings`); `strict` makes the first the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    findings = Findings(source)
    data = prune(copy_document(data), _MOE_SCHEMA, "", findings, [_MOE_SCHEMA, _EXPERT_SCHEMA], set())
    try:
        config = MoEConfiguration.model_validate(data)
    except ValidationError as err:
        raise ConfigError(findings.with_hint(_error_line(err, source))) from None
    try:
        validate_moe_config(config, source, allow_all_same=allow_all_same)
    except ConfigError as exc:
        raise ConfigError(findings.with_hint(str(exc))) from None
    findings.apply_strict(strict)
    config._warnings = findings.warnings
    return config


def _check_prompts(expert: Expert, key: str, source: str, mode: str) -> None:
    if not expert.positive_prompts:
        raise ConfigError(
            f"{source}: `{key}.positive_prompts`: gate_mode {mode} needs at least one prompt for model "
            f"{expert.source_model!r}"
            + (" (mergekit-moe requires them for every gate mode but random)" if mode in RANDOM_MODES else "")
        )
    for field_name in ("positive_prompts", "negative_prompts"):
        for i, prompt in enumerate(getattr(expert, field_name) or []):
            if not prompt.strip():
                raise ConfigError(f"{source}: `{key}.{field_name}[{i}]`: empty prompt (model {expert.source_model!r})")


def validate_moe_config(config: MoEConfiguration, source: str = "config", *, allow_all_same: bool = False) -> None:
    """mergekit-moe's sanity checks, each as one line naming the key."""
    n = len(config.experts)
    k = config.experts_per_token
    if k < 1:
        raise ConfigError(f"{source}: `experts_per_token`: must be at least 1, got {k}")
    if k > n:
        raise ConfigError(
            f"{source}: `experts_per_token`: {k} is more than the {n} expert{'s' if n != 1 else ''} in `experts`"
        )
    shared = len(config.shared_experts or [])
    if shared > 1:
        raise ConfigError(f"{source}: `shared_experts`: at most one shared expert is supported, got {shared}")
    if config.gate_mode == "random":
        return  # mergekit-moe checks the prompts for every other mode, uniform_random (which ignores them) included
    for i, expert in enumerate(config.experts):
        _check_prompts(expert, f"experts[{i}]", source, config.gate_mode)
    for i, expert in enumerate(config.shared_experts or []):
        if expert.positive_prompts or expert.negative_prompts:
            _check_prompts(expert, f"shared_experts[{i}]", source, config.gate_mode)
    if n > 1:
        prompt_sets = {(tuple(e.positive_prompts or ()), tuple(e.negative_prompts or ())) for e in config.experts}
        if len(prompt_sets) == 1:
            raise ConfigError(
                f"{source}: `experts`: every expert has the same prompts, so the router cannot tell them apart; "
                "give each expert prompts that show what it is for"
            )
        if not allow_all_same and len({e.source_model for e in config.experts}) == 1:
            raise ConfigError(
                f"{source}: `experts`: every expert is {config.experts[0].source_model!r}: the result computes "
                "the same as that model at more cost; use gate_mode random to upcycle it for training, or pass "
                "--i-understand-this-is-not-useful-without-training"
            )


def load_moe_yaml(path: str | Path) -> tuple[Any, str]:
    """The YAML document at `path` and its text, with one-line errors for unreadable or malformed files."""
    return read_yaml(path)


def is_moe_config_file(path: str | Path) -> bool:
    """Whether the file at `path` is an MoE config (False for anything unreadable: the caller reports it)."""
    try:
        data, _text = load_moe_yaml(path)
    except ConfigError:
        return False
    return looks_like_moe(data)


def load_moe_config(path: str | Path, *, allow_all_same: bool = False, strict: bool = False) -> MoEConfiguration:
    data, _text = load_moe_yaml(path)
    return parse_moe_config(data, str(path), allow_all_same=allow_all_same, strict=strict)


def dump_moe_config(config: MoEConfiguration) -> str:
    """The config as YAML without unset keys, for `mergekit_moe_config.yml` and the model card."""
    return yaml.safe_dump(config.model_dump(exclude_none=True), sort_keys=False)
