"""Planner for merge configs: config + checkpoints -> Plan, reading headers only.

Decides, for every output tensor, which input tensors feed it, with which parameters, and what its
shape and dtype will be; then cuts the recipes into shards. No tensor data is read here, so planning
a 70B merge takes a second and fails fast on any inconsistency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...config import MergeConfiguration, Parameters, dump_config
from ...errors import CheckpointError, ConfigError
from ...io.checkpoint import Checkpoint
from ...io.dtypes import is_float, parse_config_dtype
from ...kernels.keyed_random import STREAM_NAME as KEYED_STREAM
from ...methods import MethodSpec, require_method
from ..extensions import data_steps
from ..plan import Estimate, InputRef, Plan, ShardPlan, TensorRecipe
from .architecture import (
    LM_HEAD_NAMES,
    LayerMapError,
    LayerStack,
    embedding_for_head,
    find_layer_stack,
    is_embedding,
    is_optional_tensor,
    layer_count_key,
    rewrite_config,
    stack_in_tensors,
    ties_embeddings,
)
from .parameters import is_missing, resolve
from .quantization import quantize_outputs
from .shared import MergeOptions, ModelPlanner, cut_shards, estimate_plan, tensor_seed
from .vocabulary import VocabularyPlanning


@dataclass(frozen=True)
class SourceRange:
    """One model's contribution to an output slice: layers [start, end) and its own parameters."""

    model: str
    start: int
    end: int
    parameters: Parameters | None


@dataclass(frozen=True)
class NormalizedSlice:
    sources: tuple[SourceRange, ...]
    base_model: str | None
    parameters: Parameters | None
    module_parameters: Parameters | None = None  # a `modules:` entry's, between the slice's and the top level's

    @property
    def length(self) -> int:
        return self.sources[0].end - self.sources[0].start


