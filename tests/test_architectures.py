"""Every architecture people merge, merged four ways and loaded back in transformers.

For each architecture the tiny-model factory builds a random-init base (3 layers, hidden size 32) and two
"fine-tunes" of it, all offline from the real transformers config class. Each is merged with a 3-model
`linear`, a `ties`, a `slerp` and a passthrough frankenmerge that changes the depth (3 -> 5 layers: all of one
fine-tune, then layers 1-2 of the other). Every output must load in transformers with no missing or unexpected
keys and give finite logits; its config.json must have every per-layer list rewritten for the new depth; and
one layer tensor is recomputed here from the method's definition (written out below, independently of
mergesmith's code).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mergesmith.engine.planning.architecture import PER_LAYER_KEYS
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from tests.helpers import DEFAULT_TOKEN_IDS, read_state_dict

ARCHITECTURES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi",
    "phi3",
    "gpt2",
    "granite",
    "olmo2",
    "cohere",
    "starcoder2",
    "mixtral",
    "qwen2_moe",
    "deepseek_v3",
    "mamba",
    "llava",
    "qwen2_vl",
]
LAYERS = 3
METHODS = ["linear", "ties", "slerp", "passthrough"]
PASSTHROUGH_SOURCES = [("a", 0), ("a", 1), ("a", 2), ("b", 1), ("b", 2)]
"""Output layer -> (model, source layer) of the frankenmerge: all of a, then layers 1-2 of b."""
NOT_PER_LAYER = frozenset({"architectures", "eos_token_id", "bos_token_id", "pad_token_id", "mlp_only_layers"})
"""Lists a config may hold that are not one entry per layer even when their length equals the layer count
(mlp_only_layers holds layer *indices*: checked separately)."""


@pytest.fixture(scope="module")
def family(tiny_models):
    """(base, fine-tune a, fine-tune b) of an architecture, built once per architecture."""
    built: dict[str, tuple[Path, Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path, Path]:
        if arch not in built:
            base = tiny_models(arch, seed=11, layers=LAYERS)
            built[arch] = (base, tiny_models.derive(base, seed=12), tiny_models.derive(base, seed=13))
        return built[arch]

    return get


def load_model(path: Path) -> Any:
    """AutoModelForCausalLM, or the model's own class for vision-language models; fails on any key problem."""
    import transformers

    archs = json.loads((path / "config.json").read_text())["architectures"]
    cls = (
        getattr(transformers, archs[0]) if "ForConditionalGeneration" in archs[0] else transformers.AutoModelForCausalLM
    )
    model, info = cls.from_pretrained(str(path), output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    assert not problems and not info.get("error_msgs"), f"loading {path}: {problems} {info.get('error_msgs')}"
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(DEFAULT_TOKEN_IDS)])).logits
    assert torch.isfinite(logits).all(), f"{path}: non-finite logits"
    return model


def merge(tmp_path: Path, config: dict[str, Any]) -> Path:
    cfg = tmp_path / "merge.yml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "out"
    run_merge(cfg, out, MergeOptions())
    return out


_TEXT_LAYER = re.compile(r"^(?P<prefix>(?!.*(?:vision|visual)).*?(?:layers|\.h))\.(?P<index>\d+)\.(?P<rest>.+)$")


def text_layers(state: dict[str, torch.Tensor]) -> dict[int, dict[str, str]]:
    """Text-stack tensor names by layer: {layer: {rest of the name: full name}} (vision towers left out)."""
    out: dict[int, dict[str, str]] = {}
    for name in state:
        m = _TEXT_LAYER.match(name)
        if m:
            out.setdefault(int(m.group("index")), {})[m.group("rest")] = name
    return out


def layer_tensor(state: dict[str, torch.Tensor], layer: int) -> str:
    """The largest 2-D weight of text layer `layer` (ties broken by name, so it is deterministic)."""
    names = [n for n in text_layers(state)[layer].values() if state[n].dim() == 2 and n.endswith("weight")]
    assert names, f"no layer-{layer} weight among {sorted(state)[:8]}"
    return max(names, key=lambda n: (state[n].numel(), n))


