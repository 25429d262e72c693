"""LoRA inputs (`model+lora`) and `extract-lora`, checked against PEFT itself.

PEFT is the reference for both directions: an input adapter must give exactly the tensors
`merge_and_unload()` gives, and an extracted adapter must load with `PeftModel.from_pretrained`
and reproduce the fine-tune's logits more closely as the rank grows (exactly at full rank).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from mergesmith.cli import main
from mergesmith.config import parse_config
from mergesmith.engine.run import run_merge
from mergesmith.errors import CheckpointError, OutputError
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.io.lora_adapter import LoraCheckpoint
from mergesmith.io.references import open_checkpoint
from mergesmith.lora.extract import extract_lora
from tests.helpers import load_causal_lm, read_state_dict

peft = pytest.importorskip("peft")

TOKENS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 2]])


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture(scope="module")
def peft_adapter(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A llama base, a PEFT adapter with non-zero B, per-module rank/alpha patterns, rsLoRA, an
    embedding target and a modules_to_save head; plus PEFT's own merged state dict."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_models("llama", seed=0, layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(base))
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
        init_lora_weights=False,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3},
        use_rslora=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        wrapped = get_peft_model(model, config)
        with torch.no_grad():
            wrapped.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    adapter = tmp_path_factory.mktemp("peft") / "adapter"
    wrapped.save_pretrained(str(adapter))
    merged = {k: v.detach().clone() for k, v in wrapped.merge_and_unload().state_dict().items()}
    return base, adapter, merged


def test_lora_input_matches_peft_merge(peft_adapter: tuple[Path, Path, dict]) -> None:
    """Every tensor read through `base+adapter` equals PEFT's merge_and_unload, read lazily."""
    base, adapter, merged = peft_adapter
    ckpt = open_checkpoint(f"{base}+{adapter}")
    assert isinstance(ckpt, LoraCheckpoint) and ckpt.root == base
    assert set(ckpt.tensors) == set(merged)
    changed = 0
    plain = Checkpoint.open(str(base))
    for name, info in ckpt.tensors.items():
        got = ckpt.get(name)
        assert tuple(got.shape) == info.shape and got.dtype == merged[name].dtype
        torch.testing.assert_close(got, merged[name], atol=1e-6, rtol=1e-5, msg=name)
        changed += not torch.equal(got, plain.get(name))
    assert changed == 2 * 3 + 2  # q, v, down in two layers, the embedding and the head


def test_lora_input_in_a_merge(peft_adapter: tuple[Path, Path, dict], tmp_path: Path) -> None:
    """A config naming `base+adapter` merges the adapted model: a linear merge with the plain base
    is the mean of the two, and the output loads with transformers."""
    base, adapter, merged = peft_adapter
    cfg = parse_config(
        {
            "merge_method": "linear",
            "models": [{"model": f"{base}+{adapter}"}, {"model": str(base)}],
            "parameters": {"weight": 1.0},
            "dtype": "float32",
        }
    )
    run_merge(cfg, tmp_path / "out")
    out = read_state_dict(tmp_path / "out")
    plain = read_state_dict(base)
    for name, tensor in out.items():
        torch.testing.assert_close(tensor, (merged[name] + plain[name]) / 2, msg=name)
    load_causal_lm(tmp_path / "out")


def test_lora_ref_problems_are_one_line(peft_adapter: tuple[Path, Path, dict], tmp_path: Path) -> None:
    base, adapter, _ = peft_adapter
    with pytest.raises(CheckpointError, match="cannot read as model\\+lora"):
        open_checkpoint(f"{base}+{tmp_path / 'missing'}")
    bad = tmp_path / "dora"
    shutil.copytree(adapter, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="DoRA"):
        open_checkpoint(f"{base}+{bad}")
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(CheckpointError, match="rank 4 but the config says r=3"):
        open_checkpoint(f"{base}+{bad}")
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    with pytest.raises(CheckpointError, match="only LORA"):
        open_checkpoint(f"{base}+{bad}")


