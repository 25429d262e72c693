"""The architecture census: every model type in transformers' causal-LM and image-text-to-text auto mappings,
built tiny and random from its own config class, merged three ways through mergesmith, loaded back.

Why generic: the point is to know, the day transformers ships a type, whether mergesmith merges it with no
code. So nothing here is per type except the shrinking rules, which act on config *key names* (hidden_size,
num_experts, kv_lora_rank, ...) wherever they occur (top level, text_config, vision_config, ...), keeping every
structural option of the type's defaults (MoE layers, layer_types, sliding windows, MLA, hybrid patterns,
vision towers) and only making the numbers small.

`census_type(name, root)` returns one type's statuses: for `linear` (3 models), `ties` (2 fine-tunes over a
base) and `passthrough` (3 -> 5 layers: all of fine-tune a, then layers 1-2 of b) each of "pass",
"refused: <the error line>" (passthrough only: mergesmith refused the depth change at plan time) or
"fail: <reason>"; or the whole type "not buildable: <reason>" (encoder types, configs transformers cannot
build tiny). scripts/architecture_census.py runs every type and writes docs/architectures.md and
tests/fixtures/architecture_census.json; tests/test_architecture_census.py re-runs the passing ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tests.test_architectures import config_for, linear_reference, ties_reference  # the methods' math, written out once

LAYERS = 3
PASSTHROUGH_SOURCES = [("a", 0), ("a", 1), ("a", 2), ("b", 1), ("b", 2)]
TOKEN_IDS = [1, 5, 6, 7, 8, 2]
NOT_PER_LAYER = frozenset(
    {
        "architectures",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "mlp_only_layers",
        "moe_layers",
        "kv_source_layers",
    }
)
"""Lists that are not one entry per layer even when their length equals the layer count (index lists are
checked separately)."""

# ----- shrinking a config by its key names ----------------------------------------------------------------------
_SIZES: dict[str, int] = {
    # widths
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "n_embed": 32,
    "dim": 32,
    "embed_dim": 32,
    "hidden_dim": 32,
    "word_embed_proj_dim": 32,
    "embedding_dim": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "ffn_hidden_size": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_ffn_hidden_size": 32,
    "shared_intermediate_size": 32,
    "dense_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 32,
    "intermediate_size_mlp": 64,
    # attention
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 8,
    "kv_channels": 8,
    "global_head_dim": 8,
    "attention_head_dim": 8,
    # MLA
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    # experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "n_group": 1,
    "topk_group": 1,
    # state-space / linear attention
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "time_step_rank": 4,
    "mamba_dt_rank": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "num_hidden_layers_mamba": 1,
    "mamba_d_ssm": 64,
    "mamba_headdim": 8,
    "adapter_rank": 8,
    # vocabulary and lengths
    "vocab_size": 128,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "max_seq_len": 128,
    "sliding_window": 4,
    "rotary_dim": 4,
    "attention_chunk_size": 4,
    # vision towers
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "out_hidden_size": 32,
    "projection_dim": 32,
    "vision_output_dim": 32,
    "num_global_layers": 1,
    "num_kv_shared_layers": 0,
}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks")
_DEPTH_LISTS = ("layers_block_type", "layer_types", "hybrid_override_pattern", "block_types")
"""Where a config has no layer count, the list (or pattern string) whose length is the depth (nemotron_h)."""
_SUBCONFIG_LAYERS = 2
"""Layers of a vision/audio tower (not the census's text depth)."""


def _shrink(values: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config dict `values` with every known size key made tiny; per-layer lists and strings as long as the
    old depth are cut to the new depth (kept in kind, so a hybrid pattern stays hybrid)."""
    out = dict(values)
    old = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), None)
    if old is None:
        old = next((len(values[k]) for k in _DEPTH_LISTS if isinstance(values.get(k), (list, str))), None)
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if key in _LAYER_KEYS and isinstance(value, int):
            out[key] = layers
        elif key in _SIZES and isinstance(value, int) and value > 0:
            out[key] = min(value, _SIZES[key]) if key not in ("vocab_size",) else _SIZES[key]
        elif isinstance(value, dict) and key.endswith("_config"):
            out[key] = _shrink(value, layers if key == "text_config" else _SUBCONFIG_LAYERS)
        elif key.endswith("layer_period") and isinstance(value, int) and value > layers - 1:
            out[key] = 2  # jamba: attention / experts every other layer, so 3 layers still hold both kinds
        elif key.endswith("layer_offset") and isinstance(value, int) and value > 1:
            out[key] = 1
        elif (
            old
            and (isinstance(value, list) or (isinstance(value, str) and key.endswith("pattern")))
            and len(value) == old
            and old > 1
            and key not in NOT_PER_LAYER
        ):
            out[key] = _cut(value, layers)
        elif key.endswith("_token_id") or key.endswith("_token_index"):
            if isinstance(value, int) and value >= _SIZES["vocab_size"]:
                out[key] = _SIZES["vocab_size"] - 1 - (hash(key) % 16)
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("n_head", "num_kv_heads")):
        if values.get(kv) is not None and values.get(kv) == values.get(heads):
            out[kv] = out[heads]  # multi-head (MLA included): kv heads stay as many as the heads
    if out.get("num_experts_per_tok", 0) is None and any(k in out for k in ("n_routed_experts", "num_experts")):
        out["num_experts_per_tok"] = 2
    kinds = out.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers and set(kinds) == {"linear_attention"}:
        out["layer_types"] = ["linear_attention", "full_attention", "linear_attention"][:layers]  # keep it hybrid
    if isinstance(values.get("attention_hidden_size"), int) and isinstance(values.get("hidden_size"), int):
        # as many times the hidden size as the type had (zamba2: twice, its shared attention block works on
        # two hidden states concatenated; rwkv: once)
        ratio = max(1, values["attention_hidden_size"] // values["hidden_size"])
        out["attention_hidden_size"] = ratio * out["hidden_size"]
        if "attention_head_dim" in out:
            out["attention_head_dim"] = out["attention_hidden_size"] // out["num_attention_heads"]
    if "attn_layer_indices" in out and not out["attn_layer_indices"]:
        out["attn_layer_indices"] = [1]  # bamba: hybrid, with one attention layer among the mamba ones
    if "qk_rope_head_dim" in out and "head_dim" in out:
        # MLA: head_dim is the rotary part (deepseek) or the whole query head (dots3): keep the type's relation
        whole = (values.get("qk_nope_head_dim") or 0) + values["qk_rope_head_dim"]
        if values.get("head_dim") == whole:
            out["head_dim"] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)
        else:
            out["head_dim"] = out["qk_rope_head_dim"]
    if isinstance(out.get("first_k_dense_replace"), int) and out["first_k_dense_replace"] > 0:
        out["first_k_dense_replace"] = 1
    if isinstance(out.get("kv_source_layers"), list) and out["kv_source_layers"] == list(range(old or 0)):
        out["kv_source_layers"] = list(range(layers))  # mistral_large4: each layer its own keys and values
    rope = out.get("rope_parameters") or out.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        rope = dict(rope, mrope_section=[2, 1, 1])  # sums to head_dim 8 / 2
        out["rope_parameters" if "rope_parameters" in out else "rope_scaling"] = rope
    if isinstance(out.get("per_layer_config"), dict) and out["per_layer_config"]:
        # gemma4: overrides for its full-attention layers, keyed by index: keep them on the full layers left
        first = next(iter(out["per_layer_config"].values()))
        kinds = out.get("layer_types") or []
        out["per_layer_config"] = {f"{i:02d}": first for i, t in enumerate(kinds) if t == "full_attention"}
    for key in ("mlp_only_layers", "moe_layers"):
        if isinstance(out.get(key), list):
            out[key] = [i for i in out[key] if isinstance(i, int) and i < layers]
    return out


def _cut(value: list[Any] | str, layers: int) -> list[Any] | str:
    """A per-layer list/string cut to `layers`, keeping every kind it had where it can (the last kinds first)."""
    kinds = list(dict.fromkeys(value))
    head = list(value[:layers])
    for kind in kinds:
        if kind not in head and len(kinds) <= layers:
            # replace the last entry of the most repeated kind with a missing one
            most = max(set(head), key=head.count)
            head[len(head) - 1 - head[::-1].index(most)] = kind
    return "".join(head) if isinstance(value, str) else head


def tiny_config(model_type: str, kind: str = "causal-lm") -> Any:
    """The type's config, from its model class's own config class (llama4's causal LM takes Llama4TextConfig,
    not the multimodal Llama4Config), with every size tiny and LAYERS text layers."""
    config_class = model_class(model_type, kind).config_class
    defaults = config_class().to_dict()
    values = _shrink(defaults, LAYERS)
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype", "hybrid_layer_ids"):
        values.pop(key, None)  # hybrid_layer_ids (zamba2) is derived from the layer kinds: recomputed
    return config_class(**values)


# ----- building the models --------------------------------------------------------------------------------------
def model_class(model_type: str, kind: str) -> Any:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    names = (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if kind == "causal-lm"
        else auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )
    return getattr(transformers, names[model_type])


def census_types() -> list[tuple[str, str]]:
    """(model type, "causal-lm" | "image-text-to-text") for every type of the two auto mappings, sorted."""
    from transformers.models.auto import modeling_auto as auto

    out = [(t, "causal-lm") for t in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    out += [(t, "image-text-to-text") for t in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES]
    return sorted(out)


def _jitter(model: Any, seed: int) -> None:
    """Noise on tensors init leaves constant, so TIES's sign election is not tested on ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def build(model_type: str, kind: str, root: Path) -> tuple[Path, Path, Path]:
    """A tiny random base and two seeded "fine-tunes" of it (base + N(0, 0.01) on every parameter)."""
    config = tiny_config(model_type, kind)
    cls = model_class(model_type, kind)
    paths = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = cls._from_config(config, dtype=torch.float32)
        _jitter(model, 12)
        model.eval()
        base_state = {k: v.clone() for k, v in model.state_dict().items()}
        for seed, name in ((0, "base"), (13, "a"), (14, "b")):
            if seed:
                g = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    model.load_state_dict(base_state)
                    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                        if p.is_floating_point():
                            p.add_(torch.randn(p.shape, generator=g) * 0.01)
            path = root / name
            model.save_pretrained(str(path))
            paths.append(path)
    return paths[0], paths[1], paths[2]


def load(path: Path, model_type: str, kind: str) -> Any:
    """The output loaded with the type's own class: no missing/unexpected/mismatched keys, finite logits."""
    cls = model_class(model_type, kind)
    model, info = cls.from_pretrained(str(path), output_loading_info=True)
    problems = {k: sorted(v)[:4] for k, v in info.items() if v}
    assert not problems, f"loading reported {problems}"
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKEN_IDS])).logits
    assert torch.isfinite(logits).all(), "non-finite logits"
    return model


