"""The README's "Adding a merge method", done as it says: its method file and its registration lines go into a
copy of the package, and a mergekit-shaped config merges with that method through the `mergesmith` command.

The two code blocks are read from the README itself, so the section cannot drift from what works. The copy keeps
the installed package untouched (no other test sees the new method); the merge runs in a child process whose path
puts the copy first. The output is loaded with transformers and one tensor is checked against the equation.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import mergesmith
from tests.helpers import load_causal_lm, read_state_dict, write_config

README = Path(__file__).resolve().parents[1] / "README.md"
METHOD_FILE = "# src/mergesmith/methods/task_median.py"
INIT_FILE = "# src/mergesmith/methods/__init__.py"


def _section_blocks() -> dict[str, str]:
    """The python blocks of the README's "Adding a merge method" section, by their first line (the file named)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("### Adding a merge method\n")
    end = text.index("\n### ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end], re.S)
    return {block.splitlines()[0].split(":")[0]: block for block in blocks}


def _package_with_the_method(root: Path) -> Path:
    """A copy of the mergesmith package with the README's file written and its two lines added."""
    blocks = _section_blocks()
    assert {METHOD_FILE, INIT_FILE} <= set(blocks), "the section shows the method file and the registration lines"
    package = root / "mergesmith"
    shutil.copytree(Path(mergesmith.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "methods" / "task_median.py").write_text(blocks[METHOD_FILE])
    lines = blocks[INIT_FILE].splitlines()
    added = [line for line in lines if line.strip().startswith(("task_median", "*task_median"))]
    assert added == ["    task_median,", "    *task_median.METHODS,"], added
    init = package / "methods" / "__init__.py"
    source = init.read_text()
    for opening, line in (("from . import (\n", added[0]), ("BUILT_IN: tuple[MethodSpec, ...] = (\n", added[1])):
        assert source.count(opening) == 1, opening  # the lists the README names are where it says
        source = source.replace(opening, opening + line + "\n")
    init.write_text(source)
    return root


def test_the_documented_method_merges_a_mergekit_config(tiny_models: Any, tmp_path: Path) -> None:
    site = _package_with_the_method(tmp_path / "site")
    base = tiny_models("llama", seed=1)
    models = [tiny_models.derive(base, seed=s, scale=0.01) for s in (2, 3, 4)]
    config = write_config(tmp_path / "median.yml", {
        "merge_method": "task_median",
        "base_model": str(base),
        "models": [{"model": str(m)} for m in models],
        "parameters": {"lambda": 0.8},
        "dtype": "float32",
    })
    done = subprocess.run(
        [sys.executable, "-m", "mergesmith", "merge", str(config), str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    merged = load_causal_lm(tmp_path / "out").state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    x0, xs = read_state_dict(base)[name], [read_state_dict(m)[name] for m in models]
    deltas = torch.stack([x - x0 for x in xs])
    expected = x0 + 0.8 * deltas.median(dim=0).values
    assert not torch.equal(expected, x0)  # the models differ, so the median moves the base
    torch.testing.assert_close(merged[name], expected, rtol=0, atol=0)

