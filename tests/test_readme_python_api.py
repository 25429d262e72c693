"""The README's "Python API" section runs as written: its ```python blocks are executed in order, in one
namespace, in a directory holding the three tiny models they name (models/base, models/a, models/b)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str, section: str = "## Python API") -> list[str]:
    """The ```python blocks of `section` (up to the next `## ` heading)."""
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    body = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_section_has_code_for_each_function() -> None:
    code = "\n".join(python_blocks(README.read_text()))
    for name in ("merge(", "plan(", "merge_state_dicts(", "merge_tensors(", "extract_lora(", "KeyboardInterrupt"):
        assert name in code, name


def test_readme_python_blocks_run(
    tiny_models: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    base = tiny_models("llama", seed=41)
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(base, models / "base")
    shutil.copytree(tiny_models.derive(base, seed=42), models / "a")
    shutil.copytree(tiny_models.derive(base, seed=43), models / "b")
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
        except BaseException as exc:
            raise AssertionError(f"README python block {i + 1} failed: {exc!r}\n{block}") from exc
    out = capsys.readouterr().out
    assert "model written to" in out and "interrupted" in out and "error: " in out
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged-2" / "config.json").is_file()
    assert namespace["result"].shards_reused > 0
    assert "resumed: " in out and namespace["result"].tensors_reused >= 10
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