def _peft_logits(base: Path, adapter: Path, merge: bool = True) -> torch.Tensor:
    """Logits of the base with the adapter loaded by PEFT, after `merge_and_unload()` (checked equal
    to the unmerged model's) unless `merge` is false; any PeftWarning (e.g. a lora_bias PEFT cannot
    merge) fails the test."""
    import warnings

    from peft import PeftModel, PeftWarning
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("error", PeftWarning)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()
        unmerged = _logits(model)
        if not merge:
            return unmerged
        merged = _logits(model.merge_and_unload())
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    return merged


def test_extract_error_shrinks_with_rank_and_vanishes_at_full_rank(tiny_models: Any, tmp_path: Path) -> None:
    """PEFT loads every extracted adapter; the logit error falls as the rank grows and is ~0 at
    full rank (32 = the smallest side of every weight), where reading the adapter back as an
    input gives the fine-tune's tensors."""
    base = tiny_models("llama", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=11, scale=0.02)
    target = _logits(load_causal_lm(ft))
    errors = []
    for rank in (1, 4, 16, 32):
        result = extract_lora(str(ft), str(base), tmp_path / f"r{rank}", rank)
        assert max(result.ranks.values()) == rank
        errors.append(float((_peft_logits(base, tmp_path / f"r{rank}") - target).abs().max()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-4 < errors[0], errors
    back = open_checkpoint(f"{base}+{tmp_path / 'r32'}")
    want = read_state_dict(ft)
    for name in back.tensors:
        torch.testing.assert_close(back.get(name), want[name], atol=1e-5, rtol=1e-4, msg=name)
    config = json.loads((tmp_path / "r32" / "adapter_config.json").read_text())
    assert "model.embed_tokens" in config["modules_to_save"] and "lm_head" in config["modules_to_save"]


def test_extract_tied_embeddings_biases_and_embed_lora(tiny_models: Any, tmp_path: Path) -> None:
    """Qwen2 ties its head to the embedding and has q/k/v biases but none on o_proj or the MLP: PEFT's
    lora_bias would give those a bias it cannot merge, so the changed biases travel whole (`bias:
    lora_only`, as `base_layer.bias`). At full rank PEFT loads and merges the adapter exactly, both
    with the embedding saved whole and factored (`--embed-lora`)."""
    base = tiny_models("qwen2", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=12, scale=0.02)
    target = _logits(load_causal_lm(ft))
    whole = extract_lora(str(ft), str(base), tmp_path / "whole", 256)
    config = json.loads((tmp_path / "whole" / "adapter_config.json").read_text())
    assert config["lora_bias"] is False and config["bias"] == "lora_only"
    keys = read_state_dict_keys(tmp_path / "whole")
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" in keys
    assert not any(k.endswith("lora_B.bias") for k in keys)
    assert any("bias: lora_only" in note for note in whole.notes)
    torch.testing.assert_close(_peft_logits(base, tmp_path / "whole"), target, atol=1e-4, rtol=1e-4)
    factored = extract_lora(str(ft), str(base), tmp_path / "factored", 256, embed_lora=True)
    assert "model.embed_tokens" in factored.ranks and "model.embed_tokens" not in whole.ranks
    keys = read_state_dict_keys(tmp_path / "factored")
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in keys
    # PEFT ties the head's LoRA to the embedding's, and its merge_and_unload() (0.21) then adds the
    # update twice to the one shared matrix: only the unmerged model is PEFT's reference here.
    assert any("merge_and_unload" in note for note in factored.notes)
    factored_logits = _peft_logits(base, tmp_path / "factored", merge=False)
    torch.testing.assert_close(factored_logits, target, atol=1e-4, rtol=1e-4)
    want = read_state_dict(ft)
    for adapter in ("whole", "factored"):  # read back as an input: the fine-tune's tensors, biases included
        back = open_checkpoint(f"{base}+{tmp_path / adapter}")
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.bias"):
            torch.testing.assert_close(back.get(name), want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_extract_lora_bias_when_every_target_has_a_bias(tiny_models: Any, tmp_path: Path) -> None:
    """A fine-tune that changed only q/k/v (weights and biases): every target has a bias, so the bias
    deltas go as PEFT's `lora_B.bias`, which PEFT merges without a warning."""
    from safetensors.torch import load_file, save_file

    base = tiny_models("qwen2", seed=0, layers=2)
    ft = tmp_path / "ft"
    shutil.copytree(base, ft)
    tensors = load_file(ft / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name in sorted(tensors):
        if any(f"self_attn.{p}_proj." in name for p in "qkv"):
            tensors[name] = tensors[name] + 0.02 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, ft / "model.safetensors", metadata={"format": "pt"})
    result = extract_lora(str(ft), str(base), tmp_path / "adapter", 256)
    assert sorted(result.ranks) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["lora_bias"] is True and config["bias"] == "none"
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias" in read_state_dict_keys(tmp_path / "adapter")
    target = _logits(load_causal_lm(ft))
    torch.testing.assert_close(_peft_logits(base, tmp_path / "adapter"), target, atol=1e-4, rtol=1e-4)


def read_state_dict_keys(adapter: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_extract_cli(tiny_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI writes the adapter, honours --sv-epsilon, and refuses to overwrite without --overwrite."""
    base = tiny_models("llama", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=11, scale=0.02)
    out = tmp_path / "adapter"
    args = ["extract-lora", "--model", str(ft), "--base", str(base), "--out", str(out), "--max-rank", "8"]
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 0 and "low-rank modules" in capsys.readouterr().out
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main([*args, "--overwrite", "--sv-epsilon", "0.2"])
    assert done.value.code == 0
    module = "model.layers.0.mlp.down_proj"
    delta = read_state_dict(ft)[f"{module}.weight"] - read_state_dict(base)[f"{module}.weight"]
    kept = int((torch.linalg.svdvals(delta) > 0.2).sum())
    assert 0 < kept < 8, kept
    assert _adapter_tensors(out)[f"base_model.model.{module}.lora_A.weight"].shape[0] == kept
    with pytest.raises(OutputError):
        extract_lora(str(ft), str(base), out, 4)
    with pytest.raises(CheckpointError, match="identical"):
        extract_lora(str(base), str(base), tmp_path / "same", 4)


def test_extract_without_a_lora_target_is_one_line(
    tiny_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PEFT cannot load an adapter whose target_modules is empty, so when nothing survives as a
    low-rank update extraction stops with one line and exit 2, naming the cause, and writes nothing."""
    from safetensors.torch import load_file, save_file

    base = tiny_models("llama", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=11, scale=0.02)
    out = tmp_path / "adapter"
    args = ["extract-lora", "--model", str(ft), "--base", str(base), "--out", str(out), "--sv-epsilon", "1e9"]
    with pytest.raises(SystemExit) as done:
        main(args)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert "--sv-epsilon" in err and "identical" not in err and "largest singular value" in err
    assert not (out / "adapter_config.json").exists()

    norms_only = tmp_path / "norms"
    shutil.copytree(base, norms_only)
    tensors = load_file(norms_only / "model.safetensors")
    for name in ("model.norm.weight", "model.embed_tokens.weight"):
        tensors[name] = tensors[name] * 1.5
    save_file(tensors, norms_only / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm") as info:
        extract_lora(str(norms_only), str(base), out, 8)
    assert "identical" not in str(info.value) and "--embed-lora" in str(info.value)
    result = extract_lora(str(norms_only), str(base), out, 8, embed_lora=True)  # the embedding is a target now
    assert list(result.ranks) == ["model.embed_tokens"] and result.modules_to_save == ["model.norm"]


def _adapter_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(adapter / "adapter_model.safetensors")


def test_adapter_config_is_part_of_the_identity(peft_adapter: tuple[Path, Path, dict], tmp_path: Path) -> None:
    """Editing an adapter's alpha changes its tensors, so it must change the resume fingerprint's
    input identity; a tokenizer shipped beside the adapter is the input's tokenizer."""
    base, adapter, _ = peft_adapter
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    before = open_checkpoint(f"{base}+{copy}")
    identity = before.identity()
    assert before.tokenizer_root == base
    q = "model.layers.0.self_attn.q_proj.weight"
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 2 * cfg["lora_alpha"]}))
    after = open_checkpoint(f"{base}+{copy}")
    assert after.identity() != identity
    plain = Checkpoint.open(str(base)).get(q)
    torch.testing.assert_close(after.get(q) - plain, 2 * (before.get(q) - plain), atol=1e-6, rtol=1e-4)
    shutil.copy2(base / "tokenizer.json", copy / "tokenizer.json")
    assert open_checkpoint(f"{base}+{copy}").tokenizer_root == copy
