"""Raw merges: bare PyTorch state dicts, no config.json, no architecture (mergekit-pytorch's job).

The config is a merge config restricted to what makes sense without layer structure: `merge_method`,
`models` (each a `.safetensors`, `.pt` or `.bin` file, or a directory holding weights), `base_model`,
`parameters`, `dtype`, `out_dtype`. Every tensor is merged by name across the models with any
per-tensor method; parameter filters (`filter:` on tensor names) work as usual, but gradients do
not, since they interpolate over layers and a state dict has none.

Planning reuses `Planner`'s recipe and parameter machinery with its architecture parts switched off
(no layer stacks, no tied-head lookup, no tokenizer, no model card); execution and the output
protocol are the ordinary journaled ones, so raw merges resume, shard and run on Ray like any other.
The output directory holds `model.safetensors` (or shards and an index) and `mergekit_config.yml`;
see `engine.run.completion_marker` for what marks it complete when there is no config.json.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..config import ConditionalParameter, MergeConfiguration, Parameters, load_config
from ..engine.plan import InputRef, Plan, TensorRecipe
from ..engine.planning.merge_planner import NormalizedSlice, Planner, SourceRange
from ..engine.planning.shared import MergeOptions
from ..engine.run import MergeResult, RunControls, choose_random_seed, open_checkpoints, run_planned
from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import Checkpoint
from ..io.dtypes import is_float

TENSOR_SETS = ("exact", "union", "intersection")
_NOT_RAW = {
    "slices": "list the inputs under `models` (a raw merge has no layers to slice)",
    "modules": "list the inputs under `models` (a raw merge has no modules)",
    "tokenizer": "a raw merge has no tokenizer",
    "tokenizer_source": "a raw merge has no tokenizer",
    "chat_template": "a raw merge has no tokenizer",
}


def _has_gradient(params: Parameters | None) -> str | None:
    """The name of a parameter given as a gradient (a list of numbers), if any."""
    for name, setting in (params or {}).items():
        if isinstance(setting, ConditionalParameter):
            setting = [setting]
        if isinstance(setting, list) and all(isinstance(c, ConditionalParameter) for c in setting):
            values = [c.value for c in setting]
        else:
            values = [setting]
        if any(isinstance(v, list) for v in values):
            return name
    return None


def load_raw_config(path: str | Path, *, strict: bool = False) -> MergeConfiguration:
    """A merge config validated for a raw merge: `models` only, no tokenizer keys, no gradients."""
    config = load_config(path, strict=strict)
    return check_raw_config(config, str(path))


def check_raw_config(config: MergeConfiguration, source: str = "config") -> MergeConfiguration:
    for key, why in _NOT_RAW.items():
        if getattr(config, key) is not None:
            raise ConfigError(f"{source}: `{key}` is not supported by a raw merge: {why}")
    levels: list[tuple[str, Parameters | None]] = [("parameters", config.parameters)]
    levels += [(f"models[{i}].parameters", m.parameters) for i, m in enumerate(config.models or [])]
    for where, params in levels:
        name = _has_gradient(params)
        if name is not None:
            raise ConfigError(
                f"{source}: `{where}.{name}`: a gradient interpolates over layers, which a raw merge does not "
                "have; give one value (optionally per tensor with `filter`)"
            )
    return config


class RawPlanner(Planner):
    """Plans a merge of state dicts by tensor name alone.

    `tensor_set` says what to do with a tensor that some models lack: "exact" refuses (naming the
    tensor and the models), "intersection" leaves it out, "union" merges it from the models that
    hold it (copying it when only one does).
    """

    needs_model_config = False

    def __init__(
        self,
        config: MergeConfiguration,
        checkpoints: dict[str, Checkpoint],
        options: MergeOptions,
        config_source: str = "config",
        tensor_set: str = "exact",
    ) -> None:
        if tensor_set not in TENSOR_SETS:
            raise ValueError(f"tensor_set must be one of {TENSOR_SETS}, got {tensor_set!r}")
        options = copy.copy(options)
        options.copy_tokenizer = False
        options.write_model_card = False
        super().__init__(config, checkpoints, options, config_source)
        self.stacks = {ref: None for ref in checkpoints}  # by name only: no layer structure
        self.tensor_set = tensor_set

    def recipes(self) -> tuple[list[TensorRecipe], list[int] | None]:
        """One recipe per tensor name, in the base model's order, then names only other models hold."""
        assert self.config.models
        members = [SourceRange(m.model, 0, 0, m.parameters) for m in self.config.models]
        order = [self.base_ref] + [m.model for m in self.config.models if m.model != self.base_ref]
        contributing = list(dict.fromkeys(order + ([self.config.base_model] if self.config.base_model else [])))
        names = list(dict.fromkeys(n for ref in order for n in self.ckpts[ref].tensors))
        self._vocab_rows = None
        recipes = []
        for name in names:
            holders = [ref for ref in contributing if self.ckpts[ref].has(name)]
            if len(holders) < len(contributing):
                if self.tensor_set == "intersection":
                    continue
                if self.tensor_set == "exact":
                    missing = [ref for ref in contributing if ref not in holders]
                    raise CheckpointError(
                        f"tensor {name!r} is missing from {', '.join(map(repr, missing))} (present in "
                        f"{', '.join(map(repr, holders))}); use --tensor-union to merge it from the models that "
                        "have it or --tensor-intersection to leave it out"
                    )
            recipes.append(self._raw_recipe(name, holders, members, partial=len(holders) < len(contributing)))
        if not recipes:
            raise CheckpointError("the models have no tensor name in common: nothing to merge")
        return recipes, None

    def _raw_recipe(self, name: str, holders: list[str], members: list[SourceRange], partial: bool) -> TensorRecipe:
        infos = {ref: self.ckpts[ref].info(name) for ref in holders}
        shapes = {info.shape for info in infos.values()}
        if len(shapes) > 1 and not self.options.allow_crimes:
            detail = ", ".join(f"{ref} {list(info.shape)}" for ref, info in infos.items())
            raise CheckpointError(f"tensor {name!r}: shapes differ across models ({detail})")
        if partial and len(holders) == 1:  # --tensor-union: only one model has it, so it is that model's
            info = infos[holders[0]]
            dtype = self.out_dtype if is_float(info.dtype) else info.dtype
            return TensorRecipe(name, info.shape, dtype, "copy", (InputRef(holders[0], name),))
        base = self.config.base_model
        if base is not None and base not in holders:
            if self.spec.requires_base:
                raise CheckpointError(
                    f"tensor {name!r} is missing from the base model {base!r}, which method "
                    f"{self.spec.name!r} needs; use --tensor-intersection to leave it out"
                )
            base = None
        present = [m for m in members if m.model in holders]
        contributing = len({m.model for m in present} | ({base} if base and self.spec.uses_base_in_models else set()))
        problem = self.spec.count_problem(contributing, base is not None)
        if problem is not None:
            raise CheckpointError(f"tensor {name!r} is held by only {len(holders)} of the models: {problem}")
        return self._recipe(name, name, NormalizedSlice(tuple(present), base, None), present, None, None, 0.0)

    def files_to_copy(self, *_args: Any, **_kwargs: Any) -> list[tuple[str, str]]:
        """None: a state dict is just tensors (no tokenizer or generation config to carry along)."""
        return []

    def build(self) -> Plan:
        plan = super().build()
        plan.output_config = {}
        plan.options["raw"] = True  # no config.json; part of the fingerprint
        plan.options["tensor_set"] = self.tensor_set
        return plan


