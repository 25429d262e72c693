"""The MoE output architectures: how a dense model's tensors and config.json become an MoE model's.

Tensor names are the ones transformers itself writes with `save_pretrained` (checked against 5.23):
one tensor per expert and projection, `block_sparse_moe.experts.N.w1/w2/w3` for Mixtral and
`mlp.experts.N.gate_proj/up_proj/down_proj` for Qwen2-MoE and Qwen3-MoE. transformers 5 fuses the
experts into 3-D `mlp.experts.gate_up_proj`/`down_proj` parameters in memory but converts this on-disk
layout on load (and back on save), and it is the layout transformers 4.x, vLLM and llama.cpp's
converter read, so it is the one that loads everywhere.

DeepSeek (V2 and V3, the classes transformers ships) is built from DeepSeek models only: a
`deepseek_v2` or `deepseek_v3` base (attention, norms, embeddings) and experts of the same type whose
every layer has a dense `mlp.gate_proj/up_proj/down_proj` (`first_k_dense_replace` = the layer count;
an expert with MoE layers is refused, naming its first expert tensor). DeepSeek attention is MLA: keys
and values come out of a compressed latent that passes through an RMSNorm (`kv_a_layernorm`) before
`kv_b_proj` expands it, and the rotary part of the key is one head shared by all heads. No setting of
the config turns that into a Llama/Mistral/Qwen attention (the norm is not linear, so no choice of
weights undoes it), so a dense llama-like model cannot fill it: other bases are refused by type, in
one line naming `architecture` (or `base_model` when the family was not named). mergekit's DeepSeek
output put llama models into the remote-code `deepseek` class of DeepSeek-MoE 16B instead, which
transformers does not ship.

The output is MoE in every layer (`first_k_dense_replace` 0, `moe_layer_freq` 1); its routed experts
are the experts' MLPs, its router `mlp.gate.weight` (V3 adds a zero `e_score_correction_bias`), and
routed weights are not rescaled (`routed_scaling_factor` 1). V3 scores with a sigmoid, ranks one group
of experts (`n_group`/`topk_group` 1, which needs at least two experts: the group's score is its two
best) and renormalises the chosen scores to sum to 1 (`norm_topk_prob`), as Mixtral does. V2 scores
with a softmax and keeps the chosen experts' probabilities as they are (transformers' class has no
renormalisation, so `norm_topk_prob` is written false for every runtime to agree): with fewer experts
per token than experts, its routed output is scaled by their share. `scoring_func` and `topk_method`
are written too, for runtimes that read them (vLLM). The shared expert (`shared_experts`, at most one)
is added to every token ungated, as DeepSeek does, so it takes no prompts; its MLP width must be a
whole number of routed experts' (`n_shared_experts` = the ratio). Without one the family still has
the module, written empty (`n_shared_experts` 0), exactly as transformers saves such a config.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .config import RANDOM_MODES, MoEConfiguration

DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
"""The three tensors of a dense SwiGLU MLP, as each layer of the supported donors names them."""
_BIAS_RE = re.compile(r"^self_attn\.(?P<proj>[a-z_]+)\.bias$")


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


@dataclass(frozen=True)
class OutputArchitecture:
    """One MoE model family transformers can load, and what it accepts as input."""

    name: str
    aliases: tuple[str, ...]  # normalised spellings `architecture:` may start with
    model_type: str
    class_name: str
    input_types: tuple[str, ...]
    expert_count_key: str
    expert_names: tuple[str, str, str]  # gate, up, down per-expert rest templates with {e}
    router: str  # per-layer rest of the router weight [experts, hidden]
    shared_prefix: str | None = None  # the shared expert's MLP rest prefix, when the family has one
    shared_gate: str | None = None  # its sigmoid gate [1, hidden]
    attention_biases: tuple[str, ...] | None = ()  # q/k/v/o biases it holds; None: whatever the config says
    zero_qkv_bias: bool = False  # writes zero q/k/v biases for donors without them
    shared_optional: bool = False  # the shared expert may be left out (written empty, as DeepSeek's is)
    router_bias: str | None = None  # per-layer rest of a router bias written as zeros [experts], float32
    min_experts: int = 1
    input_note: str = ""  # why only input_types, said once when the models are of another type

    @property
    def has_shared(self) -> bool:
        return self.shared_prefix is not None

    def matches(self, requested: str) -> bool:
        wanted = _norm(requested)
        return bool(wanted) and any(a.startswith(wanted) for a in self.aliases)

    def why_not(self, config: MoEConfiguration) -> str | None:
        """Why this family, built from the config's model type, cannot hold the config (None when it can)."""
        shared = config.shared_experts or []
        if len(config.experts) < self.min_experts:
            return f"{self.name} needs at least {self.min_experts} entries in `experts`"
        if self.has_shared and len(shared) != 1 and not (self.shared_optional and not shared):
            return f"{self.name} needs exactly one entry in `shared_experts`"
        if not self.has_shared and shared:
            return f"{self.name} has no shared expert (remove `shared_experts`)"
        if not shared:
            return None
        if self.shared_gate is None and (shared[0].positive_prompts or shared[0].negative_prompts):
            return (
                f"{self.name} adds its shared expert to every token ungated, so "
                "`shared_experts[0]` takes no prompts (remove them)"
            )
        if self.shared_gate is not None and config.gate_mode not in RANDOM_MODES and not shared[0].positive_prompts:
            return (
                f"{self.name} gates its shared expert, so gate_mode {config.gate_mode} needs "
                "`shared_experts[0].positive_prompts`"
            )
        return None

    def shared_width_problem(self, expert_width: int, shared_width: int | None) -> str | None:
        """Why the shared expert's MLP width does not fit this family (None when it does): DeepSeek
        sizes it as a whole number of routed experts."""
        if shared_width is None or self.model_type not in _DEEPSEEK_TYPES or shared_width % expert_width == 0:
            return None
        return (
            f"{self.name} sizes its shared expert in routed experts, but its MLP width {shared_width} is not "
            f"a multiple of the experts' {expert_width}"
        )

    def expert_rest(self, dense_rest: str, expert: int) -> str:
        return self.expert_names[DENSE_MLP.index(dense_rest)].format(e=expert)

    def shared_rest(self, dense_rest: str) -> str:
        assert self.shared_prefix is not None
        return self.shared_prefix + dense_rest.removeprefix("mlp.")

    def unsupported_bias(self, rest: str) -> str | None:
        """The attention projection of `rest` if it is a bias this family cannot hold."""
        m = _BIAS_RE.match(rest)
        if m is None or self.attention_biases is None:
            return None
        return None if m.group("proj") in self.attention_biases else m.group("proj")

    def output_config(
        self,
        base: dict[str, Any],
        num_experts: int,
        experts_per_token: int,
        expert_intermediate: int,
        shared_intermediate: int | None,
    ) -> dict[str, Any]:
        """The base's config.json turned into this family's, everything not MoE-specific kept as is."""
        out = copy.deepcopy(base)
        donor = out.get("model_type")
        out["model_type"] = self.model_type
        out["architectures"] = [self.class_name]
        out[self.expert_count_key] = num_experts
        out["num_experts_per_tok"] = experts_per_token
        for key in ("mlp_bias", "attention_bias", "pretraining_tp"):
            if donor in ("llama", "mistral") and key in out:
                del out[key]  # Llama-only switches (checked off by the planner); meaningless here
        if self.model_type == "mixtral":
            out["intermediate_size"] = expert_intermediate
            return out
        out["moe_intermediate_size"] = expert_intermediate
        if self.model_type in _DEEPSEEK_TYPES:
            return _deepseek_config(out, expert_intermediate, shared_intermediate)
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = []
        out["norm_topk_prob"] = True  # as mergekit: mix the chosen experts with weights summing to 1
        if shared_intermediate is not None:
            out["shared_expert_intermediate_size"] = shared_intermediate
        if self.zero_qkv_bias:
            out["qkv_bias"] = True
        if self.model_type == "qwen2_moe" and donor in ("llama", "mistral"):
            window = out.get("sliding_window")
            layers = out.get("num_hidden_layers")
            if donor == "mistral" and isinstance(window, int) and window > 0 and isinstance(layers, int):
                # Mistral slides its window in every layer; Qwen2-MoE does where layer_types says so.
                out["use_sliding_window"] = True
                out["max_window_layers"] = layers
                out["layer_types"] = ["sliding_attention"] * layers
            else:
                out["use_sliding_window"] = False
                out["sliding_window"] = None
        return out


