"""README, "Adding an architecture": a transformers architecture the other tests do not cover (StableLM) merges
with no code, checked as the section says; and a per-layer config key inference cannot know is rewritten for a
new depth once it is registered (architecture.register_per_layer_key), and left alone before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import mergesmith
from mergesmith.engine.planning import architecture
from tests.helpers import finite_logits, load_causal_lm

LAYERS = 3
STEPS = [1.0, 2.0, 3.0]  # a made-up per-layer config key's value, one entry per layer


def _tiny(path: Path, seed: int) -> Path:
    """A tiny random StableLM checkpoint, built from its config class (as the README says)."""
    from transformers import StableLmConfig, StableLmForCausalLM

    config = StableLmConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    StableLmForCausalLM(config).save_pretrained(path)
    written = json.loads((path / "config.json").read_text())
    written["layer_steps"] = STEPS
    (path / "config.json").write_text(json.dumps(written))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stablelm")
    return {name: str(_tiny(root / name, seed)) for seed, name in enumerate(("base", "a", "b"))}


def _merged(config: dict[str, Any], out: Path, layers: int) -> dict[str, Any]:
    mergesmith.merge(config, out)
    model = load_causal_lm(out)  # no missing, unexpected or mismatched keys
    finite_logits(model)
    assert model.config.num_hidden_layers == layers
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_a_new_architecture_merges_with_no_code(models: dict[str, str], tmp_path: Path, method: str) -> None:
    if method == "linear":  # three models, no base
        config: dict[str, Any] = {"models": [{"model": models[m], "parameters": {"weight": 1.0}} for m in models]}
    else:  # two fine-tunes over the base
        tuned = [{"model": models[m], "parameters": {"weight": 0.5, "density": 0.5}} for m in "ab"]
        config = {"base_model": models["base"], "models": tuned}
    config.update(merge_method=method, dtype="float32")
    assert _merged(config, tmp_path / "out", LAYERS)["layer_steps"] == STEPS


def _passthrough(models: dict[str, str]) -> dict[str, Any]:
    """3 -> 5 layers: all of a, then layers 1-2 of b."""
    return {
        "merge_method": "passthrough",
        "slices": [
            {"sources": [{"model": models["a"], "layer_range": [0, 3]}]},
            {"sources": [{"model": models["b"], "layer_range": [1, 3]}]},
        ],
        "dtype": "float32",
    }


def test_a_depth_change_rewrites_the_per_layer_keys_registered(
    models: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(architecture, "PER_LAYER_KEYS", set(architecture.PER_LAYER_KEYS))  # undone after the test
    unknown = _merged(_passthrough(models), tmp_path / "before", 5)
    assert unknown["layer_steps"] == STEPS  # not known to be per-layer: left as it was

    architecture.register_per_layer_key("layer_steps")
    known = _merged(_passthrough(models), tmp_path / "after", 5)
    assert known["layer_steps"] == [1.0, 2.0, 3.0, 2.0, 3.0]  # output layer i follows its source layer
    assert {k: v for k, v in known.items() if k != "layer_steps"} == {
        k: v for k, v in unknown.items() if k != "layer_steps"
    }
