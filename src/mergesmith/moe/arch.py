"""The MoE output architectures: how a dense model's tensors and config.json become an MoE model's.

Tensor names are the ones transformers itself writes with `save_pretrained` (checked against 5.23):
one tensor per expert and projection, `block_sparse_moe.experts.N.w1/w2/w3` for Mixtral and
`mlp.experts.N.gate_proj/up_proj/down_proj` for Qwen2-MoE and Qwen3-MoE. transformers 5 fuses the
experts into 3-D `mlp.experts.gate_up_proj`/`down_proj` parameters in memory but converts this on-disk
layout on load (and back on save), and it is the layout transformers 4.x, vLLM and llama.cpp's
converter read, so it is the one that loads everywhere.
"""

from __future__ import annotations

import copy
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

    @property
    def has_shared(self) -> bool:
        return self.shared_prefix is not None

    def matches(self, requested: str) -> bool:
        wanted = _norm(requested)
        return bool(wanted) and any(a.startswith(wanted) for a in self.aliases)

    def why_not(self, config: MoEConfiguration, model_type: str) -> str | None:
        """Why this family cannot hold the config's models (None when it can); the model type first,
        since no `shared_experts` edit helps a family that cannot be built from these models."""
        if model_type not in self.input_types:
            return f"{self.name} is built from {'/'.join(self.input_types)} models, not {model_type!r}"
        shared = config.shared_experts or []
        if self.has_shared and len(shared) != 1:
            return f"{self.name} needs exactly one entry in `shared_experts`"
        if not self.has_shared and shared:
            return f"{self.name} has no shared expert (remove `shared_experts`)"
        if self.has_shared and config.gate_mode not in RANDOM_MODES and not shared[0].positive_prompts:
            return (
                f"{self.name} gates its shared expert, so gate_mode {config.gate_mode} needs "
                "`shared_experts[0].positive_prompts`"
            )
        return None

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
ARCHITECTURES: tuple[OutputArchitecture, ...] = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
"""In mergekit's order of preference: Mixtral first when it fits (older configs expect it)."""
_UNSUPPORTED = {"deepseek": "DeepSeek MoE output needs the model's remote code, which transformers does not ship"}


def select_architecture(config: MoEConfiguration, model_type: str, source: str = "config") -> OutputArchitecture:
    """The output family: the one `architecture:` names, else the first that holds these models."""
    candidates = list(ARCHITECTURES)
    if config.architecture:
        for prefix, why in _UNSUPPORTED.items():
            if _norm(config.architecture).startswith(prefix):
                raise ConfigError(f"{source}: `architecture`: {config.architecture!r} is not supported: {why}")
        candidates = [a for a in ARCHITECTURES if a.matches(config.architecture)]
        if not candidates:
            known = ", ".join(a.name for a in ARCHITECTURES)
            raise ConfigError(
                f"{source}: `architecture`: unsupported target architecture {config.architecture!r} "
                f"(supported: {known})"
            )
    reasons = []
    for arch in candidates:
        why = arch.why_not(config, model_type)
        if why is None:
            return arch
        reasons.append(why)
    key = "`architecture`" if config.architecture else "`base_model`"
    raise ConfigError(f"{source}: {key}: unsupported target architecture for these models: {'; '.join(reasons)}")
