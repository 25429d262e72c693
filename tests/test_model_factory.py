"""The tiny-checkpoint factory produces what end-to-end tests assume: loadable, finite, deterministic, per layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import finite_logits, load_causal_lm, read_state_dict, weight_files
from tests.model_factory import ARCHS, FORMATS, ModelCache, make_model, tokenizer_vocab

ALL_ARCHS = sorted(ARCHS)


def _weight_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in weight_files(path)}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_builds_loads_and_runs(tiny_models: ModelCache, arch: str, fmt: str) -> None:
    path = tiny_models(arch, seed=0, fmt=fmt)
    model = load_causal_lm(path)
    finite_logits(model)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    assert (path / "generation_config.json").exists()
    # The loaded weights are the saved ones (no silent re-init), in the saved layout.
    saved = read_state_dict(path)
    loaded = model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    tied = ARCHS[arch].tied
    assert ("lm_head.weight" in saved) is not tied
    assert config.get("tie_word_embeddings", False) is tied
    total = sum(f.stat().st_size for f in weight_files(path))
    assert total < 1_000_000, f"{arch}/{fmt} weighs {total} bytes"


def test_format_layouts(tiny_models: ModelCache) -> None:
    single = tiny_models("llama", seed=0, fmt="safetensors")
    assert [f.name for f in weight_files(single)] == ["model.safetensors"]
    assert not list(single.glob("*.index.json"))

    binary = tiny_models("llama", seed=0, fmt="bin")
    assert [f.name for f in binary.iterdir() if f.suffix in (".bin", ".safetensors")] == ["pytorch_model.bin"]

    sharded = tiny_models("llama", seed=0, fmt="sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {f.name for f in sharded.glob("*.safetensors")}

    sharded_bin = tiny_models("llama", seed=0, fmt="sharded_bin")
    index = json.loads((sharded_bin / "pytorch_model.bin.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(sharded_bin.glob("*.safetensors"))

    # Every layout holds the same tensors.
    reference = read_state_dict(single)
    for other in (binary, sharded, sharded_bin):
        got = read_state_dict(other)
        assert got.keys() == reference.keys()
        for name in reference:
            assert torch.equal(got[name], reference[name]), name


def test_same_seed_is_byte_identical(tmp_path: Path, tiny_models: ModelCache) -> None:
    first = make_model("qwen2", tmp_path / "a", seed=7)
    second = make_model("qwen2", tmp_path / "b", seed=7)
    assert _weight_bytes(first) == _weight_bytes(second)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    other = tiny_models("qwen2", seed=8)
    assert _weight_bytes(other) != _weight_bytes(first)


def test_building_does_not_disturb_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model("llama", tmp_path / "m", seed=1, tokenizer=False)
    assert torch.equal(torch.rand(3), expected)


def test_no_tensor_left_constant(tiny_models: ModelCache) -> None:
    # Norm weights and biases are jittered so merge methods see per-model differences everywhere.
    for seed in (0, 1):
        state = read_state_dict(tiny_models("qwen2", seed=seed))
        constant = [name for name, t in state.items() if t.numel() > 1 and bool((t == t.flatten()[0]).all())]
        assert not constant
    a, b = read_state_dict(tiny_models("qwen2", seed=0)), read_state_dict(tiny_models("qwen2", seed=1))
    assert not torch.equal(a["model.norm.weight"], b["model.norm.weight"])


def test_arch_specific_tensors(tiny_models: ModelCache) -> None:
    phi3 = read_state_dict(tiny_models("phi3", seed=0))
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"].shape == (32 + 2 * 16, 32)
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 64, 32)
    assert "model.layers.0.self_attn.q_proj.weight" not in phi3

    qwen2 = read_state_dict(tiny_models("qwen2", seed=0))
    assert {"q", "k", "v"} == {n.split(".")[-2][0] for n in qwen2 if n.endswith("_proj.bias")}

    gemma2 = read_state_dict(tiny_models("gemma2", seed=0))
    assert "model.layers.0.pre_feedforward_layernorm.weight" in gemma2
    gemma3 = read_state_dict(tiny_models("gemma3", seed=0))
    assert "model.layers.0.self_attn.q_norm.weight" in gemma3


@pytest.mark.parametrize(
    ("arch", "layers", "expected"),
    [
        ("gemma2", 4, ["sliding_attention", "full_attention"] * 2),
        ("gemma2", 3, ["sliding_attention", "full_attention", "sliding_attention"]),
        ("gemma3", 4, ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
        ("qwen2", 2, ["full_attention"] * 2),
    ],
)
def test_layer_types_follow_layer_count(tiny_models: ModelCache, arch: str, layers: int, expected: list[str]) -> None:
    path = tiny_models(arch, seed=0, layers=layers, tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == layers
    assert config["layer_types"] == expected
    finite_logits(load_causal_lm(path))


def test_overrides_and_dtype(tiny_models: ModelCache) -> None:
    path = tiny_models("gemma2", seed=0, dtype=torch.bfloat16, hidden_size=64, vocab_size=320)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["head_dim"], config["vocab_size"], config["dtype"]) == (
        64,
        16,
        320,
        "bfloat16",
    )
    model = load_causal_lm(path)
    assert model.dtype == torch.bfloat16
    finite_logits(model)
    # A bf16 build is the rounding of the fp32 build with the same seed.
    fp32 = read_state_dict(tiny_models("gemma2", seed=0, hidden_size=64, vocab_size=320))
    bf16 = read_state_dict(path)
    assert all(torch.equal(bf16[n], fp32[n].to(torch.bfloat16)) for n in fp32)


def test_tokenizer(tiny_models: ModelCache) -> None:
    from transformers import AutoTokenizer

    path = tiny_models("llama", seed=0, added_tokens=("<|im_start|>", "<|im_end|>"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == 256 == json.loads((path / "config.json").read_text())["vocab_size"]
    assert tokenizer("tok5 tok6 nonsense").input_ids == [5, 6, 3]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 255
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer_vocab(256)[:6] == ["<pad>", "<s>", "</s>", "<unk>", "tok4", "tok5"]
    assert not (tiny_models("llama", seed=0, tokenizer=False) / "tokenizer.json").exists()


def test_derived_models_share_a_base(tiny_models: ModelCache) -> None:
    base = tiny_models("mistral", seed=0)
    tuned = tiny_models.derive(base, seed=1, scale=0.01, fmt="sharded")
    assert tiny_models.derive(base, seed=1, scale=0.01, fmt="sharded") == tuned  # cached
    finite_logits(load_causal_lm(tuned))
    base_sd, tuned_sd = read_state_dict(base), read_state_dict(tuned)
    assert base_sd.keys() == tuned_sd.keys()
    for name in base_sd:
        delta = (tuned_sd[name] - base_sd[name]).abs()
        assert 0 < delta.max() < 0.1, name
    assert (tuned / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_cache_reuses_builds(tiny_models: ModelCache) -> None:
    assert tiny_models("phi3", seed=3) == tiny_models("phi3", seed=3)
    assert tiny_models("phi3", seed=3) != tiny_models("phi3", seed=3, layers=2)
