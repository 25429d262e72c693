"""No merge waits for a kernel compile (issue 29, item 4): compiled.KernelGroup answers at once, and a merge run
while the groups are still compiling takes the uncompiled paths and writes the same bytes as one run compiled. A
large merge waits for a group's *load* from numba's cache (issue 33), never longer than LOAD_WAIT_SECONDS.

Outside the tests a group that is not ready is never waited for; the suite sets MERGESMITH_KERNELS=wait
(conftest.py), so the tests here that need the default remove it.
"""

from __future__ import annotations

import threading

import pytest

from mergesmith.kernels import bf16_mix, compiled, introsort_replay, keyed_kernels, weighted_sum

pytestmark = pytest.mark.skipif(not compiled.AVAILABLE, reason="numba is not installed")

GROUPS = (bf16_mix, introsort_replay, keyed_kernels)


class _Counted(compiled.KernelGroup):
    """Counts the methods' questions (each one a dispatch that took the uncompiled path while not ready)."""

    asked = 0

    def ready(self, entries: int) -> bool:
        self.asked += 1
        return super().ready(entries)


def _held(name: str) -> tuple[_Counted, threading.Event]:
    """A group whose 'compile' lasts until the event is set."""
    release = threading.Event()
    return _Counted(name, lambda: release.wait(30) or None), release


def test_ready_answers_at_once_and_starts_the_compile(monkeypatch):
    monkeypatch.delenv(compiled.WAIT_ENV, raising=False)
    group, release = _held("held")
    assert group.ready(compiled.START_ENTRIES - 1) is False  # too small a tensor to start the compile
    assert group._thread is None
    assert group.ready(compiled.START_ENTRIES) is False  # a wait here would last 30 s: the test's duration says not
    assert group._thread is not None and group._thread.is_alive()
    assert group.ready(1) is False
    release.set()
    assert group.wait() is True
    assert group.ready(1) is True
    assert group.error is None


def test_a_failed_compile_leaves_the_uncompiled_path_in_use(monkeypatch):
    monkeypatch.delenv(compiled.WAIT_ENV, raising=False)

    def broken() -> None:
        raise RuntimeError("no compiler here")

    group = compiled.KernelGroup("broken", broken)
    group.ready(compiled.START_ENTRIES)
    assert group.wait() is False
    assert group.ready(compiled.START_ENTRIES) is False
    assert isinstance(group.error, RuntimeError)


def test_wait_mode_waits_for_the_compile(monkeypatch):
    monkeypatch.setenv(compiled.WAIT_ENV, "wait")
    done = []
    group = compiled.KernelGroup("slow", lambda: done.append(1))
    assert group.ready(1) is True
    assert done == [1]


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_a_merge_does_not_wait_for_compiles_and_writes_the_compiled_bytes(tiny_models, tmp_path, monkeypatch, method):
    from mergesmith import merge
    from mergesmith.engine.execution import kernel_warmup
    from mergesmith.kernels import sort_select
    from tests.helpers import read_state_dict

    # these models' tensors are smaller than the bounds
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 256)
    monkeypatch.setattr(compiled, "START_ENTRIES", 256)
    monkeypatch.setattr(kernel_warmup, "START_ENTRIES", 256)
    base = tiny_models("llama", seed=1)
    config = {
        "merge_method": method,
        "base_model": str(base),
        "models": [
            {"model": str(tiny_models.derive(base, seed=s, scale=0.01)), "parameters": {"density": 0.5, "weight": 0.5}}
            for s in (2, 3)
        ],
        "parameters": {"normalize": True},
        "dtype": "bfloat16",
    }
    assert all(module.warm() for module in GROUPS)
    merge(config, tmp_path / "compiled", random_seed=7)

    monkeypatch.delenv(compiled.WAIT_ENV, raising=False)
    held = {module: _held(module.__name__) for module in GROUPS}
    for module, (group, _) in held.items():
        monkeypatch.setattr(module, "KERNELS", group)
    merge(config, tmp_path / "uncompiled", random_seed=7)
    # the merge asked for the groups it uses and finished while they were still compiling
    used = [bf16_mix, introsort_replay] if method == "ties" else [keyed_kernels]
    for module in used:
        group, _ = held[module]
        assert group.asked > 0, module.__name__
        assert group._thread is not None and group._thread.is_alive()
        assert not group.ready(1)
    for group, release in held.values():
        release.set()
        group.wait()

    a, b = read_state_dict(tmp_path / "compiled"), read_state_dict(tmp_path / "uncompiled")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert a[name].view(-1).view(dtype=_int_of(a[name])).equal(b[name].view(-1).view(dtype=_int_of(b[name]))), name


