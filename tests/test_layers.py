"""The package's layers, checked from its source: no import cycle between modules, no import up a layer.

Every import counts, including those inside functions (imported lazily to keep start-up cheap) and
those under `if TYPE_CHECKING:` (a type that names a module above is still a dependency on it). The
layers, top to bottom, are listed in LAYERS; a module belongs to the layer of the longest prefix that
names it. A module may import its own layer and any layer below; a cycle is refused even within a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mergesmith

PACKAGE_DIR = Path(mergesmith.__file__).parent

# Top to bottom. Each entry: (layer, the modules or packages in it, what it knows).
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "face",
        ("mergesmith", "__main__", "python_api", "cli", "options", "mergekit_flags", "display"),
        "argument handling (the options model, mergekit's flags included), the public API, progress displays",
    ),
    (
        "commands",
        ("evolve", "multi", "moe", "raw", "lora", "tokensurgeon", "tokensurgeon.api"),
        "one folder per feature: its config or arguments turned into plans, run through engine.run",
    ),
    ("run", ("engine.run",), "the output directory protocol: plan, execute, finish, resume"),
    (
        "planners",
        ("engine.planning.merge_planner", "engine.planning.module_planner", "engine.report", "engine.time_estimate"),
        "merge configs -> Plan; the report",
    ),
    (
        "execution",
        (
            "engine.execution.local_executor",
            "engine.execution.admission",
            "engine.execution.compute",
            "engine.execution.writing",
            "engine.execution.ray_executor",
            "engine.execution.input_feed",
            "engine.execution.ops",
        ),
        "running a Plan: local threads or Ray, the input feed, recipe operations",
    ),
    (
        "vocabulary",
        (
            "tokenizer",
            "tokensurgeon.planner",
            "tokensurgeon.merge",
            "tokensurgeon.table",
            "tokensurgeon.vocab",
            "tokensurgeon.approximate",
            "tokensurgeon.registration",
            "tokensurgeon.source",
        ),
        "tokenizer steps the merge planner calls and the row operations the executor runs for them",
    ),
    (
        "engine core",
        (
            "engine",
            "engine.plan",
            "engine.planning.shared",
            "engine.execution.blocks",
            "engine.planning.architecture",
            "engine.card",
            "engine.planning.parameters",
            "engine.execution.nonfinite",
        ),
        "the Plan as data and what every planner shares: options, shards, estimates, layer stacks",
    ),
    ("config", ("config",), "the merge-config schema, reading it, checks against the methods' registry"),
    ("methods", ("methods",), "pure tensor math and the registry"),
    ("kernels", ("kernels",), "the numerical machinery methods share: sort replay, keyed masks, compiled loops"),
    ("runtime", ("runtime",), "the process: devices, memory limits and release, caches, warm start"),
    ("io", ("io",), "checkpoints in, safetensors out, the journal, direct I/O, safe YAML"),
    ("base", ("errors", "_version", "sizes"), "error types, the version, byte counts as people read them"),
]


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its source."""
    path, is_package = MODULES[name]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names]  # `from pkg import submodule` or a name in module
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int:
    """The index in LAYERS of the longest listed prefix of `module` ("mergesmith" is the package root alone)."""
    relative = module.removeprefix("mergesmith").removeprefix(".")
    best: tuple[int, int] | None = None  # (layer index, length of the matching entry)
    for index, (_name, members, _knows) in enumerate(LAYERS):
        for member in members:
            if member == "mergesmith":
                matches, length = relative == "", 0
            else:
                matches, length = relative == member or relative.startswith(member + "."), len(member)
            if matches and (best is None or length > best[1]):
                best = (index, length)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best[0]


GRAPH = {name: _imports(name) for name in MODULES}


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        _layer(name)


def test_imports_only_go_down() -> None:
    upward = []
    for name, targets in sorted(GRAPH.items()):
        for target in sorted(targets):
            if _layer(target) < _layer(name):
                upward.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(monkeypatch: pytest.MonkeyPatch, source: dict, expected: list) -> None:
    """The checks above can fail: the cycle finder sees a planted circle, and an upward import is caught."""
    monkeypatch.setitem(globals(), "GRAPH", source)
    assert _cycles() == expected


def test_an_upward_import_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    planted = {name: set(targets) for name, targets in GRAPH.items()}
    planted["mergesmith.io.checkpoint"].add("mergesmith.engine.planning.merge_planner")
    monkeypatch.setitem(globals(), "GRAPH", planted)
    expected = "mergesmith.io.checkpoint \\(io\\) imports mergesmith.engine.planning.merge_planner"
    with pytest.raises(AssertionError, match=expected):
        test_imports_only_go_down()
