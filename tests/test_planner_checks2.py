"""Plan-time checks, second batch: vocabulary truncation warnings (and that `plan` and `merge` show plan
warnings), device availability through the API and extract-lora, working-memory estimates of the
task-vector methods, DELLA's density +/- epsilon, method errors as one line, and MoE dtype names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else 1
    return code, captured.out, captured.err


def one_line_error(code: int, err: str, *names: str) -> str:
    lines = err.strip("\n").splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "internal error" not in lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ----- 1. vocabulary sizes differ without a tokenizer section ----------------------------------------------------


@pytest.fixture()
def vocab_cfg(tmp_path: Path, tiny_models: Any) -> tuple[Path, Path, Path]:
    """A linear merge whose base (first model, whose tokenizer is copied) has 272 rows, the other 256."""
    big = tiny_models("llama", seed=2, vocab_size=272)
    small = tiny_models("llama", seed=1)
    cfg = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "linear",
            "base_model": str(big),
            "models": [
                {"model": str(big), "parameters": {"weight": 1}},
                {"model": str(small), "parameters": {"weight": 1}},
            ],
            "dtype": "float32",
        },
    )
    return cfg, big, small


def _vocab_warning(lines: list[str], big: Path, small: Path) -> str:
    hits = [line for line in lines if line.startswith("warning: vocabulary sizes differ")]
    assert len(hits) == 1, lines
    line = hits[0]
    for part in (
        f"model {str(big)!r} has 272",
        f"model {str(small)!r} has 256",
        "first 256 rows",
        "tokenizer_source: base",
        "tokenizer_source: union",
        "out of range",
    ):
        assert part in line, f"{part!r} not in {line!r}"
    return line


def test_plan_text_and_json_show_the_vocabulary_truncation_warning(vocab_cfg, capsys):
    cfg, big, small = vocab_cfg
    code, out, err = run_cli(capsys, "plan", cfg)
    assert code == 0, err
    _vocab_warning(out.splitlines(), big, small)
    code, out, err = run_cli(capsys, "plan", cfg, "--json")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    _vocab_warning([f"warning: {w}" for w in warnings], big, small)


def test_merge_prints_plan_warnings_once_on_stderr_unless_quiet(vocab_cfg, tmp_path, capsys):
    cfg, big, small = vocab_cfg
    code, out, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert code == 0, err
    _vocab_warning(err.splitlines(), big, small)
    code, out, err = run_cli(capsys, "merge", cfg, tmp_path / "out2", "-q")
    assert code == 0, err
    assert "warning" not in err


def test_tokenizer_source_base_builds_the_vocabulary_and_does_not_warn(vocab_cfg, tmp_path, capsys):
    cfg, big, small = vocab_cfg
    data = yaml.safe_load(cfg.read_text())
    data["tokenizer_source"] = "base"
    code, out, err = run_cli(capsys, "plan", write_config(tmp_path / "t.yml", data), "--json")
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "vocabulary sizes differ" in w]


def test_same_vocabulary_has_no_truncation_warning(tmp_path, tiny_models, capsys):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=3)
    models = [{"model": str(m), "parameters": {"weight": 1}} for m in (a, b)]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models})
    code, out, err = run_cli(capsys, "plan", cfg, "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []


# ----- 2. device availability: one check for the CLI, the API and extract-lora -------------------------------------


@pytest.fixture()
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def _linear_cfg(tmp_path: Path, tiny_models: Any) -> Path:
    models = [{"model": str(tiny_models("llama", seed=s)), "parameters": {"weight": 1}} for s in (1, 3)]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models, "dtype": "float32"})


@pytest.mark.parametrize("device", ["cuda", "mps", "cuda:0"])
def test_run_merge_on_a_missing_device_is_a_user_error_before_anything_is_written(
    tmp_path, tiny_models, no_gpu, device
):
    from mergesmith.api import run_merge
    from mergesmith.errors import ConfigError
    from mergesmith.planner import MergeOptions

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"{device.split(':')[0]} device is available"):
        run_merge(_linear_cfg(tmp_path, tiny_models), out, MergeOptions(device=device))
    assert not out.exists()


def test_run_merge_device_auto_falls_back_to_cpu(tmp_path, tiny_models, no_gpu):
    from mergesmith.api import build_plan, run_merge
    from mergesmith.planner import MergeOptions

    cfg = _linear_cfg(tmp_path, tiny_models)
    options = MergeOptions(device="auto")
    build_plan(cfg, options)
    assert options.device == "cpu"
    result = run_merge(cfg, tmp_path / "out", MergeOptions(device="auto"))
    assert (result.out_dir / "config.json").is_file()


def test_device_is_not_checked_for_the_ray_executor(tmp_path, tiny_models, no_gpu):
    from mergesmith.api import build_plan
    from mergesmith.planner import MergeOptions

    options = MergeOptions(device="cuda", executor="ray")
    build_plan(_linear_cfg(tmp_path, tiny_models), options)  # the workers hold the GPUs
    assert options.device == "cuda"


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_extract_lora_on_a_missing_device_is_one_line_and_writes_nothing(tmp_path, tiny_models, no_gpu, capsys, device):
    base = tiny_models("llama", seed=1)
    out = tmp_path / "adapter"
    code, _out, err = run_cli(
        capsys,
        "extract-lora",
        "--model",
        tiny_models("llama", seed=3),
        "--base",
        base,
        "--out",
        out,
        "--device",
        device,
    )
    one_line_error(code, err, f"--device {device}", "available")
    assert not out.exists()

    from mergesmith.errors import ConfigError
    from mergesmith.lora_extract import extract_lora

    with pytest.raises(ConfigError, match="available"):
        extract_lora(str(tiny_models("llama", seed=3)), str(base), out, 4, device=device)
    assert not out.exists()
