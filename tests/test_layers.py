"""The package's layers, checked from its source: no import up a layer, no loop between folders or modules.

Every import counts, including those inside functions (imported lazily to keep start-up cheap) and
those under `if TYPE_CHECKING:` (a type that names a module above is still a dependency on it). The
layers, top to bottom, are listed in LAYERS as folders (and the few top-level modules); a module belongs
to its folder's layer. A module may import its own layer and any layer below; a cycle is refused between
folders (the features of one layer, say, must not lean on each other both ways) and between modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mergesmith

PACKAGE_DIR = Path(mergesmith.__file__).parent

# Top to bottom, one entry a folder (or a top-level module): (layer, its folders and modules, what it knows).
# The same table as the design document's: a folder's modules all sit in its layer, none is carved out.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "face",
        ("mergesmith", "__main__", "cli", "python_api", "mergekit_flags", "options", "display"),
        "the command line (mergekit's flags included), the Python API, the options model both are made from, "
        "progress displays and Ctrl-C handling",
    ),
    (
        "features",
        ("evolve", "multi", "moe", "raw", "lora", "tokenizer", "tokensurgeon", "regmean"),
        "one folder per feature: its config turned into plans run through the engine, its recipe operations and "
        "planning steps registered with the engine",
    ),
    ("engine", ("engine",), "the Plan as data, planning, execution (local threads, Ray), the output directory"),
    ("config", ("config",), "the merge-config schema, reading it, checks against the methods' registry"),
    ("methods", ("methods",), "one file per merge method family, the registry and its plugin entry point"),
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


def _cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one node of `graph` (default: the modules' GRAPH;
    Tarjan's algorithm, iteratively)."""
    graph = GRAPH if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
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


def _folder(module: str) -> str:
    """The folder (first component below the package) a module lives in, or the top-level module itself."""
    relative = module.removeprefix("mergesmith").removeprefix(".")
    return relative.split(".")[0] if relative else "mergesmith"


def _folder_graph() -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        edges = folders.setdefault(_folder(name), set())
        edges.update(_folder(t) for t in targets if _folder(t) != _folder(name))
    return folders


def test_no_loop_between_folders() -> None:
    cycles = _cycles(_folder_graph())
    assert not cycles, "folders that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_a_folder_is_one_layer() -> None:
    """No module is carved out of its folder's layer: each entry of LAYERS below the face names a whole folder."""
    for _layer_name, members, _knows in LAYERS:
        for member in members:
            assert "." not in member, f"{member}: LAYERS lists folders, not modules inside them"


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


def test_the_readme_draws_the_same_layers() -> None:
    """README.md's Development table lists the same layers, in the same order, with the same folders."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^  \| (\w+) \| (.+?) \| .+ \|$", readme.split("## Development", 1)[1], flags=re.M)
    drawn = [
        (layer, {_entry(name) for name in re.findall(r"`([^`]+)`", re.sub(r"\(.*?\)", "", folders))})
        for layer, folders in rows
        if layer != "layer"  # the header
    ]
    listed = [(layer, set(members)) for layer, members, _knows in LAYERS]
    assert drawn == listed


def _entry(readme_name: str) -> str:
    """`engine/` -> engine, `cli.py` -> cli, `__init__.py` -> mergesmith (the package root). What a folder
    holds, named in parentheses after it, is left out by the caller."""
    name = readme_name.rstrip("/").removesuffix(".py")
    return "mergesmith" if name == "__init__" else name
