"""The model card's `base_model:` metadata lists Hub ids only; local inputs are named in the card's text.

The Hub and llama.cpp's GGUF converter turn every `base_model` entry into `https://huggingface.co/<entry>`,
so a local path there became `https://huggingface.co//tmp/...`.
"""

from __future__ import annotations

import os

import yaml

from mergesmith.config import MergeConfiguration
from mergesmith.engine.card import hub_ids, model_card
from mergesmith.moe.card import moe_model_card
from mergesmith.moe.config import MoEConfiguration


def front(card: str) -> dict:
    head, sep, _rest = card.removeprefix("---\n").partition("\n---\n")
    assert sep, card[:200]
    return yaml.safe_load(head)


def test_hub_ids_leave_out_local_paths(tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    snapshot = tmp_path / "hub" / "models--google--gemma-2-2b" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    refs = [
        str(tmp_path / "models" / "mine"),  # absolute local path
        "models/mine",  # a relative directory that looks like owner/name: local, as the loader reads it
        "./nowhere/else",
        "~/x",
        "meta-llama/Llama-2-7b-hf",
        "Qwen/Qwen2-0.5B@main",  # a revision names the repository
        "org/base+org/lora-adapter",  # model+lora: both are Hub repositories
        "meta-llama/Llama-2-7b-hf",  # once only
        str(snapshot),  # a Hugging Face cache snapshot names its repository
    ]
    assert hub_ids(refs) == [
        "meta-llama/Llama-2-7b-hf",
        "Qwen/Qwen2-0.5B",
        "org/base",
        "org/lora-adapter",
        "google/gemma-2-2b",
    ]


def test_merge_card_lists_hub_ids_in_metadata_and_local_inputs_in_the_text(tmp_path):
    local = tmp_path / "local-model"
    local.mkdir()
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "ties",
            "base_model": str(local),
            "models": [
                {"model": "mistralai/Mistral-7B-v0.1", "parameters": {"weight": 0.5, "density": 0.5}},
                {"model": str(local)},
            ],
        }
    )
    card = model_card(config)
    meta = front(card)
    assert meta["base_model"] == ["mistralai/Mistral-7B-v0.1"]
    assert str(local) not in yaml.safe_dump(meta)
    assert f"Base model: `{local}` (local)." in card
    assert f"- `{local}` (local)" in card and "- `mistralai/Mistral-7B-v0.1`\n" in card


def test_card_of_local_inputs_only_has_no_base_model_key(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.mkdir()
    config = MergeConfiguration.model_validate(
        {"merge_method": "linear", "models": [{"model": str(p), "parameters": {"weight": 1.0}} for p in paths]}
    )
    meta = front(model_card(config))
    assert "base_model" not in meta and meta["tags"] == ["mergesmith", "merge"]


def test_moe_card_lists_hub_ids_only(tmp_path):
    local = tmp_path / "expert"
    local.mkdir()
    config = MoEConfiguration.model_validate(
        {
            "base_model": "mistralai/Mistral-7B-v0.1",
            "gate_mode": "random",
            "experts": [
                {"source_model": str(local)},
                {"source_model": "HuggingFaceH4/zephyr-7b-beta"},
            ],
        }
    )
    card = moe_model_card(config, "mixtral")
    assert front(card)["base_model"] == ["mistralai/Mistral-7B-v0.1", "HuggingFaceH4/zephyr-7b-beta"]
    assert f"0. `{local}` (local)" in card
    assert os.fspath(local) not in card.split("\n---\n", 1)[0]
