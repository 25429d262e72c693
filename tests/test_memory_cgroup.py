"""Merges inside a real memory cgroup (as root; skipped with the reason where cgroups are not writable).

(a) A limit below the automatic budget (threads x working sets) but above one tensor's working set:
    the merge admits fewer tensors at once and finishes with the right bytes, where it would
    otherwise be killed by the kernel (`test_without_the_watch_the_same_limit_kills`).
(b) The limit is lowered mid-merge (another process "took" the memory): the merge stops between
    tensors with a one-line error saying what it needed and had, exit code 2; a rerun with the limit
    lifted finishes byte-identical to an unconstrained merge.

The merges run as subprocesses moved into a child cgroup (v1 `memory.limit_in_bytes` or v2
`memory.max`, beside the test process's own group) through `cgroup.procs`. A small driver script
pauses the merge at a tensor boundary for (b), so the limit changes at a known point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergesmith.io.journal import STATE_TOP
from mergesmith.runtime.memory_limits import cgroup_dirs

MB = 1 << 20
ROWS, COLS, TENSORS = 1024, 2048, 8
THREADS = 6

DRIVER = r"""
import sys, time
from pathlib import Path

mode, hand, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
from mergesmith.engine.execution import local_executor as executor

if mode == "nowatch":  # the executor as it was: no memory watch
    executor.MemoryBudget.room = lambda self: None
    executor.MemoryBudget._check_alone = lambda self, cost: None
if mode.startswith("pause"):  # stop at a tensor boundary until the test has changed the limit
    at = int(mode[5:])
    emit = executor.LocalExecutor._emit

    def paused(self, recipe):
        emit(self, recipe)
        if recipe is not None and self._done == at and not (hand / "go").exists():
            from mergesmith.runtime.memory_release import release_free_heap

            release_free_heap()
            (hand / "paused").write_text("")
            while not (hand / "go").exists():
                time.sleep(0.05)

    executor.LocalExecutor._emit = paused
if mode == "probe":
    import torch, mergesmith.cli, mergesmith.raw.merge  # what a merge has imported before it starts
    (hand / "ready").write_text("")
    time.sleep(60)
    sys.exit(0)
from mergesmith.cli import main

main(args)
"""


class Cgroup:
    """A child memory cgroup beside this process's own; removed at the end."""

    def __init__(self, version: int, path: Path) -> None:
        self.version, self.path = version, path

    def set_limit(self, limit: int | None) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        value = ("max" if self.version == 2 else "-1") if limit is None else str(limit)
        (self.path / name).write_text(value)

    def used(self) -> int:
        """Usage without reclaimable file pages (what the kernel cannot simply drop)."""
        usage = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        keys = ("active_file", "inactive_file") if self.version == 2 else ("total_active_file", "total_inactive_file")
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        return int((self.path / usage).read_text()) - sum(int(stat.get(k, 0)) for k in keys)

    def popen(self, args: list[str], **kw: Any) -> subprocess.Popen[str]:
        procs = self.path / "cgroup.procs"

        def enter() -> None:
            procs.write_text(str(os.getpid()))

        return subprocess.Popen(args, preexec_fn=enter, text=True, **kw)  # noqa: PLW1509 - the point of it


def _make_cgroup() -> Cgroup | str:
    """A writable child memory cgroup, or why there is none."""
    if os.geteuid() != 0:
        return "not root: cannot create cgroups"
    for version, group, _top in cgroup_dirs():
        if not os.access(group, os.W_OK):
            continue
        child = group / f"mergesmith-test-{os.getpid()}"
        try:
            child.mkdir(exist_ok=True)
        except OSError:
            continue
        limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
        if version == 2 and not (child / limit_file).exists():
            try:  # enable the memory controller for the children (refused if the group holds processes)
                (group / "cgroup.subtree_control").write_text("+memory")
            except OSError:
                pass
        if (child / limit_file).exists():
            if version == 2 and (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0")
            return Cgroup(version, child)
        child.rmdir()
    return "no writable memory cgroup (v1 memory.limit_in_bytes or v2 memory.max) here"


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    made = _make_cgroup()
    if isinstance(made, str):
        pytest.skip(made)
    yield made
    for _ in range(50):  # the group empties once its processes are reaped
        try:
            made.path.rmdir()
            break
        except OSError:
            time.sleep(0.1)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three bare state dicts of 1024x2048 float32 tensors, a TIES merge of them (not elementwise, so each
    tensor's working set is whole), the bytes of its unconstrained merge, and the driver script."""
    root = tmp_path_factory.mktemp("cgroup")
    generator = torch.Generator().manual_seed(5)
    base = {f"t{i}": torch.randn(ROWS, COLS, generator=generator) for i in range(TENSORS)}
    paths = {}
    for name, scale in (("base", 0.0), ("a", 0.02), ("b", 0.03)):
        state = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in base.items()}
        paths[name] = root / f"{name}.safetensors"
        save_file(state, str(paths[name]))
    config = root / "ties.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "ties",
                "base_model": str(paths["base"]),
                "models": [
                    {"model": str(paths["a"]), "parameters": {"weight": 0.6, "density": 0.5}},
                    {"model": str(paths["b"]), "parameters": {"weight": 0.4, "density": 0.7}},
                ],
                "dtype": "float32",
            }
        )
    )
    import mergesmith

    mergesmith.merge_raw(config, root / "ref", out_shard_size="20M", threads=2)
    from mergesmith.engine.planning.shared import MergeOptions, automatic_budget, recipe_memory
    from mergesmith.raw.merge import build_raw_plan

    plan, _checkpoints = build_raw_plan(config, MergeOptions(threads=THREADS))

    working = max(recipe_memory(r, "F32") for r in plan.recipes)
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    return {
        "config": config,
        "expected": _files(root / "ref"),
        "working": working,
        "automatic": automatic_budget([recipe_memory(r, "F32") for r in plan.recipes], THREADS),
        "driver": driver,
    }


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP}