class Planner(VocabularyPlanning, ModelPlanner):
    """Builds the Plan for one merge configuration over opened checkpoints."""

    # The base model's config.json gives the layer count and the output config; a raw merge
    # (raw/merge.py) plans bare state dicts, which have none, and turns this off.
    needs_model_config: bool = True

    def __init__(
        self,
        config: MergeConfiguration,
        checkpoints: dict[str, Checkpoint],
        options: MergeOptions,
        config_source: str = "config",
    ) -> None:
        super().__init__(config, checkpoints, options, config_source)
        self.config: MergeConfiguration = config
        self.spec: MethodSpec = require_method(config.merge_method, config_source)
        self.base_ref = config.base_or_first_model()
        self.base = checkpoints[self.base_ref]
        if self.base.config is None and self.needs_model_config:
            raise CheckpointError(f"model {self.base_ref!r}: no config.json in {self.base.root}")
        self.stacks: dict[str, LayerStack | None] = {
            ref: find_layer_stack(ck.tensors, ck.config) for ref, ck in checkpoints.items()
        }
        if not options.allow_crimes:
            self._check_architectures()
        self.compute_dtype = parse_config_dtype(config.dtype, "dtype") if config.dtype else "F32"
        self.out_dtype = self._out_dtype()
        from ...config.parameter_values import check_parameter_values

        # what reading the config ignored, then parameter values worth a warning (the refusals ran at parsing)
        self.warnings: list[str] = list(config.warnings) + check_parameter_values(config, config_source)
        # (per-model row counts, output rows) -> embedding/head tensors cut to the smallest vocabulary
        self._truncated: dict[tuple[tuple[tuple[str, int], ...], int], list[str]] = {}
        # tensors only models other than the one the output follows have (warned about once; see _note_extras)
        self._extras: dict[str, dict[str, int]] = {}
        self._rests_index: dict[str, dict[int, list[str]]] = {}
        # (model, tensor) -> bytes of the inputs a data step (engine/extensions.py) makes before the merge
        self._made_inputs: dict[tuple[str, str], int] = {}

    def _check_architectures(self) -> None:
        """mergekit's rule: models whose config.json names different architectures (LlamaForCausalLM
        and MistralForCausalLM) are merged only with --allow-crimes. Models without one are not judged."""
        seen: list[tuple[str, str]] = []
        for ref, ck in self.ckpts.items():
            archs = (ck.config or {}).get("architectures")
            if not isinstance(archs, list) or not archs:
                continue
            arch = str(archs[0])
            other = next(((r, a) for r, a in seen if a != arch), None)
            if other is not None:
                raise ConfigError(
                    f"{self.source}: models {other[0]!r} ({other[1]}) and {ref!r} ({arch}) have different "
                    "architectures; pass --allow-crimes to merge them anyway"
                )
            seen.append((ref, arch))

    # ----- dtype ---------------------------------------------------------------------------
    def _out_dtype(self) -> str:
        if self.config.out_dtype:
            return parse_config_dtype(self.config.out_dtype, "out_dtype")
        if self.config.dtype:
            return parse_config_dtype(self.config.dtype, "dtype")
        return self.base_dtype()

    # ----- slices ----------------------------------------------------------------------------
    def _slices(self) -> list[NormalizedSlice]:
        cfg = self.config
        if cfg.slices:
            out = []
            for i, s in enumerate(cfg.slices):
                for j, src in enumerate(s.sources):
                    stack = self.stacks[src.model]
                    n = stack.count if stack else 0
                    if src.layer_range[1] > n and (mismatch := self._config_mismatch(src.model)) is not None:
                        raise mismatch
                    if src.layer_range[1] > n:
                        raise ConfigError(
                            f"{self.source}: `slices[{i}].sources[{j}].layer_range`: [{src.layer_range[0]}, "
                            f"{src.layer_range[1]}) is past the {n} layers of model {src.model!r}"
                        )
                sources = tuple(SourceRange(src.model, *src.layer_range, src.parameters) for src in s.sources)
                out.append(NormalizedSlice(sources, s.base_model or cfg.base_model, s.parameters))
            return out
        assert cfg.models
        counts = {m.model: (self.stacks[m.model].count if self.stacks[m.model] else 0) for m in cfg.models}
        if len(set(counts.values())) > 1:
            for m in counts:
                if (mismatch := self._config_mismatch(m)) is not None:
                    raise mismatch
            detail = ", ".join(f"{m} has {n}" for m, n in counts.items())
            raise ConfigError(f"{self.source}: `models`: the models have different numbers of layers ({detail})")
        n = next(iter(counts.values()))
        sources = tuple(SourceRange(m.model, 0, n, m.parameters) for m in cfg.models)
        return [NormalizedSlice(sources, cfg.base_model, None)]

    def _config_mismatch(self, ref: str) -> CheckpointError | None:
        """The error for a model whose config.json names a layer count that no layer stack of its tensors has
        (naming the count they do have), or None. Raised only where the layers matter: a merge of models
        that all disagree with their configs alike (a checkpoint with an extra MTP layer) plans as before."""
        ck = self.ckpts[ref]
        claimed = layer_count_key(ck.config)
        found = stack_in_tensors(ck.tensors) if self.stacks[ref] is None else None
        if claimed is None or found is None:
            return None
        return CheckpointError(
            f"model {ref!r}: its config.json says {'.'.join(claimed[0])}: {claimed[1]}, but its tensors have "
            f"{found.count} layers (`{found.prefix}.0` to `{found.prefix}.{found.count - 1}`)"
        )

    # ----- parameters ----------------------------------------------------------------------
    def _model_levels(self, source: SourceRange | None, sl: NormalizedSlice) -> list[Parameters | None]:
        """Precedence: slice source (or `models` entry) > slice > module > top level."""
        levels: list[Parameters | None] = []
        if source is not None:
            levels.append(source.parameters)
        levels.extend([sl.parameters, sl.module_parameters, self.config.parameters])
        return levels

    def _resolve_params(
        self,
        specs: Sequence[Any],
        levels: list[Parameters | None],
        tensor: str,
        t: float,
        who: str,
        is_base: bool = False,
    ) -> tuple[tuple[str, Any], ...]:
        resolved = []
        for p in specs:
            if is_base and getattr(p, "non_base", False):
                continue  # e.g. a task-vector method's `weight`: the base has no task vector to weigh
            value = resolve(p.name, levels, tensor, t)
            if is_missing(value):
                if p.required:
                    from ...config.compat import ignored_near_miss

                    message = (
                        f"{self.source}: `parameters.{p.name}` is required by method {self.spec.name!r} "
                        f"for {who} (tensor {tensor})"
                    )
                    raise ConfigError(message + ignored_near_miss(message, self.config.warnings))
                value = p.default
            problem = p.problem(value)
            if problem:
                raise ConfigError(
                    f"{self.source}: `parameters.{p.name}` of method {self.spec.name!r} for {who} "
                    f"(tensor {tensor}): {problem}"
                )
            resolved.append((p.name, value))
        return tuple(resolved)

    # ----- recipes -------------------------------------------------------------------------
    def _tensor_name_for(self, ref: str, canonical: str, layer: int | None, rest: str | None) -> str | None:
        """The name of the tensor in model `ref` that plays the role of `canonical`."""
        ck = self.ckpts[ref]
        if layer is not None and rest is not None:
            stack = self.stacks[ref]
            if stack is None:
                return None
            name = stack.name(layer, rest)
            return name if ck.has(name) else None
        if ck.has(canonical):
            return canonical
        if canonical in LM_HEAD_NAMES and ties_embeddings(ck.config, ck.tensors):
            return embedding_for_head(ck.tensors, self.stacks[ref])
        return None

    def _recipe(
        self,
        out_name: str,
        canonical: str,
        sl: NormalizedSlice,
        members: list[SourceRange],
        layer_offset: int | None,
        rest: str | None,
        t: float,
        depth: tuple[int, int] | None = None,
    ) -> TensorRecipe:
        """One output tensor merged from `members` (each at its own layer start + offset); `depth` is its output
        layer's (index, the output's layer count), None outside the layer stack (TensorRecipe.depth)."""
        base_ref = sl.base_model
        refs: list[tuple[str, SourceRange | None, int | None]] = [
            (m.model, m, None if layer_offset is None else m.start + layer_offset) for m in members
        ]
        listed = [r for r, _, _ in refs]
        if base_ref and self.spec.uses_base_in_models and base_ref not in listed:
            base_layer = None if layer_offset is None else members[0].start + layer_offset
            refs.append((base_ref, None, base_layer))
        base_index = next((i for i, (r, _, _) in enumerate(refs) if r == base_ref), None)

        inputs: list[InputRef] = []
        infos = []
        lacking: list[tuple[str, int | None]] = []
        for ref, _src, layer in refs:
            name = self._tensor_name_for(ref, canonical, layer, rest)
            if name is None:
                lacking.append((ref, layer))
                continue
            inputs.append(InputRef(ref, name))
            infos.append(self.ckpts[ref].info(name))
        if lacking:
            return self._lacking(out_name, canonical, rest, lacking, inputs, infos, base_ref)

        shapes = {i.shape for i in infos}
        shape = infos[base_index if base_index is not None else 0].shape
        if len(shapes) > 1:
            same_tail = len({s[1:] for s in shapes}) == 1
            if (is_embedding(canonical) or canonical in LM_HEAD_NAMES) and same_tail:
                rows = min(s[0] for s in shapes)
                inputs = [
                    InputRef(i.model, i.tensor, rows if info.shape[0] != rows else None)
                    for i, info in zip(inputs, infos)
                ]
                shape = (rows, *shape[1:])
                self._vocab_rows = rows
                counts = tuple(dict.fromkeys((r.model, i.shape[0]) for r, i in zip(inputs, infos)))
                self._truncated.setdefault((counts, rows), []).append(out_name)
            else:
                # Refused even with --allow-crimes (which only lifts the architecture check): no method can
                # merge tensors of different shapes, and finding out here beats failing halfway through.
                detail = ", ".join(f"{r.model} {list(i.shape)}" for r, i in zip(inputs, infos))
                note = " (--allow-crimes cannot merge tensors of different shapes)" if self.options.allow_crimes else ""
                raise CheckpointError(f"tensor {out_name!r}: shapes differ across models ({detail}){note}")

        dtype = self.out_dtype if is_float(infos[0].dtype) else infos[0].dtype
        model_params = tuple(
            self._resolve_params(
                self.spec.model_params,
                self._model_levels(src, sl),
                inputs[i].tensor,
                t,
                f"model {ref!r}",
                is_base=i == base_index,
            )
            for i, (ref, src, _l) in enumerate(refs)
        )
        for (ref, _src, _l), resolved, ref_in in zip(refs, model_params, inputs):
            problem = self.spec.model_problem(dict(resolved))
            if problem:
                raise ConfigError(
                    f"{self.source}: `parameters` of method {self.spec.name!r} for model {ref!r} "
                    f"(tensor {ref_in.tensor}): {problem}"
                )
        params = self._resolve_params(
            self.spec.params, [sl.parameters, sl.module_parameters, self.config.parameters], out_name, t, "the merge"
        )
        single_copy = (
            len(inputs) == 1
            and self.spec.name == "passthrough"
            and all(v is None or float(v) == 1.0 for _k, v in model_params[0])
        )
        if single_copy or not is_float(infos[0].dtype):
            return TensorRecipe(out_name, tuple(shape), dtype, "copy", (inputs[base_index or 0],))
        seed = None
        if self.spec.randomized:
            assert self.options.random_seed is not None
            seed = tensor_seed(self.options.random_seed, out_name)
        return TensorRecipe(
            out_name,
            tuple(shape),
            dtype,
            "merge",
            tuple(inputs),
            self.spec.name,
            base_index,
            model_params,
            params,
            seed,
            depth=depth,
        )

    def _lacking(
        self,
        out_name: str,
        canonical: str,
        rest: str | None,
        lacking: list[tuple[str, int | None]],
        inputs: list[InputRef],
        infos: list[Any],
        base_ref: str | None,
    ) -> TensorRecipe:
        """The recipe of a tensor some of its models lack: a copy of the base's (or the first model's) when the
        tensor is known to be optional (architecture.is_optional_tensor), else the one-line refusal naming the
        tensor and every model that lacks it, as mergekit refuses a model without a tensor its merge needs."""
        if inputs and is_optional_tensor(canonical):
            pick = next((k for k, i in enumerate(inputs) if i.model == base_ref), 0)
            info = infos[pick]
            dtype = self.out_dtype if is_float(info.dtype) else info.dtype
            return TensorRecipe(out_name, tuple(info.shape), dtype, "copy", (inputs[pick],))
        first_layer = lacking[0][1]
        what = canonical if rest is None else f"layer {first_layer} {rest}"
        same_layer = all(layer == first_layer for _ref, layer in lacking)
        missing = ", ".join(f"{ref!r}" + ("" if same_layer else f" (layer {layer})") for ref, layer in lacking)
        models = "models" if len(lacking) > 1 else "model"
        have = ", ".join(f"{i.model!r}" for i in inputs)
        note = f"; {'models' if len(inputs) > 1 else 'model'} {have} {'have' if len(inputs) > 1 else 'has'} it"
        raise CheckpointError(
            f"tensor {what!r} not found in {models} {missing} (needed for output tensor {out_name!r}"
            f"{note if inputs else ''})"
        )

    def _layer_rests(self, ref: str, layer: int) -> list[str]:
        """The tensor-name tails of one layer of a model, in file order (indexed once per model)."""
        index = self._rests_index.get(ref)
        if index is None:
            index = {}
            stack = self.stacks[ref]
            for n in self.ckpts[ref].tensors if stack is not None else ():
                hit = stack.split(n)
                if hit is not None:
                    index.setdefault(hit[0], []).append(hit[1])
            self._rests_index[ref] = index
        return index.get(layer, [])

    def _note_extras(self, sl: NormalizedSlice, offset: int | None, template: list[str]) -> None:
        """Record tensors that other models of an output layer (offset) or of the non-layer tensors (None) have
        and the model the output follows does not: they are left out (warned about once, in build)."""
        refs = [(m.model, None if offset is None else m.start + offset) for m in sl.sources]
        if sl.base_model and self.spec.uses_base_in_models and sl.base_model not in [r for r, _ in refs]:
            refs.append((sl.base_model, None if offset is None else sl.sources[0].start + offset))
        known = set(template)
        for ref, layer in refs:
            ck = self.ckpts[ref]
            if layer is None:
                stack = self.stacks[ref]
                names = [n for n in ck.tensors if stack is None or stack.split(n) is None]
                tails = [n for n in names if n not in LM_HEAD_NAMES]  # the output's head follows the base's tying
            else:
                tails = self._layer_rests(ref, layer)
            for tail in tails:
                if tail not in known and not is_optional_tensor(tail):
                    key = tail if layer is None else f"{{layers}}.{tail}"
                    self._extras.setdefault(key, {}).setdefault(ref, 0)
                    self._extras[key][ref] += 1

    def _extras_warning(self) -> list[str]:
        if not self._extras:
            return []
        prefix = self.stacks[self.base_ref].prefix if self.stacks[self.base_ref] is not None else "layers"
        shown = []
        for key, owners in list(self._extras.items())[:5]:
            name = key.replace("{layers}", f"{prefix}.N")
            who = ", ".join(
                f"{ref!r}" + (f" ({n} layers)" if "{layers}" in key and n > 1 else "") for ref, n in owners.items()
            )
            shown.append(f"{name} (in {who})")
        more = f" and {len(self._extras) - 5} more" if len(self._extras) > 5 else ""
        return [
            f"tensors that only some models have are left out of the output, which follows model "
            f"{self.base_ref!r} (mergekit leaves out tensors its architecture does not list): "
            f"{'; '.join(shown)}{more}"
        ]

    def recipes(self) -> tuple[list[TensorRecipe], list[int] | None]:
        """All output recipes in file order (embeddings, layers, head) and each output layer's source."""
        slices = self._slices()
        base_stack = self.stacks[self.base_ref]
        base_names = list(self.base.tensors)
        tied = ties_embeddings(self.base.config, base_names)
        non_layer = [n for n in base_names if base_stack is None or base_stack.split(n) is None]
        if tied:
            non_layer = [n for n in non_layer if n not in LM_HEAD_NAMES]
        pre = [n for n in non_layer if is_embedding(n)]
        post = [n for n in non_layer if not is_embedding(n)]
        self._vocab_rows: int | None = None
        self._truncated.clear()
        self._rests_index.clear()
        self._extras.clear()

        recipes: list[TensorRecipe] = []
        first, last = slices[0], slices[-1]
        self._note_extras(first, None, non_layer)
        if last is not first:
            self._note_extras(last, None, non_layer)
        for name in pre:
            recipes.append(self._recipe(name, name, first, list(first.sources), None, None, 0.0))

        layer_sources: list[int] | None = None
        if self.config.slices or base_stack is not None:
            layer_sources = []
            out_stack = base_stack
            out_index = 0
            out_layers = sum(sl.length for sl in slices)
            for sl in slices:
                lead = sl.sources[0]
                lead_stack = self.stacks[lead.model]
                if lead_stack is None:
                    raise CheckpointError(f"model {lead.model!r}: no layer stack found to slice")
                if out_stack is None:
                    out_stack = lead_stack
                for i in range(sl.length):
                    t = 1.0 if sl.length == 1 else i / (sl.length - 1)
                    src_layer = lead.start + i
                    rests = self._layer_rests(lead.model, src_layer)
                    base_ref = sl.base_model if sl.base_model and self.spec.uses_base_in_models else None
                    if base_ref is not None and self.stacks[base_ref] is not None:
                        base_layer = next((m.start for m in sl.sources if m.model == base_ref), lead.start) + i
                        # the base's tensors too: one the lead lacks is refused (in _recipe), not dropped
                        rests = list(dict.fromkeys([*rests, *self._layer_rests(base_ref, base_layer)]))
                    self._note_extras(sl, i, rests)
                    for rest in rests:
                        out_name = out_stack.name(out_index, rest)
                        recipe = self._recipe(
                            out_name, lead_stack.name(src_layer, rest), sl, list(sl.sources), i, rest, t,
                            depth=(out_index, out_layers),
                        )
                        recipes.append(recipe)
                    layer_sources.append(src_layer)
                    out_index += 1
            if not self.config.slices:
                layer_sources = None  # a `models:` merge keeps the base's layers as they are

        for name in post:
            recipes.append(self._recipe(name, name, last, list(last.sources), None, None, 0.0))
        return recipes, layer_sources

    # ----- sharding and the rest --------------------------------------------------------------
    def shards(self, recipes: list[TensorRecipe]) -> list[ShardPlan]:
        return cut_shards(recipes, self.options.out_shard_size)

    def _plan_data_steps(self, recipes: list[TensorRecipe]) -> tuple[list[TensorRecipe], dict[str, Any]]:
        """Run the data steps the config asks for (engine/extensions.py): the recipes they rewrote, and their plan
        options with the steps' names under `prepare` (what execution runs before the merge) and the bytes they
        will write under `prepare_bytes`."""
        options: dict[str, Any] = {}
        names: list[str] = []
        for step in data_steps(self.config):
            result = step.plan(self, recipes)  # type: ignore[arg-type]  # the planner has what a PlanningView has
            recipes = result.recipes
            self.warnings.extend(result.warnings)
            self._made_inputs.update(result.input_bytes)
            options.update(result.plan_options)
            names.append(step.name)
        if names:
            options["prepare"] = names
            options["prepare_bytes"] = sum(self._made_inputs.values())
        return recipes, options

    def _input_nbytes(self, ref: InputRef) -> int:
        """Bytes of one input as stored: a model's tensor, or one a data step makes before the merge."""
        if ref.model not in self.ckpts:
            return self._made_inputs[(ref.model, ref.tensor)]
        return self.ckpts[ref.model].stored_nbytes(ref.tensor)

    def estimate(self, recipes: list[TensorRecipe]) -> Estimate:
        return estimate_plan(
            recipes,
            self._input_nbytes,
            self.compute_dtype,
            self.options.threads,
            self.options.max_memory,
        )

    def build(self) -> Plan:
        recipes, layer_sources = self.recipes()
        tokenizer_plan = self.plan_vocabulary(recipes)
        if tokenizer_plan is not None:
            recipes = tokenizer_plan.recipes
        recipes, data_options = self._plan_data_steps(recipes)
        self.warnings.extend(self._extras_warning())
        if tokenizer_plan is None or tokenizer_plan.vocab_rows is None:  # nothing re-indexes the rows by token
            self.warnings.extend(self._truncation_warnings())
        vocab = self._vocab_rows
        base_vocab = (self.base.config or {}).get("vocab_size") or (
            (self.base.config or {}).get("text_config") or {}
        ).get("vocab_size")
        try:
            output_config = rewrite_config(
                self.base.config or {},
                layer_sources,
                self.out_dtype,
                vocab if vocab is not None and vocab != base_vocab else None,
            )
        except LayerMapError as exc:
            raise ConfigError(f"{self.source}: `slices`: model {self.base_ref!r}: {exc}") from None
        if tokenizer_plan is not None:
            tokenizer_plan.finish_config(output_config)
        recipes = quantize_outputs(recipes, output_config, self.ckpts, self.options.out_quantization)
        from ..card import model_card

        config_yaml = dump_config(self.config)
        if self.spec.randomized and self.options.random_seed is not None:
            config_yaml += f"# random seed used: {self.options.random_seed} (pass --random-seed to reproduce)\n"
        card = (
            model_card(self.config, self.options.random_seed if self.spec.randomized else None)
            if self.options.write_model_card
            else None
        )
        plan = Plan(
            shards=self.shards(recipes),
            output_config=output_config,
            compute_dtype=self.compute_dtype,
            out_dtype=self.out_dtype,
            files_to_copy=self.files_to_copy(tokenizer_plan.files if tokenizer_plan is not None else None),
            config_yaml=config_yaml,
            model_card=card,
            input_identities=self.input_identities(list(self.ckpts)),
            options={
                "out_shard_size": self.options.out_shard_size,
                "random_seed": self.options.random_seed if self.spec.randomized else None,
                "explicit_dtype": self.config.dtype,
                **(tokenizer_plan.plan_options if tokenizer_plan is not None else {}),
                **data_options,
                # the masks' generator decides the bytes: a run of an older one is not resumed with this one
                **({"masks": KEYED_STREAM} if self.spec.randomized and self.spec.keyed_random else {}),
            },
            random_seed=self.options.random_seed if self.spec.randomized else None,
            warnings=self.warnings,
            estimate=self.estimate(recipes),
        )
        if self.options.strict and plan.warnings:
            raise ConfigError(f"{plan.warnings[0]} (--strict turns warnings into errors)")
        return plan
