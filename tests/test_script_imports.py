"""Every `mergesmith` import in the scripts outside the package resolves.

Why: bench/, examples/ and scripts/ are not imported by the test suite, and many of their imports sit inside
functions (a cgroup helper imported only when a run starts), so a module moved or renamed in the package breaks
them silently until someone runs a 20-minute benchmark. This reads each script's syntax tree, imports every
`mergesmith` module named there (at any depth) and checks each imported name exists.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("bench", "examples", "scripts") for p in (ROOT / folder).rglob("*.py"))


def mergesmith_imports(source: str) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for each import of mergesmith in `source`, nested ones included."""
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "mergesmith"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mergesmith":
            found += [(node.module or "", a.name, node.lineno) for a in node.names]
    return found


def unresolved(source: str) -> list[str]:
    """The imports of `source` that fail, as 'line N: module.name'."""
    problems = []
    for module, name, line in mergesmith_imports(source):
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            problems.append(f"line {line}: {module}")
            continue
        if name is not None and name != "*" and not hasattr(loaded, name):
            try:  # a submodule imported by name (`from mergesmith.methods import sort_select`)
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                problems.append(f"line {line}: {module}.{name}")
    return problems


def test_scripts_are_found() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"bench_7b_cgroup.py", "compare_mergekit.py", "run_proof.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_imports_resolve(script: Path) -> None:
    assert unresolved(script.read_text()) == []


def test_a_moved_module_is_caught() -> None:
    """The case that slipped through once: an import inside a function, of a module that moved."""
    source = (
        "def group():\n"
        "    from mergesmith.memory_limits import cgroup_dirs\n"
        "    from mergesmith.methods import nope\n"
    )
    assert unresolved(source) == ["line 2: mergesmith.memory_limits", "line 3: mergesmith.methods.nope"]
