"""What mergekit's flags do in mergesmith (tests/test_mergekit_flags.py checks that each one parses).

- `-j/--num-threads` is `--threads`; `--force-population-size` is evolve's `--popsize`;
- `--gpu-rich`/`--multi-gpu` ask for `--device cuda`, refused in one line where CUDA is absent, as `--cuda`
  is; `--read-to-gpu` on the CPU prints one note;
- `--lora-merge-cache`/`--lora-merge-dtype`: a `model+lora` input merged once into that directory (or the
  cache), in that dtype, reused by the next run, with the same merge result;
- a flag without effect prints exactly one `note:` line, also under `--strict`, and only when it asks for
  something mergesmith does not do;
- extract-lora's `--include-regex`/`--exclude-regex`/`--save-module`/`--skip-undecomposable`/
  `--no-distribute-scale`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from mergesmith import mergekit_flags
from mergesmith.cli import cli
from mergesmith.errors import ConfigError
from mergesmith.lora.extract import extract_lora
from mergesmith.options import to_merge_options
from tests.helpers import assert_one_line_error, read_state_dict, run_cli, write_config

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture()
def linear_cfg(tmp_path: Path, tiny_models: Any) -> Path:
    models = [{"model": str(tiny_models("llama", seed=s)), "parameters": {"weight": 0.5}} for s in (1, 2)]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models, "dtype": "float32"})


def _parsed_options(command: str, *args: str) -> Any:
    """MergeOptions as `mergesmith <command> <args>` would build them (the real parser and mapping)."""
    ctx = cli.commands[command].make_context(command, ["config.yml", "out", *args])
    with ctx:
        return to_merge_options(dict(ctx.params), command)


def test_num_threads_is_threads(capsys: Any, linear_cfg: Path) -> None:
    assert _parsed_options("merge", "-j", "3").threads == 3
    assert _parsed_options("moe", "--num-threads", "5").threads == 5
    assert _parsed_options("merge", "-j", "2", "--threads", "2").threads == 2
    code, _out, err = run_cli(capsys, "plan", linear_cfg, "-j", "3", "--threads", "4")
    assert_one_line_error(code, err, "-j/--num-threads 3", "--threads 4")


def test_force_population_size_is_popsize() -> None:
    kw: dict[str, Any] = {"popsize": None, "force_population_size": 12}
    mergekit_flags.take("evolve", kw)
    assert kw == {"popsize": 12}
    with pytest.raises(ConfigError, match="disagree"):
        mergekit_flags.take("evolve", {"popsize": 10, "force_population_size": 12})


@NO_CUDA
@pytest.mark.parametrize("flag", ["--gpu-rich", "--multi-gpu", "--cuda"])
def test_gpu_flags_ask_for_cuda_and_are_refused_in_one_line_without_it(
    flag: str, capsys: Any, linear_cfg: Path, tmp_path: Path
) -> None:
    code, _out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "out", flag, "--lazy-unpickle")
    assert_one_line_error(code, err, "cuda")  # the note about --lazy-unpickle is not printed before it
    assert not (tmp_path / "out").exists()


def test_gpu_flags_map_to_the_cuda_device_and_conflict_with_another() -> None:
    kw: dict[str, Any] = {"device": "cpu", "gpu_rich": True}
    mergekit_flags.take("merge", kw)
    assert kw["device"] == "cuda"
    with pytest.raises(ConfigError, match="--multi-gpu"):
        mergekit_flags.take("merge", {"device": "mps", "multi_gpu": True})


def test_read_to_gpu_on_the_cpu_is_one_note(capsys: Any, linear_cfg: Path, tmp_path: Path) -> None:
    code, _out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "out", "--read-to-gpu", "-q")
    assert code == 0, err
    assert err.splitlines() == [
        "note: `--read-to-gpu` has no effect here: the arithmetic runs on the CPU (add --cuda or --device cuda)"
    ]


def test_flags_without_effect_print_one_note_each_even_under_strict(
    capsys: Any, linear_cfg: Path, tmp_path: Path
) -> None:
    flags = ["--async-write", "--write-threads", "4", "--no-safe-serialization", "--lazy-unpickle", "--clone-tensors",
             "--low-cpu-memory"]
    code, out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "out", *flags, "--strict", "-q")
    assert code == 0 and "wrote" in out, err
    lines = err.splitlines()
    assert all(line.startswith("note: `") for line in lines), err
    named = sorted(line.split("`")[1] for line in lines)
    assert named == sorted(["--lazy-unpickle", "--clone-tensors", "--no-safe-serialization", "--low-cpu-memory",
                            "--async-write", "--write-threads"]), err
    assert "output is always safetensors" in err
    # the same flags in the form that only confirms what mergesmith does: nothing to say
    quiet_flags = ["--no-async-write", "--safe-serialization", "--no-clone-tensors", "--no-low-cpu-memory"]
    code, _out, err = run_cli(capsys, "merge", linear_cfg, tmp_path / "out2", *quiet_flags, "-q")
    assert code == 0 and err == "", err


# ----- --lora-merge-cache / --lora-merge-dtype ---------------------------------------------------------------


@pytest.fixture()
def lora_cfg(tmp_path: Path, tiny_models: Any) -> tuple[Path, Path]:
    """A linear merge of `base+adapter` (an adapter extracted from a fine-tune) with the plain base."""
    base = tiny_models("llama", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=11, scale=0.02)
    adapter = tmp_path / "adapter"
    extract_lora(str(ft), str(base), adapter, 8)
    models = [{"model": f"{base}+{adapter}"}, {"model": str(base)}]
    cfg = write_config(tmp_path / "lora.yml", {"merge_method": "linear", "models": models,
                                               "parameters": {"weight": 0.5}})
    return cfg, base


def test_lora_merge_cache_holds_the_merged_input_and_is_reused(
    lora_cfg: tuple[Path, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "ms-cache"))
    cfg, base = lora_cfg
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "lazy", "-q")
    assert code == 0, err
    cache = tmp_path / "lora-cache"
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "cached", "-q", "--lora-merge-cache", cache)
    assert code == 0, err
    (merged,) = cache.iterdir()
    assert (merged / "model.safetensors").is_file() and (merged / "config.json").is_file()
    assert (merged / "tokenizer.json").is_file()  # a complete model directory, usable by other tools
    assert not (tmp_path / "ms-cache" / "lora-merge").exists()
    # the same merge as applying the adapter tensor by tensor
    lazy, cached = read_state_dict(tmp_path / "lazy"), read_state_dict(tmp_path / "cached")
    assert lazy.keys() == cached.keys() and all(torch.equal(lazy[k], cached[k]) for k in lazy)
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "again", "-q", "--lora-merge-cache", cache)
    assert code == 0, err
    assert [p.name for p in cache.iterdir()] == [merged.name]
    assert (merged / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_lora_merge_dtype_without_a_cache_uses_mergesmiths_cache(
    lora_cfg: tuple[Path, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "ms-cache"))
    cfg, base = lora_cfg
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q", "--lora-merge-dtype", "bfloat16")
    assert code == 0, err
    (merged,) = (tmp_path / "ms-cache" / "lora-merge").iterdir()
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((merged / "config.json").read_text())["torch_dtype"] == "bfloat16"
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out2", "-q", "--lora-merge-dtype", "float32")
    assert code == 0, err
    assert len(list((tmp_path / "ms-cache" / "lora-merge").iterdir())) == 2  # another dtype, another directory


# ----- extract-lora's own mergekit options ---------------------------------------------------------------------


@pytest.fixture()
def fine_tune(tiny_models: Any) -> tuple[Path, Path]:
    base = tiny_models("llama", seed=0, layers=2)
    return tiny_models.derive(base, seed=11, scale=0.02), base


def test_extract_lora_include_exclude_and_save_module(fine_tune: tuple[Path, Path], tmp_path: Path) -> None:
    ft, base = fine_tune
    only_q = extract_lora(str(ft), str(base), tmp_path / "q", 4, include=[r"q_proj"])
    assert only_q.ranks and all(m.endswith("q_proj") for m in only_q.ranks)
    no_mlp = extract_lora(str(ft), str(base), tmp_path / "nomlp", 4, exclude=[r"\.mlp\."])
    assert no_mlp.ranks and not any(".mlp." in m for m in no_mlp.ranks)
    saved = extract_lora(str(ft), str(base), tmp_path / "saved", 4, save_modules=["o_proj"])
    assert not any(m.endswith("o_proj") for m in saved.ranks)
    assert {m for m in saved.modules_to_save if m.endswith("o_proj")} == {
        "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"
    }


def test_extract_lora_skip_undecomposable_and_distribute_scale(
    fine_tune: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    ft, base = fine_tune
    whole = extract_lora(str(ft), str(base), tmp_path / "whole", 4)
    norms = [m for m in whole.modules_to_save if "norm" in m]
    assert norms, whole.modules_to_save
    skipped = extract_lora(str(ft), str(base), tmp_path / "skip", 4, skip_undecomposable=True)
    assert not [m for m in skipped.modules_to_save if "norm" in m]
    args = ["extract-lora", "--model", ft, "--base-model", base, "--out-path", tmp_path / "nd", "--max-rank", "4",
            "--no-distribute-scale", "-j", "1", "--no-cuda", "--lazy-unpickle"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and "low-rank modules" in out, err
    assert err.splitlines() == [
        "note: `--lazy-unpickle` has no effect here: inputs are always read lazily (memory-mapped, .bin files included)"
    ]
    with safe_open(str(tmp_path / "nd" / "adapter_model.safetensors"), "pt") as f:
        b = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight").float()
    torch.testing.assert_close(b.T @ b, torch.eye(b.shape[1]), atol=1e-2, rtol=0)  # B = U: orthonormal columns


# ----- mergekit-evolve's flags ---------------------------------------------------------------------------------


def test_evolve_timeout_save_final_model_and_notes(tmp_path: Path, capsys: Any) -> None:
    """`--timeout 0` stops after the first generation (journaled, resumable), `--save-final-model` writes the best
    merge to STORAGE_PATH/final_model as mergekit-evolve does, and the flags without effect print one note each."""
    pytest.importorskip("cma")
    from tests.test_evolve import genome_doc, write_genome

    path = write_genome(tmp_path, genome_doc())
    storage = tmp_path / "s"
    args = ["evolve", path, "--storage-path", storage, "--max-fevals", "6", "--force-population-size", "2",
            "--timeout", "0", "--save-final-model", "--strategy", "pool", "--wandb", "--no-in-memory", "-q"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert len((storage / "history.jsonl").read_text().splitlines()) == 2  # one generation of two, not six
    assert (storage / "final_model" / "config.json").is_file() and "best fitness" in out
    named = sorted(line.split("`")[1] for line in err.splitlines() if line.startswith("note: "))
    assert named == ["--strategy", "--wandb"], err


def test_plan_reads_a_lora_input_without_filling_the_cache(
    lora_cfg: tuple[Path, Path], tmp_path: Path, capsys: Any
) -> None:
    cfg, _base = lora_cfg
    code, _out, err = run_cli(capsys, "plan", cfg, "--lora-merge-cache", tmp_path / "lora-cache")
    assert code == 0, err
    assert not (tmp_path / "lora-cache").exists()


def test_the_api_takes_the_same_flags(tmp_path: Path, tiny_models: Any) -> None:
    """mergesmith.merge(..., unsafe_truncate_embeddings=True, num_threads=...) as the command line."""
    import mergesmith

    big, small = tiny_models("llama", seed=2, vocab_size=272), tiny_models("llama", seed=1)
    models = [{"model": str(m), "parameters": {"weight": 1}} for m in (big, small)]
    config = {"merge_method": "linear", "models": models}
    with pytest.raises(ConfigError, match="--unsafe-truncate-embeddings"):
        mergesmith.merge(config, tmp_path / "refused")
    result = mergesmith.merge(config, tmp_path / "out", unsafe_truncate_embeddings=True, num_threads=2)
    assert result.plan.recipes and (tmp_path / "out" / "config.json").is_file()
    assert read_state_dict(tmp_path / "out")["model.embed_tokens.weight"].shape[0] == 256
