"""The MoE planner: a mergekit-moe config + dense checkpoints -> a Plan for the shared executor.

Each layer keeps the base model's attention and norms; its dense MLP is replaced by one expert per
`experts` entry (that model's MLP of the same layer, under the per-expert names of the output family),
a router, and for Qwen2-MoE a shared expert and its gate (DeepSeek: an ungated shared expert, empty
when the config gives none, and a zero router bias for V3). Every output tensor is a `copy` recipe (or
`perturb` for `noise_scale`/`residual_scale`, `zeros` for biases a donor lacks), so a model used as
several experts is simply read several times from its memory map: no warning, no extra memory.

Router weights come from a `GateJob` (see router.py) and are referenced like any input tensor; the
plan needs only their shapes, so planning reads headers alone. Computing them is a pass of its own
before assembly, and the estimate counts it: `hidden`/`hidden_avg` load the whole base model into
transformers in its dtype, `cheap_embed` converts the token embedding to float32. Its memory is part
of the peak (and, when it is the largest working set, named as such), what it reads is part of the
bytes read (and so of the time estimate), and a warning says when it alone exceeds --max-memory,
which cannot split it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..engine.plan import MOE_CONFIG_NAME, Estimate, InputRef, Plan, TensorRecipe
from ..engine.planning.architecture import (
    LM_HEAD_NAMES,
    LayerStack,
    embedding_for_head,
    find_layer_stack,
    is_embedding,
    rewrite_config,
    ties_embeddings,
)
from ..engine.planning.shared import MergeOptions, ModelPlanner, cut_shards, estimate_plan, tensor_seed
from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import Checkpoint
from ..io.dtypes import dtype_size, is_float, parse_config_dtype
from ..io.model_files import TOKENIZER_FILES
from ..sizes import human_size
from .arch import DENSE_MLP, OutputArchitecture, select_architecture
from .card import moe_model_card
from .config import PROMPT_MODES, Expert, MoEConfiguration, dump_moe_config
from .router import ROUTER_MODEL, GateJob, router_tensor, shared_router_tensor


class MoEPlanner(ModelPlanner):
    """Builds the Plan (and the router-weights job) for one MoE config over opened checkpoints."""

    def __init__(
        self,
        config: MoEConfiguration,
        checkpoints: dict[str, Checkpoint],
        options: MergeOptions,
        source: str = "config",
    ) -> None:
        super().__init__(config, checkpoints, options, source)  # the router pass runs on the device checked there
        self.config: MoEConfiguration = config
        self.base = checkpoints[config.base_model]
        if self.base.config is None:
            raise CheckpointError(f"base_model {config.base_model!r}: no config.json in {self.base.root}")
        self.base_cfg: dict[str, Any] = self.base.config
        self.model_type = str(self.base_cfg.get("model_type"))
        self._check_models()
        self.arch: OutputArchitecture = select_architecture(config, self.model_type, source)
        self.stacks: dict[str, LayerStack] = {ref: self._stack(ref) for ref in config.referenced_models()}
        self.layers = self.stacks[config.base_model].count
        self.hidden = int(self.base_cfg["hidden_size"])
        self.out_dtype = self._out_dtype()
        self.warnings: list[str] = []

    # ----- checks ----------------------------------------------------------------------------
    def _members(self) -> list[tuple[str, Expert]]:
        """(config key, expert) for every routed and shared expert, in config order."""
        out = [(f"experts[{i}]", e) for i, e in enumerate(self.config.experts)]
        out += [(f"shared_experts[{i}]", e) for i, e in enumerate(self.config.shared_experts or [])]
        return out

    def _check_models(self) -> None:
        """Every expert must be the base's architecture, width and depth: its MLP replaces the base's."""
        base_ref = self.config.base_model
        for key, expert in self._members():
            cfg = self.ckpts[expert.source_model].config
            if cfg is None:
                raise CheckpointError(
                    f"{self.source}: `{key}.source_model`: model {expert.source_model!r} has no config.json"
                )
            for field, what in (("model_type", "architecture"), ("hidden_size", "hidden size")):
                if cfg.get(field) != self.base_cfg.get(field):
                    raise ConfigError(
                        f"{self.source}: `{key}.source_model`: model {expert.source_model!r} has {what} "
                        f"{cfg.get(field)!r}, but base_model {base_ref!r} has {self.base_cfg.get(field)!r}"
                    )
            if cfg.get("num_hidden_layers") != self.base_cfg.get("num_hidden_layers"):
                raise ConfigError(
                    f"{self.source}: `{key}.source_model`: model {expert.source_model!r} has "
                    f"{cfg.get('num_hidden_layers')} layers, but base_model {base_ref!r} has "
                    f"{self.base_cfg.get('num_hidden_layers')}"
                )

    def _stack(self, ref: str) -> LayerStack:
        ck = self.ckpts[ref]
        stack = find_layer_stack(ck.tensors, ck.config)
        if stack is None:
            raise CheckpointError(f"model {ref!r}: no decoder layer stack found")
        return stack

    def _out_dtype(self) -> str:
        if self.config.dtype:
            return parse_config_dtype(self.config.dtype, "dtype")
        return self.base_dtype()

    # ----- recipes ---------------------------------------------------------------------------
    def _copy(self, out_name: str, ref: str, tensor: str) -> TensorRecipe:
        info = self.ckpts[ref].info(tensor)
        dtype = self.out_dtype if is_float(info.dtype) else info.dtype
        return TensorRecipe(out_name, info.shape, dtype, "copy", (InputRef(ref, tensor),))

    def _mlp(self, key: str, expert: Expert, layer: int, rest: str, out_name: str) -> TensorRecipe:
        """One projection of one expert: a copy, or `perturb` for noise / residual scaling (as mergekit)."""
        ref = expert.source_model
        name = self.stacks[ref].name(layer, rest)
        if not self.ckpts[ref].has(name):
            raise CheckpointError(
                f"{self.source}: `{key}.source_model`: model {ref!r} has no tensor {name!r} (a dense MLP is needed)"
            )
        recipe = self._copy(out_name, ref, name)
        scale = expert.residual_scale if rest == "mlp.down_proj.weight" else None
        if not expert.noise_scale and scale is None:
            return recipe
        seed = None
        if expert.noise_scale:
            assert self.options.random_seed is not None
            seed = tensor_seed(self.options.random_seed, out_name)
        return TensorRecipe(
            out_name,
            recipe.shape,
            recipe.dtype,
            "perturb",
            recipe.inputs,
            params=(("noise_scale", expert.noise_scale), ("scale", scale)),
            seed=seed,
        )

    def _check_expert_tensors(self) -> tuple[int, int | None]:
        """Expert MLPs: only the three dense projections, all routed experts the same size.

        Returns the routed experts' intermediate size and the shared expert's (None without one).
        """
        sizes: dict[str, int] = {}
        for key, expert in self._members():
            ref = expert.source_model
            stack = self.stacks[ref]
            for name in self.ckpts[ref].tensors:
                hit = stack.split(name)
                if hit is not None and hit[1].startswith("mlp.") and hit[1] not in DENSE_MLP:
                    raise CheckpointError(
                        f"{self.source}: `{key}.source_model`: model {ref!r} has {name!r}; {self.arch.name} experts "
                        "hold only gate_proj/up_proj/down_proj weights"
                    )
            gate = self.ckpts[ref].tensors.get(stack.name(0, DENSE_MLP[0]))
            if gate is None:
                raise CheckpointError(
                    f"{self.source}: `{key}.source_model`: model {ref!r} has no {stack.name(0, DENSE_MLP[0])!r}"
                )
            sizes[key] = gate.shape[0]
        routed = {k: v for k, v in sizes.items() if k.startswith("experts")}
        first = next(iter(routed.values()))
        for key, size in routed.items():
            if size != first:
                raise ConfigError(
                    f"{self.source}: `{key}.source_model`: MLP width {size} differs from experts[0]'s {first}; "
                    "the experts of one layer must all have the same size"
                )
        shared = [v for k, v in sizes.items() if k.startswith("shared")]
        return first, (shared[0] if shared else None)

    def recipes(self) -> list[TensorRecipe]:
        """Embeddings, then per layer the base's attention/norms, router, experts (and shared expert), then the head."""
        base_ref = self.config.base_model
        stack = self.stacks[base_ref]
        names = list(self.base.tensors)
        tied = ties_embeddings(self.base_cfg, names)
        per_layer: dict[int, list[str]] = {i: [] for i in range(self.layers)}
        outside: list[str] = []
        for name in names:
            hit = stack.split(name)
            if hit is None:
                if not (tied and name in LM_HEAD_NAMES):
                    outside.append(name)
            elif not hit[1].startswith("mlp."):
                per_layer[hit[0]].append(hit[1])

        recipes = [self._copy(n, base_ref, n) for n in outside if is_embedding(n)]
        for layer in range(self.layers):
            rests = per_layer[layer]
            for rest in rests:
                proj = self.arch.unsupported_bias(rest)
                if proj is not None:
                    raise CheckpointError(
                        f"{self.source}: `base_model`: model {base_ref!r} has {stack.name(layer, rest)!r}; "
                        f"{self.arch.name} attention has no {proj} bias"
                    )
                recipes.append(self._copy(stack.name(layer, rest), base_ref, stack.name(layer, rest)))
            if self.arch.zero_qkv_bias:
                for proj in ("q_proj", "k_proj", "v_proj"):
                    if f"self_attn.{proj}.bias" not in rests:
                        weight = self.base.info(stack.name(layer, f"self_attn.{proj}.weight"))
                        bias = stack.name(layer, f"self_attn.{proj}.bias")
                        recipes.append(TensorRecipe(bias, (weight.shape[0],), self.out_dtype, "zeros", ()))
            recipes.append(self._router_copy(stack.name(layer, self.arch.router), router_tensor(layer)))
            if self.arch.router_bias is not None:
                bias = stack.name(layer, self.arch.router_bias)
                recipes.append(TensorRecipe(bias, (len(self.config.experts),), "F32", "zeros", ()))
            for e, expert in enumerate(self.config.experts):
                for rest in DENSE_MLP:
                    out = stack.name(layer, self.arch.expert_rest(rest, e))
                    recipes.append(self._mlp(f"experts[{e}]", expert, layer, rest, out))
            if self.arch.has_shared:
                recipes += self._shared_expert(layer)
        recipes += [self._copy(n, base_ref, n) for n in outside if not is_embedding(n)]
        return recipes

    def _shared_expert(self, layer: int) -> list[TensorRecipe]:
        """The shared expert's MLP (and its gate, where the family gates it); where the family may do
        without one and the config gives none, its MLP with no rows, as transformers writes it then."""
        stack = self.stacks[self.config.base_model]
        shared = self.config.shared_experts or []
        if not shared:
            out = []
            for rest in DENSE_MLP:
                shape = (self.hidden, 0) if rest == "mlp.down_proj.weight" else (0, self.hidden)
                name = stack.name(layer, self.arch.shared_rest(rest))
                out.append(TensorRecipe(name, shape, self.out_dtype, "zeros", ()))
            return out
        out = [
            self._mlp("shared_experts[0]", shared[0], layer, rest, stack.name(layer, self.arch.shared_rest(rest)))
            for rest in DENSE_MLP
        ]
        if self.arch.shared_gate is not None:
            out.append(self._router_copy(stack.name(layer, self.arch.shared_gate), shared_router_tensor(layer)))
        return out

    def _router_copy(self, out_name: str, tensor: str) -> TensorRecipe:
        info = self.gates.tensor_infos()[tensor]
        return TensorRecipe(out_name, info.shape, self.out_dtype, "copy", (InputRef(ROUTER_MODEL, tensor),))

    # ----- the plan --------------------------------------------------------------------------
    def gate_job(self) -> GateJob:
        shared_row = self.arch.shared_gate is not None
        prompted = list(self.config.experts)
        if shared_row:
            prompted.append((self.config.shared_experts or [])[0])
        embed = None
        if self.config.gate_mode == "cheap_embed":
            embed = embedding_for_head(self.base.tensors, self.stacks[self.config.base_model])
            if embed is None:
                raise CheckpointError(f"base_model {self.config.base_model!r}: no token embedding found")
        return GateJob(
            mode=self.config.gate_mode,
            base=self.base,
            prompted=prompted,
            num_experts=len(self.config.experts),
            shared_row=shared_row,
            layers=self.layers,
            hidden=self.hidden,
            seed=self.options.random_seed if self.config.gate_mode not in PROMPT_MODES else None,
            embed_name=embed,
            device=self.options.device,
            trust_remote_code=self.options.trust_remote_code,
        )

    def files_to_copy(self) -> list[tuple[str, str]]:
        root = self.base.root
        names = list(TOKENIZER_FILES) if self.options.copy_tokenizer else []
        return [(str(root / n), n) for n in [*names, "generation_config.json"] if (root / n).is_file()]

    def _input_bytes(self, ref: InputRef) -> int:
        """Bytes of an input tensor as stored (what reading it costs); the router weights are known by shape before
        their file exists."""
        if ref.model == ROUTER_MODEL:
            return self.gates.tensor_infos()[ref.tensor].nbytes
        return self.ckpts[ref.model].stored_nbytes(ref.tensor)

    def router_pass(self) -> tuple[int, int, str] | None:
        """(working bytes, bytes read, what) of the pass computing the router weights, None in the
        random modes (no pass)."""
        mode = self.config.gate_mode
        if mode not in PROMPT_MODES:
            return None
        if mode == "cheap_embed":
            assert self.gates.embed_name is not None
            info = self.base.info(self.gates.embed_name)
            numel = info.nbytes // dtype_size(info.dtype)
            memory = numel * 4 + (0 if info.dtype == "F32" else info.nbytes)  # read in its dtype, then float32
            return memory, info.nbytes, f"router pass (gate_mode cheap_embed: {self.gates.embed_name} in float32)"
        size = self.base.total_bytes
        return size, size, f"router pass (gate_mode {mode}: the whole base model in transformers)"

    def _with_router_pass(self, estimate: Estimate) -> Estimate:
        """The assembly's estimate with the router pass, which runs alone before it, added."""
        found = self.router_pass()
        if found is None:
            return estimate
        memory, read, what = found
        estimate = replace(
            estimate, bytes_read=estimate.bytes_read + read, peak_memory=max(estimate.peak_memory, memory)
        )
        if memory > estimate.largest_tensor_bytes:
            estimate = replace(estimate, largest_tensor=what, largest_tensor_bytes=memory)
        budget = self.options.max_memory
        if budget and memory > budget:
            self.warnings.append(
                f"the {what} needs about {human_size(memory)}, over the --max-memory budget of {human_size(budget)} "
                "(it cannot be split)"
            )
        return estimate

    def build(self) -> tuple[Plan, GateJob]:
        expert_width, shared_width = self._check_expert_tensors()
        why = self.arch.shared_width_problem(expert_width, shared_width)
        if why is not None:
            raise ConfigError(f"{self.source}: `shared_experts[0].source_model`: {why}")
        self.gates = self.gate_job()
        recipes = self.recipes()
        cfg = self.arch.output_config(
            self.base_cfg, len(self.config.experts), self.config.experts_per_token, expert_width, shared_width
        )
        output_config = rewrite_config(cfg, None, self.out_dtype)
        seed = self.options.random_seed if self.config.needs_seed() else None
        config_yaml = dump_moe_config(self.config)
        if seed is not None:
            config_yaml += f"# random seed used: {seed} (pass --random-seed to reproduce)\n"
        card = moe_model_card(self.config, self.arch.name, seed) if self.options.write_model_card else None
        # The router weights enter the fingerprint by their key (options["moe"]), not by their file,
        # which is written later and may be rewritten: identities list only files that exist now.
        identities = self.input_identities(self.config.referenced_models())
        plan = Plan(
            shards=cut_shards(recipes, self.options.out_shard_size),
            output_config=output_config,
            compute_dtype="F32",
            out_dtype=self.out_dtype,
            files_to_copy=self.files_to_copy(),
            config_yaml=config_yaml,
            config_name=MOE_CONFIG_NAME,
            model_card=card,
            input_identities=identities,
            options={
                "out_shard_size": self.options.out_shard_size,
                "random_seed": seed,
                "explicit_dtype": None,  # copies convert straight to the output dtype, as mergekit-moe does
                "moe": {
                    "architecture": self.arch.name,
                    "experts": len(self.config.experts),
                    "experts_per_token": self.config.experts_per_token,
                    "shared_experts": len(self.config.shared_experts or []),
                    "gate_mode": self.config.gate_mode,
                    "router_weights": self.gates.key,
                },
            },
            random_seed=seed,
            warnings=self.warnings,
            estimate=self._with_router_pass(
                estimate_plan(recipes, self._input_bytes, "F32", self.options.threads, self.options.max_memory)
            ),
        )
        return plan, self.gates

