"""Plan-time checks: mixed architectures and --allow-crimes, shape mismatches, merge-parameter names,
dtype names, and the config.json rewrite of sliced outputs. Each is one line on stderr, exit 2, before
any tensor is read (and, where the check needs no checkpoint, before any checkpoint is opened)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    code = exc.value.code if isinstance(exc.value.code, int) else 1
    return code, capsys.readouterr().err


def one_line_error(code: int, err: str, *names: str) -> str:
    lines = err.strip("\n").splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def linear(tmp_path: Path, *models: Path, **top: Any) -> Path:
    models_ = [{"model": str(m), "parameters": {"weight": 1.0}} for m in models]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models_, "dtype": "float32", **top})


# ----- architectures and --allow-crimes -------------------------------------------------------------


def test_different_architectures_need_allow_crimes(tmp_path, tiny_models, capsys):
    llama, mistral = tiny_models("llama", seed=1), tiny_models("mistral", seed=2)
    cfg = linear(tmp_path, llama, mistral)
    code, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q")
    line = one_line_error(code, err, str(llama), str(mistral), "LlamaForCausalLM", "MistralForCausalLM")
    assert "--allow-crimes" in line
    assert not (tmp_path / "out").exists()

    code, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q", "--allow-crimes")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


def test_same_architecture_needs_no_allow_crimes(tmp_path, tiny_models, capsys):
    cfg = linear(tmp_path, tiny_models("llama", seed=1), tiny_models("llama", seed=2))
    code, err = run_cli(capsys, "plan", cfg)
    assert code == 0, err


@pytest.mark.parametrize("crimes", [False, True])
def test_shape_mismatch_is_a_plan_time_error_even_with_allow_crimes(tmp_path, tiny_models, capsys, crimes):
    llama, wider = tiny_models("llama", seed=1), tiny_models("llama", seed=3, intermediate_size=96)
    out = tmp_path / "out"
    args = ["merge", linear(tmp_path, llama, wider), out, "-q"] + (["--allow-crimes"] if crimes else [])
    code, err = run_cli(capsys, *args)
    line = one_line_error(code, err, "mlp.", "shapes differ", str(llama), str(wider))
    assert "internal error" not in line
    assert not out.exists()  # refused before the output directory (or its .mergesmith/) was made