MIXTRAL = OutputArchitecture(
    name="Mixtral",
    aliases=("mixtral", "mixtralforcausallm"),
    model_type="mixtral",
    class_name="MixtralForCausalLM",
    input_types=("llama", "mistral"),
    expert_count_key="num_local_experts",
    expert_names=(
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    ),
    router="block_sparse_moe.gate.weight",
)
_QWEN_EXPERTS = (
    "mlp.experts.{e}.gate_proj.weight",
    "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight",
)
"""Qwen2-MoE's and Qwen3-MoE's names of expert e's MLP weights."""
QWEN2_MOE = OutputArchitecture(
    name="Qwen2-MoE",
    aliases=("qwenmoe", "qwen2moe", "qwen2moeforcausallm"),
    model_type="qwen2_moe",
    class_name="Qwen2MoeForCausalLM",
    input_types=("llama", "mistral", "qwen2"),
    expert_count_key="num_experts",
    expert_names=_QWEN_EXPERTS,
    router="mlp.gate.weight",
    shared_prefix="mlp.shared_expert.",
    shared_gate="mlp.shared_expert_gate.weight",
    attention_biases=("q_proj", "k_proj", "v_proj"),
    zero_qkv_bias=True,
)
QWEN3_MOE = OutputArchitecture(
    name="Qwen3-MoE",
    aliases=("qwen3moe", "qwen3moeforcausallm"),
    model_type="qwen3_moe",
    class_name="Qwen3MoeForCausalLM",
    input_types=("qwen3",),
    expert_count_key="num_experts",
    expert_names=_QWEN_EXPERTS,
    router="mlp.gate.weight",
    attention_biases=None,
)
_DEEPSEEK_EXPERTS = _QWEN_EXPERTS
"""DeepSeek's on-disk per-expert names are Qwen-MoE's (transformers converts both the same way)."""
_MLA_NOTE = (
    "DeepSeek takes only DeepSeek models dense in every layer: its MLA attention cannot hold another family's"
)
DEEPSEEK_V2 = OutputArchitecture(
    name="DeepSeek-V2",
    aliases=("deepseekv2", "deepseekv2forcausallm", "deepseekmoe"),
    model_type="deepseek_v2",
    class_name="DeepseekV2ForCausalLM",
    input_types=("deepseek_v2",),
    expert_count_key="n_routed_experts",
    expert_names=_DEEPSEEK_EXPERTS,
    router="mlp.gate.weight",
    shared_prefix="mlp.shared_experts.",
    attention_biases=None,
    shared_optional=True,
    input_note=_MLA_NOTE,
)
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V2,
    name="DeepSeek-V3",
    aliases=("deepseekv3", "deepseekv3forcausallm", "deepseekmoe"),
    model_type="deepseek_v3",
    class_name="DeepseekV3ForCausalLM",
    input_types=("deepseek_v3",),
    router_bias="mlp.gate.e_score_correction_bias",
    min_experts=2,  # its router adds up each group's two best scores
)
"""DeepSeek-V2's layout, with V3's router bias (its scores' correction) and group routing."""
_DEEPSEEK_TYPES = (DEEPSEEK_V2.model_type, DEEPSEEK_V3.model_type)
ARCHITECTURES: tuple[OutputArchitecture, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3)
"""In mergekit's order of preference: Mixtral first when it fits (older configs expect it). The
DeepSeek families take only DeepSeek inputs, so their place decides nothing."""