def _int_of(t):
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def test_the_executor_starts_what_each_method_announces(monkeypatch):
    """kernel_warmup names no method: it starts the groups each recipe's spec announces (MethodSpec.warm_up), once
    each, only for tensors large enough to pay for a compile."""
    from mergesmith.engine.execution import kernel_warmup
    from mergesmith.engine.plan import TensorRecipe
    from mergesmith.methods import MethodSpec, registry

    own = compiled.KernelGroup("own", lambda: None)
    asked = []

    def warm_up(params, seeded):
        asked.append((params, seeded))
        return [own]

    spec = MethodSpec(name="announcing", merge=lambda inputs: inputs.tensors[0], warm_up=warm_up)
    monkeypatch.setitem(registry._REGISTRY, "announcing", spec)

    def recipe(method, entries, seed=None):
        name = f"{method}.{entries}"
        return TensorRecipe(name, (entries,), "bfloat16", "merge", (), method, 0, (), (("x", 1),), seed)

    big, small = compiled.START_ENTRIES, compiled.START_ENTRIES - 1
    assert kernel_warmup.kernel_groups([recipe("announcing", small)]) == [] and asked == []
    assert kernel_warmup.kernel_groups([recipe("announcing", big, 3), recipe("announcing", big)]) == [own]
    assert asked == [({"x": 1}, True), ({"x": 1}, False)]
    # the task-vector family's announcements: what its merges call
    assert kernel_warmup.kernel_groups([recipe("ties", big)]) == [bf16_mix.KERNELS, introsort_replay.KERNELS]
    assert kernel_warmup.kernel_groups([recipe("dare_ties", big, 3)]) == [keyed_kernels.KERNELS]
    assert kernel_warmup.kernel_groups([recipe("dare_ties", big)]) == [bf16_mix.KERNELS]
    assert kernel_warmup.kernel_groups([recipe("linear", big), recipe("sce", big)]) == [weighted_sum.KERNELS]
    assert kernel_warmup.kernel_groups([recipe("sce", big)]) == []