# ----- the methods' definitions, written out here --------------------------------------------------------------
def linear_reference(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    return sum(w * t.double() for w, t in zip(weights, tensors)) / sum(weights)


def ties_reference(base: torch.Tensor, tensors: list[torch.Tensor], weights: list[float], density: float):
    """TIES-merging (Yadav et al. 2023): trim each task vector to its top-k magnitudes, elect the sign by the
    weighted sum, average the agreeing entries (normalised by their weights), add to the base."""
    deltas = []
    for t, w in zip(tensors, weights):
        tau = t.double() - base.double()
        k = int(density * tau.numel())
        keep = torch.zeros(tau.numel(), dtype=torch.bool)
        keep[tau.abs().flatten().topk(k).indices] = True
        deltas.append(tau * keep.view_as(tau) * w)
    stacked = torch.stack(deltas)
    sign = torch.sign(stacked.sum(0))
    agree = torch.sign(stacked) == sign
    weight_sum = (torch.tensor(weights, dtype=torch.float64).view(-1, *[1] * base.dim()) * agree).sum(0)
    weight_sum[weight_sum.abs() < 1e-8] = 1
    return base.double() + (stacked * agree).sum(0) / weight_sum


def slerp_reference(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """Spherical interpolation of the two tensors as flat vectors (lerp when nearly parallel)."""
    a, b = v0.double(), v1.double()
    dot = float((a / a.norm() * b / b.norm()).sum().clamp(-1, 1))
    if abs(dot) > 0.9995:
        return (1 - t) * a + t * b
    theta = math.acos(dot)
    return (math.sin((1 - t) * theta) * a + math.sin(t * theta) * b) / math.sin(theta)


# ----- the tests --------------------------------------------------------------------------------------------------
def config_for(method: str, base: Path, a: Path, b: Path) -> dict[str, Any]:
    if method == "linear":
        weights = [0.5, 0.3, 0.2]
        return {
            "merge_method": "linear",
            "models": [{"model": str(p), "parameters": {"weight": w}} for p, w in zip((base, a, b), weights)],
        }
    if method == "ties":
        return {
            "merge_method": "ties",
            "base_model": str(base),
            "models": [
                {"model": str(a), "parameters": {"weight": 0.6, "density": 0.5}},
                {"model": str(b), "parameters": {"weight": 0.4, "density": 0.5}},
            ],
        }
    if method == "slerp":
        return {
            "merge_method": "slerp",
            "base_model": str(a),
            "models": [{"model": str(a)}, {"model": str(b)}],
            "parameters": {"t": 0.3},
        }
    return {
        "merge_method": "passthrough",
        "slices": [
            {"sources": [{"model": str(a), "layer_range": [0, 3]}]},
            {"sources": [{"model": str(b), "layer_range": [1, 3]}]},
        ],
    }


def text_scope(config: dict[str, Any]) -> dict[str, Any]:
    return config["text_config"] if "text_config" in config and "num_hidden_layers" not in config else config


def depth_key(scope: dict[str, Any]) -> str:
    return "n_layer" if "n_layer" in scope else "num_hidden_layers"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture_merges_load_and_follow_the_math(tmp_path, family, arch, method):
    base, a, b = family(arch)
    out = merge(tmp_path, config_for(method, base, a, b))
    load_model(out)
    merged = read_state_dict(out)
    sd = {p: read_state_dict(p) for p in (base, a, b)}
    before = json.loads((base / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    old, new = text_scope(before), text_scope(after)

    if method != "passthrough":
        assert set(merged) == set(sd[base]), "a merge of whole models keeps the base's tensors"
        assert new[depth_key(new)] == LAYERS
        name = layer_tensor(merged, 1)
        if method == "linear":
            expected = linear_reference([sd[p][name] for p in (base, a, b)], [0.5, 0.3, 0.2])
        elif method == "ties":
            expected = ties_reference(sd[base][name], [sd[a][name], sd[b][name]], [0.6, 0.4], 0.5)
        else:
            expected = slerp_reference(0.3, sd[a][name], sd[b][name])
        torch.testing.assert_close(merged[name].double(), expected, rtol=1e-5, atol=1e-6)
        return

    # passthrough: the depth changes, every per-layer list follows, each output layer is its source layer.
    count = len(PASSTHROUGH_SOURCES)
    assert new[depth_key(new)] == count
    for holder_before, holder_after in ((before, after), (old, new)):
        for key, value in holder_before.items():
            if isinstance(value, list) and len(value) == LAYERS and key not in NOT_PER_LAYER:
                assert key in PER_LAYER_KEYS, f"{key} looks per-layer but mergesmith does not rewrite it"
                assert holder_after[key] == [value[i] for _, i in PASSTHROUGH_SOURCES], key
    if "mlp_only_layers" in old:
        sources = [i for _, i in PASSTHROUGH_SOURCES]
        assert new["mlp_only_layers"] == [o for o, s in enumerate(sources) if s in old["mlp_only_layers"]]
    models = {"a": sd[a], "b": sd[b]}
    out_layers = text_layers(merged)
    assert sorted(out_layers) == list(range(count))
    for out_layer, (model, src_layer) in enumerate(PASSTHROUGH_SOURCES):
        src_names = text_layers(models[model])[src_layer]
        assert set(out_layers[out_layer]) == set(src_names), f"layer {out_layer}"
        for rest, name in out_layers[out_layer].items():
            assert torch.equal(merged[name], models[model][src_names[rest]]), name
    in_stack = {n for names in out_layers.values() for n in names.values()}
    non_layer = [n for n in merged if n not in in_stack]
    assert non_layer
    for name in non_layer:  # copied whole: embeddings from the first slice, head and vision tower from the last
        assert any(torch.equal(merged[name], m[name]) for m in (sd[a], sd[b])), name
    if arch in ("llava", "qwen2_vl"):
        assert any("vision" in n or "visual" in n for n in non_layer), "the vision tower is carried through"


def test_moe_dense_layer_list_follows_the_layers(tmp_path, family):
    base, a, b = family("qwen2_moe")
    out = merge(
        tmp_path,
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [1, 3]}]},
                {"sources": [{"model": str(b), "layer_range": [0, 3]}]},
            ],
        },
    )
    assert json.loads((out / "config.json").read_text())["mlp_only_layers"] == [2]
    load_model(out)