# ----- reading outputs back -------------------------------------------------------------------------------------
def read_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


_TEXT_LAYER = re.compile(
    r"^(?P<prefix>(?!.*(?:vision|visual|image|audio)).*?(?:layers?|\.h|blocks?))\.(?P<index>\d+)\.(?P<rest>.+)$"
)


def checked_tensor(state: dict[str, torch.Tensor]) -> str:
    """The largest floating tensor of text layer 1 (an expert stack in a fused-MoE model), deterministic."""
    names = [
        n
        for n in state
        if (m := _TEXT_LAYER.match(n))
        and m.group("index") == "1"
        and state[n].is_floating_point()
        and state[n].dim() >= 2
    ]
    assert names, "no text layer-1 tensor"
    return max(names, key=lambda n: (state[n].numel(), n))


_MOE_WORDS = ("expert", "router", "gate.weight", "gate.bias", "e_score_correction")


def moe_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """Text layer 1's mixture-of-experts tensors: experts (one per expert, or fused in one tensor as gpt_oss and
    qwen3_5_moe store them), shared experts, the router and its bias. Each must follow the method's math like
    any other tensor: merging fine-tunes of one MoE model is expert by expert."""
    return sorted(
        n
        for n in state
        if (m := _TEXT_LAYER.match(n))
        and m.group("index") == "1"
        and state[n].is_floating_point()
        and any(w in m.group("rest") for w in _MOE_WORDS)
    )