def _args(case: dict[str, Any], mode: str, hand: Path, out: Path, threads: int) -> list[str]:
    merge = ["merge-raw", str(case["config"]), str(out), "--out-shard-size", "20M", "--threads", str(threads), "-q"]
    return [sys.executable, str(case["driver"]), mode, str(hand), *merge]


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the merge ended early ({proc.returncode}): {proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def _baseline(cgroup: Cgroup, case: dict[str, Any], hand: Path) -> int:
    """What a merge process holds before its first tensor: its imports, measured in the cgroup."""
    proc = cgroup.popen(_args(case, "probe", hand, hand / "unused", 1), env=_env(), stderr=subprocess.PIPE)
    try:
        _wait_for(hand / "ready", proc)
        return cgroup.used()
    finally:
        proc.kill()
        proc.wait()


def _limit_between(cgroup: Cgroup, case: dict[str, Any], tmp_path: Path) -> int:
    """A limit over the baseline by about two working sets: one tensor fits, the automatic budget does not."""
    if "baseline" not in case:  # measured once per module: a subprocess start costs seconds
        hand = tmp_path / "probe"
        hand.mkdir()
        case["baseline"] = _baseline(cgroup, case, hand)
    limit = case["baseline"] + 2 * case["working"] + 96 * MB
    assert case["working"] < limit < case["automatic"], (case["working"], limit, case["automatic"])
    return limit


def test_a_limit_below_the_automatic_budget_still_finishes(
    cgroup: Cgroup, case: dict[str, Any], tmp_path: Path
) -> None:
    cgroup.set_limit(_limit_between(cgroup, case, tmp_path))
    out = tmp_path / "out"
    proc = cgroup.popen(_args(case, "watch", tmp_path, out, THREADS), env=_env(), stderr=subprocess.PIPE)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert _files(out) == case["expected"]


def test_without_the_watch_the_same_limit_kills(cgroup: Cgroup, case: dict[str, Any], tmp_path: Path) -> None:
    """The control for (a): the executor without the memory watch, under the same limit, is killed by
    the kernel (so the test above tests the watch, not a limit that was never tight)."""
    cgroup.set_limit(_limit_between(cgroup, case, tmp_path))
    out = tmp_path / "out"
    proc = cgroup.popen(_args(case, "nowatch", tmp_path, out, THREADS), env=_env(), stderr=subprocess.PIPE)
    proc.communicate(timeout=300)
    assert proc.returncode == -9, f"exit {proc.returncode}: the limit never bit"


def test_a_limit_lowered_mid_merge_stops_cleanly_then_resumes(
    cgroup: Cgroup, case: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = cgroup.popen(_args(case, "pause3", tmp_path, out, 1), env=_env(), stderr=subprocess.PIPE)
    try:
        _wait_for(tmp_path / "paused", proc)
        os.sync()
        used = cgroup.used()
        for extra in (case["working"] // 4, case["working"] // 2, case["working"] * 3 // 4):
            try:  # the kernel refuses a limit it cannot reclaim down to; then a little more
                cgroup.set_limit(used + extra)
                break
            except OSError:
                continue
        else:
            pytest.fail("the kernel refused every lowered limit")
        time.sleep(0.6)  # past the watch's interval: the limit is in its samples before the merge goes on
        (tmp_path / "go").write_text("")
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: not enough memory"), err
    assert "'t3'" in lines[0] and "needs" in lines[0] and "MB" in lines[0] and "cgroup" in lines[0], lines[0]
    assert "3 of 8 tensors saved" in lines[0], lines[0]
    assert not (out / "model.safetensors.index.json").exists()

    cgroup.set_limit(None)
    proc = cgroup.popen(_args(case, "watch", tmp_path, out, 1), env=_env(), stderr=subprocess.PIPE)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert _files(out) == case["expected"]