def _deepseek_config(out: dict[str, Any], expert_intermediate: int, shared_intermediate: int | None) -> dict[str, Any]:
    """A DeepSeek config made MoE in every layer, routing as the module docstring says."""
    out["n_shared_experts"] = 0 if shared_intermediate is None else shared_intermediate // expert_intermediate
    out["first_k_dense_replace"] = 0
    out["moe_layer_freq"] = 1
    out["routed_scaling_factor"] = 1.0
    out.pop("mlp_layer_types", None)  # derived from first_k_dense_replace where a version has it
    if out["model_type"] == "deepseek_v3":
        out.update(n_group=1, topk_group=1, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        out.update(n_group=None, topk_group=None, norm_topk_prob=False, scoring_func="softmax", topk_method="greedy")
    return out


def select_architecture(config: MoEConfiguration, model_type: str, source: str = "config") -> OutputArchitecture:
    """The output family: the one `architecture:` names, else the first that holds these models."""
    candidates = list(ARCHITECTURES)
    if config.architecture:
        candidates = [a for a in ARCHITECTURES if a.matches(config.architecture)]
        if not candidates:
            known = ", ".join(a.name for a in ARCHITECTURES)
            raise ConfigError(
                f"{source}: `architecture`: unsupported target architecture {config.architecture!r} "
                f"(supported: {known})"
            )
    key = "`architecture`" if config.architecture else "`base_model`"
    fitting = [a for a in candidates if model_type in a.input_types]
    if not fitting:  # the type first: no edit of the config helps a family that cannot be built from these models
        reasons = [f"{a.name} is built from {'/'.join(a.input_types)} models, not {model_type!r}" for a in candidates]
        notes = "".join(f" ({note})" for note in dict.fromkeys(a.input_note for a in candidates if a.input_note))
        raise ConfigError(
            f"{source}: {key}: unsupported target architecture for these models: {'; '.join(reasons)}{notes}"
        )
    reasons = []
    for arch in fitting:
        why = arch.why_not(config)
        if why is None:
            return arch
        reasons.append(why)
    raise ConfigError(f"{source}: {key}: unsupported target architecture for these models: {'; '.join(reasons)}")
