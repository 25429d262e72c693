"""Memory that knows its container, without needing one: cgroup files read from a fake tree, the
admission rule under a shrinking room, and a merge whose room runs out mid-way (a stand-in for another
process eating memory) stopping with one line and resuming byte-identical. The real cgroup tests are
in test_memory_cgroup.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.engine.execution.admission import MemoryBudget
from mergesmith.errors import MemoryShortage
from mergesmith.io.journal import STATE_TOP
from mergesmith.runtime import memory_limits
from mergesmith.runtime.memory_limits import CgroupMemory, MemoryRoom, MemoryWatch, cgroup_memory
from tests.helpers import assert_one_line_error, run_cli

MB = 1 << 20


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def _write(group: Path, **files: str) -> None:
    group.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (group / name.replace("__", ".")).write_text(text)


def test_cgroup_v2_limit_is_the_tightest_ancestor_and_ignores_file_pages(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    outer, inner = root / "kube", root / "kube" / "pod"
    _write(outer, memory__max=str(1000 * MB), memory__current=str(900 * MB), memory__stat="file 0\n")
    _write(
        inner,
        memory__max="max",
        memory__current=str(700 * MB),
        memory__stat=f"anon 1\nactive_file {200 * MB}\ninactive_file {100 * MB}\n",
    )
    mountinfo = f"30 25 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    proc = _fake_proc(tmp_path, "0::/kube/pod\n", mountinfo)
    found = cgroup_memory(proc)
    assert found is not None and found.version == 2
    assert found.path == outer.resolve() and found.limit == 1000 * MB and found.room == 100 * MB

    (outer / "memory.max").write_text("max")  # no limit anywhere: no cgroup figure
    assert cgroup_memory(proc) is None


def test_cgroup_v1_inside_a_container_namespace(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    # the mount shows the container's own group as its root; /proc/self/cgroup names the host path
    _write(
        mount,
        memory__limit_in_bytes=str(2000 * MB),
        memory__usage_in_bytes=str(1500 * MB),
        memory__stat=f"cache 1\ntotal_active_file {300 * MB}\ntotal_inactive_file {200 * MB}\n",
    )
    mountinfo = (
        f"40 30 0:33 /docker/abc {mount} rw,nosuid - cgroup cgroup rw,memory\n"
        f"41 30 0:34 /docker/abc {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu\n"
    )
    proc = _fake_proc(tmp_path, "5:cpu:/docker/abc\n4:memory:/docker/abc\n", mountinfo)
    found = cgroup_memory(proc)
    assert found == CgroupMemory(mount.resolve(), 2000 * MB, 1000 * MB, 1)
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "unlimited"
    assert cgroup_memory(proc) is None


class _FakeWatch(MemoryWatch):
    def __init__(self, capacity: int) -> None:
        self.value = capacity
        super().__init__(room=lambda: MemoryRoom(self.value, self.value, 10**12, None), own=lambda: 0, reserve=0)

    def wait_for(self, cost: int, grace: float | None = 0.0) -> bool:
        return super().wait_for(cost, grace=0.0)


def test_admission_follows_the_room_and_stops_when_one_item_does_not_fit() -> None:
    watch = _FakeWatch(300)
    budget = MemoryBudget(1000, watch)
    stop = threading.Event()
    assert budget.acquire_first([100], stop) == 0
    assert budget.acquire_first([100], stop) == 0
    watch.value = 250  # another process took memory: a third item no longer fits beside the two
    watch.sample()
    assert not budget.fits(100)
    budget.release(100)
    budget.release(100)
    with pytest.raises(MemoryShortage) as exc:
        budget.acquire_first([400], stop)  # alone and still too big for the room
    assert exc.value.needed == 400 and exc.value.available == 250
    assert "400 B" in str(exc.value) and "250 B" in str(exc.value)
    assert budget.acquire_first([200], stop) == 0  # a smaller one still runs


@pytest.fixture(scope="module")
def case(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("shortage")
    a, b = tiny_models("llama", seed=31), tiny_models("llama", seed=32)
    config = root / "merge.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [{"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {}}],
                "parameters": {"weight": 0.5},
                "dtype": "float32",
            }
        )
    )
    import mergesmith

    mergesmith.merge(config, root / "ref", out_shard_size="50K", threads=1)
    return config, {p.name: p.read_bytes() for p in sorted((root / "ref").iterdir()) if p.name != STATE_TOP}


def test_a_merge_stops_cleanly_when_memory_runs_out_and_resumes(
    case: tuple[Path, dict[str, bytes]], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, expected = case
    calls = {"n": 0}
    real = memory_limits.memory_room

    def shrinking() -> MemoryRoom:
        calls["n"] += 1  # after a few samples, someone else has taken all but 1 MB
        room = real()
        return room if calls["n"] < 12 else MemoryRoom(MB, MB, room.system_total, None)

    monkeypatch.setattr(memory_limits, "memory_room", shrinking)
    monkeypatch.setattr(memory_limits, "SHORTAGE_GRACE_S", 0.0)
    monkeypatch.setattr(memory_limits, "FRESH_S", 0.0)  # every lone admission samples: the count is the clock
    out = tmp_path / "out"
    code, _out, err = run_cli(capsys, "merge", config, out, "--out-shard-size", "50K", "--threads", "1")
    line = assert_one_line_error(code, err, "not enough memory", "needs", "rerun with more memory")
    assert "tensors saved" in line
    assert not (out / "config.json").exists()
    monkeypatch.setattr(memory_limits, "memory_room", real)
    code, stdout, err = run_cli(capsys, "merge", config, out, "--out-shard-size", "50K", "--threads", "1", "-q")
    assert code == 0, err
    assert "resumed" in stdout
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP} == expected


def test_lent_memory_stays_within_the_users_budget_and_the_room() -> None:
    """MemoryBudget.lend (sort_select's ids): within --max-memory where the user gave one; an automatic budget (the
    executor's scheduling device) may be exceeded up to the room the watch sees, and unwatched it is the bound."""
    stop = threading.Event()
    user = MemoryBudget(1000, _FakeWatch(5000))
    assert user.acquire_first([600], stop) == 0
    assert not user.lend(500)  # 1100 > the user's 1000
    assert user.lend(400) and user.in_flight == 1000
    assert not user.fits(1)  # under --max-memory a loan counts against admission too
    user.repay(400)
    assert user.in_flight == 600 and user.fits(400)

    automatic = MemoryBudget(1000, _FakeWatch(1600))
    automatic.automatic = True
    assert automatic.acquire_first([600], stop) == 0
    assert automatic.lend(800)  # over the automatic 1000, within the room of 1600 less its unlent eighth
    assert not automatic.lend(100)  # 1500 > 1400
    automatic.repay(800)

    unwatched = MemoryBudget(1000)
    unwatched.automatic = True
    assert unwatched.acquire_first([600], stop) == 0
    assert not unwatched.lend(500) and unwatched.lend(400)


def test_a_loan_keeps_no_item_out_of_an_automatic_budget_that_has_room() -> None:
    """Under the executor's automatic budget an item running with a loan (TIES' ids over the output matrix) leaves
    the others the room its own cost left them: the loan counts against the memory the watch sees, not against the
    scheduling limit. Before, the 1b TIES merge's other core idled while lm_head's selection held its ids."""
    stop = threading.Event()
    automatic = MemoryBudget(697, _FakeWatch(5000))
    automatic.automatic = True
    assert automatic.acquire_first([521], stop) == 0  # lm_head
    assert automatic.lend(262)  # its selection's ids
    assert automatic.in_flight == 783 and automatic.peak == 783
    assert automatic.acquire_first([176], stop) == 0  # a layer tensor beside it, as without the loan
    assert not automatic.fits(176)  # the scheduling limit itself still holds: 521 + 176 + 176 > 697
    tight = MemoryBudget(697, _FakeWatch(900))  # the room the watch sees bounds loans and items together
    tight.automatic = True
    assert tight.acquire_first([521], stop) == 0 and tight.lend(262)
    assert not tight.fits(176)  # 521 + 262 + 176 > 900
    tight.repay(262)
    assert tight.fits(176)
