"""The compatibility corpus: configs in the shapes people publish, each run unchanged.

Every file under tests/compat/ is a mergekit config as a model card would show it (hub ids, comments,
leftover parameters, `name:` keys, ...). Its header says what must happen:

    # expect: merged | warned | refused
    # line: <text that a `warning:` line (warned) or the one `error:` line (refused) contains>
    # command: merge | multi | moe | merge-raw      (default: merge)
    # args: extra command-line arguments            (e.g. --strict)

The hub ids are real repositories' names; here they resolve, through a Hugging Face cache laid out in a
temporary directory (`models--org--name/snapshots/<commit>`, `refs/<revision>`), to tiny generated models,
exactly as a downloaded model would: the configs stay byte for byte what a user would run. `merged` means
exit 0, no `warning:` line and a complete output directory; `warned` the same with each `line` in some
warning; `refused` exit 2 with one `error:` line containing each `line` and nothing written.
"""

from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli

CORPUS = Path(__file__).parent / "compat"
CONFIGS = sorted(CORPUS.glob("*.yml"))
OUTCOMES = ("merged", "warned", "refused")


def expectations(path: Path) -> dict[str, Any]:
    """The `# expect:`/`# line:`/`# command:`/`# args:` header of one corpus file."""
    found: dict[str, Any] = {"lines": [], "command": "merge", "args": []}
    for raw in path.read_text().splitlines():
        text = raw.strip()
        for key in ("expect", "line", "command", "args"):
            if text.startswith(f"# {key}:"):
                value = text.split(":", 1)[1].strip()
                if key == "line":
                    found["lines"].append(value)
                elif key == "args":
                    found["args"] = value.split()
                else:
                    found[key] = value
    assert found.get("expect") in OUTCOMES, f"{path.name}: header needs `# expect: merged|warned|refused`"
    return found


def _cache_model(cache: Path, repo: str, source: Path, revisions: dict[str, Path] | None = None) -> None:
    """Lay `source` (and other revisions) out as huggingface_hub does: one snapshot per commit, refs by name."""
    root = cache / ("models--" + repo.replace("/", "--"))
    for ref, src in {"main": source, **(revisions or {})}.items():
        commit = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
        snapshot = root / "snapshots" / commit
        shutil.copytree(src, snapshot)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)


def _tiny_llava(path: Path, seed: int) -> Path:
    """A LLaVA with a 2-layer llama text decoder and a 3-layer CLIP vision tower (a few hundred KB)."""
    import torch
    import transformers

    text = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=16, patch_size=8
    )
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=127)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hub_cache(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding the corpus's hub ids, each a tiny model (the same for every test)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    base = tiny_models("llama", seed=0)
    qwen = tiny_models("qwen2", seed=0)
    llava = tmp_path_factory.mktemp("llava")
    _cache_model(cache, "mistralai/Mistral-7B-v0.1", base, {"v2": tiny_models.derive(base, seed=9)})
    _cache_model(cache, "teknium/OpenHermes-2.5-Mistral-7B", tiny_models.derive(base, seed=1))
    _cache_model(cache, "HuggingFaceH4/zephyr-7b-beta", tiny_models.derive(base, seed=2))
    _cache_model(cache, "meta-math/MetaMath-Mistral-7B", tiny_models.derive(base, seed=3))
    _cache_model(cache, "Intel/neural-chat-7b-v3-3", tiny_models("llama", seed=4))
    _cache_model(cache, "Qwen/Qwen2.5-0.5B", qwen)
    _cache_model(cache, "Qwen/Qwen2.5-0.5B-Instruct", tiny_models.derive(qwen, seed=5))
    _cache_model(cache, "llava-hf/llava-1.5-7b-hf", _tiny_llava(llava / "a", seed=1))
    _cache_model(cache, "llava-hf/bakLlava-v1-hf", _tiny_llava(llava / "b", seed=2))
    return cache


def _complete(out: Path, command: str) -> bool:
    if command == "merge-raw":
        return (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    return (out / "config.json").is_file()


def _run(config: Path, expect: dict[str, Any], tmp_path: Path, capsys: Any) -> tuple[int, str, list[Path]]:
    command = expect["command"]
    if command == "multi":
        import yaml

        documents = [d for d in yaml.safe_load_all(config.read_text()) if d]
        stages = tmp_path / "stages"
        args: list[Any] = ["multi", config, "--out-dir", stages]
        outputs = [stages / d["name"] for d in documents if d.get("name")]
        if any(not d.get("name") for d in documents):
            args += ["--out-path", tmp_path / "final"]
            outputs.append(tmp_path / "final")
    else:
        args, outputs = [command, config, tmp_path / "out"], [tmp_path / "out"]
    code, _out, err = run_cli(capsys, *args, *expect["args"])
    return code, err, outputs


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_corpus_config_runs_unchanged(
    config: Path, hub_cache: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    # the cache location is read when huggingface_hub is imported, so patch the constant itself
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("MERGESMITH_PROGRESS_INTERVAL", "3600")
    expect = expectations(config)
    code, err, outputs = _run(config, expect, tmp_path, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    warnings = [line for line in lines if line.startswith("warning: ")]
    errors = [line for line in lines if line.startswith("error: ")]
    assert "Traceback" not in err, err
    if expect["expect"] == "refused":
        assert code == 2, f"expected a refusal, got exit {code}:\n{err}"
        assert len(errors) == 1 and errors[0] == lines[-1], err
        for text in expect["lines"]:
            assert text in errors[0], f"{text!r} not in: {errors[0]}"
        assert not any(_complete(out, expect["command"]) for out in outputs)
    else:
        assert code == 0, f"expected a merge, got exit {code}:\n{err}"
        assert not errors, err
        assert all(_complete(out, expect["command"]) for out in outputs), err
        if expect["expect"] == "merged":
            assert not warnings, f"expected no warnings:\n{err}"
        else:
            assert warnings, f"expected warnings:\n{err}"
            for text in expect["lines"]:
                assert any(text in w for w in warnings), f"{text!r} in no warning:\n{err}"


def test_corpus_is_large_and_mixed(capsys: Any) -> None:
    """At least 40 configs, every outcome represented; prints the counts (merged / warned / refused)."""
    counts = Counter(expectations(p)["expect"] for p in CONFIGS)
    with capsys.disabled():
        print(f"\ncompat corpus: {len(CONFIGS)} configs: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES))
    assert len(CONFIGS) >= 40
    assert all(counts[o] >= 5 for o in OUTCOMES), counts