def test_deepseek_dense_layer_after_moe_layers_is_refused_at_plan_time(tmp_path, family, capsys):
    from tests.helpers import assert_one_line_error, run_cli, write_config

    base, a, b = family("deepseek_v3")
    cfg = write_config(
        tmp_path / "f.yml",
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [1, 3]}]},
                {"sources": [{"model": str(b), "layer_range": [0, 3]}]},
            ],
        },
    )
    code, _out, err = run_cli(capsys, "plan", cfg)
    assert_one_line_error(code, err, "first_k_dense_replace", "output layer 2")
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert_one_line_error(code, err, "first_k_dense_replace")
    assert not (tmp_path / "out" / "config.json").exists()


def test_index_decided_layer_kinds_are_rewritten_for_slices():
    from mergesmith.engine.planning.architecture import LayerMapError, rewrite_config

    # qwen2_moe: every 2nd layer sparse by index; slices make that pattern wrong, so the dense ones are listed
    qwen = {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    out = rewrite_config(qwen, [1, 2, 3, 0], "F32")
    assert out["decoder_sparse_step"] == 1
    assert out["mlp_only_layers"] == [1, 2, 3]  # sources 2 and 0 dense by the step, 3 listed
    # llama4: moe_layers lists the sparse layer indices
    assert rewrite_config({"num_hidden_layers": 4, "moe_layers": [1, 3]}, [0, 1, 1, 3], "F32")["moe_layers"] == [
        1,
        2,
        3,
    ]
    # deepseek: dense layers first is representable, with the new count
    deep = {"num_hidden_layers": 4, "first_k_dense_replace": 2}
    assert rewrite_config(deep, [0, 1, 1, 2, 3], "F32")["first_k_dense_replace"] == 3
    with pytest.raises(LayerMapError, match="output layer 2 comes from dense layer 0"):
        rewrite_config(deep, [0, 2, 0, 3], "F32")
    with pytest.raises(LayerMapError, match="moe_layer_freq"):
        rewrite_config({**deep, "moe_layer_freq": 2}, [0, 1, 3], "F32")
    assert rewrite_config({**deep, "moe_layer_freq": 2}, None, "F32")["first_k_dense_replace"] == 2


def test_per_layer_strings_and_depth_lists_are_rewritten_for_slices():
    from mergesmith.engine.planning.architecture import layer_count_key, rewrite_config

    # nemotron_h before transformers 5: one character per layer, beside num_hidden_layers
    old = {"num_hidden_layers": 3, "hybrid_override_pattern": "M*E"}
    out = rewrite_config(old, [0, 1, 2, 1, 2], "F32")
    assert (out["num_hidden_layers"], out["hybrid_override_pattern"]) == (5, "M*E*E")
    # nemotron_h in transformers 5: no layer count, the list's length is the depth (no count key is added)
    new = {"layers_block_type": ["mamba", "attention", "moe"]}
    assert layer_count_key(new) == (("layers_block_type",), 3)
    out = rewrite_config(new, [0, 1, 2, 1, 2], "F32")
    assert out["layers_block_type"] == ["mamba", "attention", "moe", "attention", "moe"]
    assert "num_hidden_layers" not in out
    # mllama: the cross-attention layers are indices
    assert rewrite_config({"num_hidden_layers": 3, "cross_attention_layers": [1]}, [0, 1, 2, 1], "F32")[
        "cross_attention_layers"
    ] == [1, 3]


def test_layer_kinds_decided_by_a_period_refuse_slices_that_break_them():
    from mergesmith.engine.planning.architecture import LayerMapError, rewrite_config

    jamba = {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1}
    assert rewrite_config(jamba, [0, 1, 2, 1, 2], "F32")["num_hidden_layers"] == 5  # kinds line up
    with pytest.raises(LayerMapError, match="attn_layer_period"):
        rewrite_config(jamba, [0, 1, 1], "F32")  # output layer 2 would be mamba, its source is attention
    gemma = {"num_hidden_layers": 3, "block_types": ["recurrent", "recurrent", "attention"]}
    with pytest.raises(LayerMapError, match="block_types"):
        rewrite_config(gemma, [0, 1, 2, 1, 2], "F32")
    assert rewrite_config(gemma, [0, 1, 2, 0, 1, 2], "F32")["num_hidden_layers"] == 6


def test_a_second_count_of_the_layers_follows_the_first():
    from mergesmith.engine.planning.architecture import rewrite_config

    out = rewrite_config({"num_hidden_layers": 3, "num_blocks": 3}, [0, 1, 2, 1, 2], "F32")  # xlstm
    assert (out["num_hidden_layers"], out["num_blocks"]) == (5, 5)
    assert rewrite_config({"num_hidden_layers": 3, "num_blocks": 7}, [0, 1], "F32")["num_blocks"] == 7
