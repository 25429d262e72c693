"""End to end: real tiny checkpoints of several architectures, merged, loaded back in transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from mergesmith.errors import ConfigError
from tests.helpers import finite_logits, load_causal_lm, read_state_dict

ARCHS = ["llama", "mistral", "qwen2", "phi3", "gemma", "gemma2", "gemma3"]


def _merge(tmp_path: Path, config: dict, name: str = "out", **options) -> Path:
    cfg = tmp_path / f"{name}.yml"
    cfg.write_text(yaml.safe_dump(config))
    out = tmp_path / name
    run_merge(cfg, out, MergeOptions(**options))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_linear_of_three_models_loads_and_matches_the_math(tmp_path, tiny_models, arch):
    paths = [tiny_models(arch, seed=s) for s in (1, 2, 3)]
    weights = [1.0, 0.5, 0.25]
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [{"model": str(p), "parameters": {"weight": w}} for p, w in zip(paths, weights)],
        },
    )
    model = load_causal_lm(out)
    finite_logits(model)
    merged = read_state_dict(out)
    inputs = [read_state_dict(p) for p in paths]
    assert set(merged) == set(inputs[0])
    for name, tensor in merged.items():
        expected = sum(w * sd[name] for w, sd in zip(weights, inputs)) / sum(weights)
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-6)
    if arch in ("qwen2", "gemma", "gemma2", "gemma3"):
        assert "lm_head.weight" not in merged  # tied: the output ties too


@pytest.mark.parametrize("arch", ARCHS)
def test_passthrough_frankenmerge_with_a_layer_used_twice(tmp_path, tiny_models, arch):
    a, b = tiny_models(arch, seed=1), tiny_models(arch, seed=2)
    out = _merge(
        tmp_path,
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [0, 3]}]},
                {"sources": [{"model": str(b), "layer_range": [2, 4]}]},
                {"sources": [{"model": str(a), "layer_range": [2, 4]}]},  # layers 2-3 of a used twice
            ],
        },
    )
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 7
    source_layers = [(a, 0), (a, 1), (a, 2), (b, 2), (b, 3), (a, 2), (a, 3)]
    if "layer_types" in config:
        original = json.loads((a / "config.json").read_text())["layer_types"]
        assert config["layer_types"] == [original[i] for _, i in source_layers]
    model = load_causal_lm(out)
    finite_logits(model)
    merged = read_state_dict(out)
    sds = {a: read_state_dict(a), b: read_state_dict(b)}
    for out_layer, (src, src_layer) in enumerate(source_layers):
        prefix = f"model.layers.{out_layer}."
        names = [n for n in merged if n.startswith(prefix)]
        assert names
        for n in names:
            src_name = f"model.layers.{src_layer}." + n[len(prefix) :]
            assert torch.equal(merged[n], sds[src][src_name]), n  # bit for bit
    for n in merged:
        if not n.startswith("model.layers."):  # first and last slice are both from a here
            assert torch.equal(merged[n], sds[a][n])


def test_linear_of_a_model_with_itself_is_the_model(tmp_path, tiny_models):
    p = tiny_models("llama", seed=7, dtype=torch.bfloat16)
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [
                {"model": str(p), "parameters": {"weight": 0.3}},
                {"model": str(p), "parameters": {"weight": 0.7}},
            ],
        },
    )
    merged, original = read_state_dict(out), read_state_dict(p)
    assert set(merged) == set(original)
    for n in original:
        assert merged[n].dtype == torch.bfloat16
        assert torch.equal(merged[n], original[n]), n


@pytest.mark.parametrize("fmt", ["bin", "sharded", "sharded_bin"])
def test_bin_and_sharded_inputs(tmp_path, tiny_models, fmt):
    ref = tiny_models("llama", seed=1)
    other = tiny_models("llama", seed=2, fmt=fmt)
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [
                {"model": str(ref), "parameters": {"weight": 1.0}},
                {"model": str(other), "parameters": {"weight": 1.0}},
            ],
        },
    )
    merged, a, b = read_state_dict(out), read_state_dict(ref), read_state_dict(other)
    for n in merged:
        torch.testing.assert_close(merged[n], (a[n] + b[n]) / 2)
    load_causal_lm(out)


def test_output_layout_shards_index_tokenizer_card_and_dtype(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "out_dtype": "bfloat16",
            "models": [{"model": str(a), "parameters": {"weight": 1}}, {"model": str(b), "parameters": {"weight": 1}}],
        },
        out_shard_size=60_000,
    )
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_state_dict(out).values())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "mergekit_config.yml",
        "README.md",
    ):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "linear" in card and str(a) in card and "mergesmith" in card
    saved = yaml.safe_load((out / "mergekit_config.yml").read_text())
    assert saved["merge_method"] == "linear"
    model = load_causal_lm(out)
    assert model.dtype == torch.bfloat16
    # Each shard holds at most the limit of tensor bytes unless one tensor alone is larger.
    from safetensors import safe_open

    for s in shards:
        with safe_open(str(s), "pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
        assert sum(sizes) <= 60_000 or len(sizes) == 1


def test_no_copy_tokenizer_and_no_model_card(tmp_path, tiny_models):
    a = tiny_models("llama", seed=1)
    out = _merge(
        tmp_path,
        {"merge_method": "passthrough", "models": [{"model": str(a)}]},
        copy_tokenizer=False,
        write_model_card=False,
    )
    assert not (out / "tokenizer.json").exists() and not (out / "README.md").exists()
    assert (out / "config.json").is_file()


def test_scale_parameter_of_passthrough(tmp_path, tiny_models):
    a = tiny_models("llama", seed=1)
    out = _merge(
        tmp_path,
        {
            "merge_method": "passthrough",
            "slices": [
                {
                    "sources": [
                        {
                            "model": str(a),
                            "layer_range": [0, 4],
                            "parameters": {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]},
                        }
                    ]
                }
            ],
        },
    )
    merged, original = read_state_dict(out), read_state_dict(a)
    for n in original:
        factor = 0.5 if "o_proj" in n else 1.0
        torch.testing.assert_close(merged[n], original[n] * factor, rtol=0, atol=0)


def test_gradient_weights_across_a_slice(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "slices": [
                {
                    "sources": [
                        {"model": str(a), "layer_range": [0, 4], "parameters": {"weight": [0.0, 1.0]}},
                        {"model": str(b), "layer_range": [0, 4], "parameters": {"weight": [1.0, 0.0]}},
                    ]
                }
            ],
        },
    )
    merged, sa, sb = read_state_dict(out), read_state_dict(a), read_state_dict(b)
    for i in range(4):
        t = i / 3
        n = f"model.layers.{i}.mlp.up_proj.weight"
        torch.testing.assert_close(merged[n], t * sa[n] + (1 - t) * sb[n])
    # non-layer tensors use t = 0
    torch.testing.assert_close(merged["model.embed_tokens.weight"], sb["model.embed_tokens.weight"])


def test_embeddings_from_first_slice_and_head_from_last(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    out = _merge(
        tmp_path,
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
                {"sources": [{"model": str(b), "layer_range": [2, 4]}]},
            ],
        },
    )
    merged, sa, sb = read_state_dict(out), read_state_dict(a), read_state_dict(b)
    assert torch.equal(merged["model.embed_tokens.weight"], sa["model.embed_tokens.weight"])
    assert torch.equal(merged["lm_head.weight"], sb["lm_head.weight"])
    assert torch.equal(merged["model.norm.weight"], sb["model.norm.weight"])


def test_gpt_neox_head_named_embed_out_comes_from_the_last_slice(tmp_path):
    """GPT-NeoX calls its output head `embed_out`: a head, not an embedding, whatever its name says."""
    import transformers

    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        config = transformers.GPTNeoXConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, tie_word_embeddings=False,
        )
        path = tmp_path / f"neox{seed}"
        transformers.GPTNeoXForCausalLM(config).save_pretrained(path)
        paths.append(path)
    a, b = paths
    out = _merge(
        tmp_path,
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
                {"sources": [{"model": str(b), "layer_range": [2, 4]}]},
            ],
        },
    )
    merged, sa, sb = read_state_dict(out), read_state_dict(a), read_state_dict(b)
    assert torch.equal(merged["gpt_neox.embed_in.weight"], sa["gpt_neox.embed_in.weight"])
    assert torch.equal(merged["embed_out.weight"], sb["embed_out.weight"])
    assert torch.equal(merged["gpt_neox.final_layer_norm.weight"], sb["gpt_neox.final_layer_norm.weight"])
    finite_logits(load_causal_lm(out))


def test_vocab_size_mismatch_truncates_to_common_rows(tmp_path, tiny_models):
    """With --unsafe-truncate-embeddings (without it such a merge is refused, as in mergekit 0.1.5)."""
    a = tiny_models("llama", seed=1)
    b = tiny_models("llama", seed=2, vocab_size=272, tokenizer=False)
    config = {
        "merge_method": "linear",
        "models": [{"model": str(a), "parameters": {"weight": 1}}, {"model": str(b), "parameters": {"weight": 1}}],
    }
    with pytest.raises(ConfigError, match="--unsafe-truncate-embeddings"):
        _merge(tmp_path, config, name="refused")
    assert not (tmp_path / "refused").exists()
    out = _merge(tmp_path, config, unsafe_truncate_embeddings=True)
    merged, sa, sb = read_state_dict(out), read_state_dict(a), read_state_dict(b)
    emb = "model.embed_tokens.weight"
    assert merged[emb].shape[0] == 256
    torch.testing.assert_close(merged[emb], (sa[emb] + sb[emb][:256]) / 2)
    load_causal_lm(out)


def test_cli_merge_and_plan(tmp_path, tiny_models):
    a, b = tiny_models("qwen2", seed=1), tiny_models("qwen2", seed=2)
    cfg = tmp_path / "c.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": str(a), "parameters": {"weight": 1}},
                    {"model": str(b), "parameters": {"weight": 2}},
                ],
            }
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    plan = subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", "plan", str(cfg), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    report = json.loads(plan.stdout)
    assert report["bytes_written"] > 0 and len(report["shards"]) == 1
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mergesmith.cli",
            "merge",
            str(cfg),
            str(tmp_path / "o"),
            "-q",
            "--clone-tensors",
            "--lazy-unpickle",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", "merge", str(cfg), str(tmp_path / "o"), "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert again.returncode == 0 and "already complete" in again.stdout


def test_hub_id_resolved_from_the_local_cache(tmp_path, tiny_models):
    src = tiny_models("llama", seed=3)
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / "0123456789abcdef"
    shutil.copytree(src, snap)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "passthrough", "models": [{"model": "someorg/tiny-llama"}]}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    run = subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", "merge", str(cfg), str(tmp_path / "o"), "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    merged, original = read_state_dict(tmp_path / "o"), read_state_dict(src)
    assert all(torch.equal(merged[n], original[n]) for n in original)
    missing = subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", "merge", str(cfg).replace("c.yml", "d.yml"), str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert missing.returncode == 2
    cfg2 = tmp_path / "e.yml"
    cfg2.write_text(yaml.safe_dump({"merge_method": "passthrough", "models": [{"model": "someorg/not-cached"}]}))
    run = subprocess.run(
        [sys.executable, "-m", "mergesmith.cli", "merge", str(cfg2), str(tmp_path / "o3")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "someorg/not-cached" in run.stderr and "cache" in run.stderr