def build_raw_plan(
    config: str | Path | MergeConfiguration,
    options: MergeOptions | None = None,
    out_dir: str | Path | None = None,
    tensor_set: str = "exact",
) -> tuple[Plan, dict[str, Checkpoint]]:
    """Plan a raw merge from the inputs' headers (a `.pt`/`.bin` file is loaded, memory-mapped,
    with weights_only, since a pickle has no header to read)."""
    options = options or MergeOptions()
    if isinstance(config, MergeConfiguration):
        cfg, source = check_raw_config(config), "config"
    else:
        cfg, source = load_raw_config(config, strict=options.strict), str(config)
    choose_random_seed(cfg, source, options, out_dir)
    checkpoints = open_checkpoints(cfg, options)
    return RawPlanner(cfg, checkpoints, options, source, tensor_set).build(), checkpoints


def run_raw_merge(
    config: str | Path | MergeConfiguration,
    out_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    tensor_set: str = "exact",
    controls: RunControls = RunControls(),
) -> MergeResult:
    """Merge state dicts into `out_dir`; rerunning after an interruption resumes where it stopped
    (`controls.verify`: see `engine.run.execute_plan`)."""

    def plan_into(options: MergeOptions, out: Path) -> tuple[Plan, dict[str, Checkpoint]]:
        return build_raw_plan(config, options, out, tensor_set)

    return run_planned(plan_into, out_dir, options, controls)