def test_numba_is_imported_only_when_a_group_starts(tmp_path, tiny_models):
    """numba's import (0.16 s warm, 0.5 s cold) stays off the way to a merge's first read: importing the engine and
    the method registry does not import it, nor does a whole merge of small models, which starts no compile; a
    group's start does, in its own thread. In a fresh process, without the suite's MERGESMITH_KERNELS=wait."""
    import os
    import subprocess
    import sys

    base = tiny_models("llama", seed=1)
    config = tmp_path / "linear.yml"
    config.write_text(
        f"merge_method: linear\nmodels:\n- model: {base}\n  parameters: {{weight: 0.5}}\n"
        f"- model: {tiny_models.derive(base, seed=2)}\n  parameters: {{weight: 0.5}}\ndtype: bfloat16\n"
    )
    script = (
        "import sys\n"
        "from mergesmith.kernels import compiled, weighted_sum\n"
        "import mergesmith.engine.run, mergesmith.methods\n"
        "assert 'numba' not in sys.modules, 'imported with the engine'\n"
        "from mergesmith.cli import main\n"
        f"sys.argv = ['mergesmith', 'merge', {str(config)!r}, {str(tmp_path / 'out')!r}]\n"
        "try:\n    main()\nexcept SystemExit as done:\n    assert not done.code, done.code\n"
        "assert 'numba' not in sys.modules, 'imported by a merge of small models'\n"
        "assert weighted_sum.KERNELS.wait() and compiled.loaded() and 'numba' in sys.modules\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != compiled.WAIT_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert (tmp_path / "out" / "config.json").exists()


def test_a_group_told_to_wait_for_its_load_waits_once_and_at_most_the_limit(monkeypatch):
    """wait_for_load: where the loops are on disk, uses wait for the group (a load); a 'load' that outlasts
    LOAD_WAIT_SECONDS is a compile after all: that use goes on uncompiled, and no later one waits."""
    monkeypatch.delenv(compiled.WAIT_ENV, raising=False)
    quick = compiled.KernelGroup("quick", lambda: threading.Event().wait(0.2) and None)
    monkeypatch.setattr(quick, "cached", lambda: True)
    assert quick.wait_for_load() is True
    assert quick.ready(compiled.START_ENTRIES) is True  # waited the 0.2 s
    monkeypatch.setattr(compiled, "LOAD_WAIT_SECONDS", 0.1)
    group, release = _held("slow")
    monkeypatch.setattr(group, "cached", lambda: True)
    assert group.wait_for_load() is True
    assert group.ready(compiled.START_ENTRIES) is False  # waited 0.1 s, then the uncompiled path
    assert group._wait_for_load is False
    release.set()
    assert group.wait() is True
    cold = compiled.KernelGroup("cold", lambda: None)
    monkeypatch.setattr(cold, "cached", lambda: False)
    assert cold.wait_for_load() is False  # not cached: a compile, never waited for


def test_a_cache_index_counts_only_where_it_is_newer_than_its_source(tmp_path, monkeypatch):
    """_cache_index_current reads numba's index file name and place from the function alone (no numba import):
    beside the source in __pycache__, or under NUMBA_CACHE_DIR; older than the source, it is stale."""
    import os
    import sys

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    source = tmp_path / "loops.py"
    source.write_text("def add(a, b):\n    return a + b\n")
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    add = namespace["add"]
    index = tmp_path / "__pycache__" / f"loops.add-1.py{sys.version_info[0]}{sys.version_info[1]}{sys.abiflags}.nbi"
    assert compiled._cache_index_current(add) is False
    index.parent.mkdir()
    index.write_bytes(b"")
    os.utime(source, (1_000_000, 1_000_000))
    assert compiled._cache_index_current(add) is True
    os.utime(source, None)  # edited after the cache was written
    os.utime(index, (1_000_000, 1_000_000))
    assert compiled._cache_index_current(add) is False
    index.unlink()
    elsewhere = tmp_path / "numba-cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(elsewhere))
    import hashlib

    mirrored = elsewhere / f"{tmp_path.name}_{hashlib.sha1(str(tmp_path).encode()).hexdigest()}" / index.name
    mirrored.parent.mkdir(parents=True)
    mirrored.write_bytes(b"")
    assert compiled._cache_index_current(add) is True


def test_a_large_merge_waits_for_the_groups_numbas_cache_holds(monkeypatch):
    """The executor tells a group to wait for its load where the merge's tensors using it reach LOAD_WAIT_ENTRIES,
    not for a smaller merge."""
    from mergesmith.engine.execution import local_executor
    from mergesmith.engine.plan import TensorRecipe

    told: list[str] = []
    started: list[str] = []

    class _Group(compiled.KernelGroup):
        def wait_for_load(self) -> bool:
            told.append(self.name)
            return True

        def start(self) -> None:
            started.append(self.name)

    group = _Group("group", lambda: None)
    monkeypatch.setattr(local_executor, "kernel_groups", lambda recipes: [group])
    monkeypatch.setattr(local_executor, "recipes_using", lambda recipes, g: recipes)
    monkeypatch.setattr(local_executor, "LOAD_WAIT_ENTRIES", 3 * compiled.START_ENTRIES)

    class _Executor:
        device = __import__("torch").device("cpu")
        _kernel_groups: list = []

    def recipe(entries: int) -> TensorRecipe:
        return TensorRecipe(f"t{entries}", (entries,), "bfloat16", "merge", (), "dare_ties", 0, (), (), 3)

    executor = _Executor()
    local_executor.LocalExecutor._warm_kernels(executor, [recipe(compiled.START_ENTRIES)] * 2)
    assert told == [] and started == ["group"]
    local_executor.LocalExecutor._warm_kernels(executor, [recipe(compiled.START_ENTRIES)] * 3)
    assert told == ["group"] and started == ["group", "group"]