# ----- the three merges -----------------------------------------------------------------------------------------
def merge_config(method: str, base: Path, a: Path, b: Path) -> dict[str, Any]:
    """test_architectures' config for `method` (linear, ties, or the 3 -> 5 layer passthrough), computed in
    float32 so the written-out math compares at float32 precision."""
    return {**config_for(method, base, a, b), "dtype": "float32"}


def _layer_count(config: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The config scope holding the text layer count, and the count."""
    scopes = (config, config.get("text_config") or {})
    for scope in scopes:
        for key in _LAYER_KEYS:
            if isinstance(scope.get(key), int) and not isinstance(scope.get(key), bool):
                return scope, scope[key]
    for scope in scopes:
        for key in _DEPTH_LISTS:
            if isinstance(scope.get(key), (list, str)):
                return scope, len(scope[key])
    raise AssertionError("no layer count in config.json")


def check_method(method: str, model_type: str, kind: str, models: tuple[Path, Path, Path], out: Path) -> str:
    """Run one merge and check it; "pass", "refused: ..." (passthrough refused at plan time) or "fail: ..."."""
    import mergesmith
    from mergesmith.errors import ConfigError, MergesmithError

    base, a, b = models
    try:
        mergesmith.merge(merge_config(method, base, a, b), out)
    except MergesmithError as exc:
        if isinstance(exc, ConfigError) and method == "passthrough" and not (out / "config.json").exists():
            return f"refused: {str(exc).splitlines()[0]}"
        return f"fail: {type(exc).__name__}: {_short(exc)}"
    try:
        load(out, model_type, kind)
        merged = read_state(out)
        before = json.loads((base / "config.json").read_text())
        after = json.loads((out / "config.json").read_text())
        if method != "passthrough":
            state = {p: read_state(p) for p in (base, a, b)}
            assert set(merged) == set(state[base]), "the merge changed the tensor names"
            for name in [checked_tensor(merged), *moe_tensors(merged)]:
                if method == "linear":
                    want = linear_reference([state[p][name] for p in (base, a, b)], [0.5, 0.3, 0.2])
                else:
                    want = ties_reference(state[base][name], [state[a][name], state[b][name]], [0.6, 0.4], 0.5)
                torch.testing.assert_close(
                    merged[name].double(), want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
                )
            return "pass"
        _check_depth(before, after)
        return "pass"
    except Exception as exc:  # a census records every failure; the test turns a recorded pass into a failure
        return f"fail: {type(exc).__name__}: {_short(exc)}"


def _check_depth(before: dict[str, Any], after: dict[str, Any]) -> None:
    """5 layers, and every per-layer list or string of the old depth re-indexed by the slices."""
    old_scope, old = _layer_count(before)
    new_scope, new = _layer_count(after)
    assert (old, new) == (LAYERS, len(PASSTHROUGH_SOURCES)), f"depth {old} -> {new}"
    from mergesmith.engine.planning.architecture import LAYER_INDEX_KEYS

    sources = [i for _, i in PASSTHROUGH_SOURCES]
    for hb, ha in ((before, after), (old_scope, new_scope)):
        for key, value in hb.items():
            if key in LAYER_INDEX_KEYS and isinstance(value, list):
                assert ha.get(key) == [o for o, s in enumerate(sources) if s in value], f"{key} not re-indexed"
                continue
            if key in NOT_PER_LAYER or not isinstance(value, (list, str)) or len(value) != LAYERS:
                continue
            if isinstance(value, str) and not key.endswith("pattern"):
                continue
            want = [value[i] for i in sources]
            got = ha.get(key)
            assert (list(got) if isinstance(got, str) else got) == want, f"{key} not rewritten: {got!r}"


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200]


def census_type(model_type: str, kind: str, root: Path) -> dict[str, str]:
    """One type's row: {"linear", "ties", "passthrough"} statuses, or {"status": "not buildable: ..."}."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    if getattr(config_cls, "is_encoder_decoder", False) or _is_encoder_decoder(model_type):
        return {"status": "not buildable: encoder-decoder type"}
    try:
        models = build(model_type, kind, root)
    except Exception as exc:
        return {"status": f"not buildable: {type(exc).__name__}: {_short(exc)}"}
    row = {}
    for method in ("linear", "ties", "passthrough"):
        outcome = check_method(method, model_type, kind, models, root / f"out-{method}")
        row[method] = outcome.replace(str(root), "<dir>")  # the same text on every run
    return row


def _is_encoder_decoder(model_type: str) -> bool:
    from transformers import AutoConfig

    try:
        return bool(AutoConfig.for_model(model_type).is_encoder_decoder)
    except Exception:
        return False


def passed(row: dict[str, str]) -> bool:
    """Linear and ties pass; passthrough passes or is refused at plan time."""
    return (
        row.get("linear") == "pass"
        and row.get("ties") == "pass"
        and (row.get("passthrough") == "pass" or row.get("passthrough", "").startswith("refused"))
    )
