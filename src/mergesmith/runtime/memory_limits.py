"""How much memory this process may really use: the cgroup's limit and the memory available now.

A merge in a container (Docker, Kubernetes, Colab) sees the machine's total memory in /proc/meminfo,
but the kernel kills it at its cgroup's limit, far below that. So the room for work in flight is the
smallest of:
- the system's available memory (MemAvailable, via psutil), and
- for the process's memory cgroup and each of its ancestors (v2 `memory.max`, v1
  `memory.limit_in_bytes`), the limit minus what the group uses now. Clean file pages (the page
  cache of the inputs the merge memory-maps, the written output) are charged to the group too, but
  the kernel reclaims them before it kills anyone, so the file LRU lists in `memory.stat` are not
  counted as used.

The cgroup directory comes from /proc/self/cgroup (the process's path in each hierarchy) and
/proc/self/mountinfo (where that hierarchy is mounted and which of its paths the mount shows),
because inside a container the mount's root is the container's own group, not the host's root.

`MemoryWatch` samples that room a few times a second during a merge. The executor's admission rule
(engine/execution/admission.MemoryBudget) reads it: when another process eats into the room, fewer tensors are
admitted; when even one tensor's working set no longer fits, the merge stops (MemoryShortage)
between tensors, where a rerun resumes. Written by hand because no maintained library reads cgroup
limits (psutil reports the machine's memory only).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..sizes import human_size

RESERVE_BYTES = 64 << 20
"""Kept free beyond the tensors' working sets: Python objects, writer buffers and allocator slack grow
during a merge without being counted in any recipe's estimate."""
SAMPLE_INTERVAL_S = 0.5
FRESH_S = 0.25
"""A lone tensor is admitted on a sample at most this old (else the watch samples again first): one sample
costs 1-4 ms here (the cgroup's files are read through the kernel), too much to take per tensor."""
SHORTAGE_GRACE_S = 2.0
"""How long a tensor that does not fit even alone waits for memory to come back (another process
finishing, freed heap going back to the OS) before the merge stops."""
_UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63-1


@dataclass(frozen=True)
class CgroupMemory:
    """The binding memory limit among the process's cgroup and its ancestors."""

    path: Path  # the group whose limit leaves the least room
    limit: int
    used: int  # usage without reclaimable file pages
    version: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class MemoryRoom:
    """What this process may still allocate now, and where the figure comes from."""

    available: int
    system_available: int
    system_total: int
    cgroup: CgroupMemory | None

    def describe(self) -> str:
        """One phrase: `1.20 GB (cgroup limit 2.00 GB, 0.80 GB used; system available 20.1 GB)`."""
        parts = []
        if self.cgroup is not None:
            parts.append(
                f"cgroup v{self.cgroup.version} limit {human_size(self.cgroup.limit, 2)}, "
                f"{human_size(self.cgroup.used, 2)} used"
            )
        parts.append(f"system available {human_size(self.system_available, 2)} of {human_size(self.system_total, 2)}")
        return f"{human_size(self.available, 2)} ({'; '.join(parts)})"



def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _stat_value(text: str | None, *keys: str) -> int:
    total = 0
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name in keys:
            try:
                total += int(value)
            except ValueError:
                pass
    return total


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 1 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(tail[2].split(",")) if len(tail) > 2 else set()
        root, point = (f.replace("\\040", " ") for f in (fields[3], fields[4]))
        out.append((tail[0], root, point, options))
    return out


@functools.lru_cache(maxsize=8)
def cgroup_dirs(proc: Path = Path("/proc/self")) -> list[tuple[int, Path, Path]]:
    """(version, the process's group directory, the hierarchy's mount point) for each hierarchy with a
    memory controller this process can see; v1 first (when the memory controller is on v1, v2 has none).

    Found once per process (about 5 ms; the watchdog samples several times a second): a process is
    hardly ever moved to another group while it runs."""
    cgroups, mountinfo = _read(proc / "cgroup"), _read(proc / "mountinfo")
    if not cgroups or not mountinfo:
        return []
    mounts = _mounts(mountinfo)
    found: list[tuple[int, Path, Path]] = []
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, path = parts
        version = 2 if controllers == "" else 1
        if version == 1 and "memory" not in controllers.split(","):
            continue
        for fstype, root, point, options in mounts:
            if (version == 2) != (fstype == "cgroup2") or (version == 1 and "memory" not in options):
                continue
            relative = os.path.relpath(path, root) if path == root or path.startswith(root.rstrip("/") + "/") else "."
            group = Path(point) / relative if relative != "." else Path(point)
            if not group.is_dir():
                group = Path(point)  # a namespaced view that hides the path: the mount shows our group
            found.append((version, group.resolve(), Path(point).resolve()))
            break
    return sorted(found, key=lambda f: f[0])


def _limit_and_used(version: int, group: Path) -> tuple[int, int] | None:
    """(limit, used without reclaimable file pages) of one group, None where it has no limit."""
    if version == 2:
        raw, usage_file, keys = _read(group / "memory.max"), "memory.current", ("active_file", "inactive_file")
    else:
        raw, usage_file, keys = (
            _read(group / "memory.limit_in_bytes"),
            "memory.usage_in_bytes",
            ("total_active_file", "total_inactive_file"),
        )
    if raw is None or raw.strip() in ("", "max"):
        return None
    try:
        limit = int(raw.strip())
        usage = int((_read(group / usage_file) or "0").strip() or 0)
    except ValueError:
        return None
    if limit >= _UNLIMITED:
        return None
    reclaimable = _stat_value(_read(group / "memory.stat"), *keys)
    return limit, max(0, usage - reclaimable)


def cgroup_memory(proc: Path = Path("/proc/self")) -> CgroupMemory | None:
    """The limit that leaves this process the least room, over its memory cgroups and their ancestors
    up to each hierarchy's mount point; None when no group limits memory."""
    best: CgroupMemory | None = None
    for version, group, top in cgroup_dirs(proc):
        current = group
        while True:
            found = _limit_and_used(version, current)
            if found is not None:
                candidate = CgroupMemory(current, found[0], found[1], version)
                if best is None or candidate.room < best.room:
                    best = candidate
            if current == top or current.parent == current or top not in current.parents:
                break
            current = current.parent
    return best


def memory_room() -> MemoryRoom:
    """What this process may allocate now: the smaller of the system's available memory and the
    tightest cgroup's limit minus its use."""
    system_available, system_total = _meminfo()
    group = cgroup_memory()
    available = system_available if group is None else min(system_available, group.room)
    return MemoryRoom(int(available), system_available, system_total, group)


def _meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes: /proc/meminfo read directly (a third of psutil's cost), psutil
    where there is none."""
    text = _read(Path("/proc/meminfo"))
    if text:
        values = {}
        for line in text.splitlines()[:8]:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                values[name] = int(rest.split()[0]) * 1024
        if len(values) == 2:
            return values["MemAvailable"], values["MemTotal"]
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def own_anonymous_bytes() -> int:
    """Resident anonymous memory of this process (RssAnon from /proc/self/statm: resident - shared)."""
    text = _read(Path("/proc/self/statm"))
    if text:
        fields = text.split()
        if len(fields) >= 3:
            return max(0, (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE"))
    import psutil

    return int(psutil.Process().memory_info().rss)


class MemoryWatch:
    """A background sampler of the memory this merge may still use for work in flight.

    `capacity()` is the room now plus what this process's anonymous memory grew since the watch
    started (tensors in flight and heap the allocator keeps are this merge's to reuse), minus a
    reserve. A drop in it that this process did not cause means someone else took memory.
    """

    def __init__(
        self,
        room: Callable[[], MemoryRoom] | None = None,
        own: Callable[[], int] | None = None,
        interval: float = SAMPLE_INTERVAL_S,
        reserve: int = RESERVE_BYTES,
    ) -> None:
        # looked up at each call, not bound here, so a test may stand in for the module's functions
        self._room_fn = room or (lambda: memory_room())
        self._own_fn = own or (lambda: own_anonymous_bytes())
        self.interval, self.reserve = interval, reserve
        self._own0 = self._own_fn()
        self.sampled_at = time.monotonic()
        self.last: MemoryRoom = self._room_fn()
        self._capacity = self._compute(self.last)
        self.lowest = self._capacity
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _compute(self, room: MemoryRoom) -> int:
        grown = max(0, self._own_fn() - self._own0)
        return max(0, room.available + grown - self.reserve)

    def sample(self) -> int:
        """Sample now; the capacity for work in flight, in bytes."""
        self.sampled_at = time.monotonic()
        self.last = self._room_fn()
        self._capacity = self._compute(self.last)
        self.lowest = min(self.lowest, self._capacity)
        return self._capacity

    def capacity(self) -> int:
        """The latest sampled capacity (no system calls)."""
        return self._capacity

    def start(self) -> MemoryWatch:
        self._thread = threading.Thread(target=self._run, name="mergesmith-memory-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample keeps the last figure; the merge goes on
                pass

    def wait_for(self, cost: int, grace: float | None = None) -> bool:
        """Whether `cost` bytes fit, sampling again for up to `grace` seconds (SHORTAGE_GRACE_S) before
        saying no."""
        grace = SHORTAGE_GRACE_S if grace is None else grace
        if time.monotonic() - self.sampled_at < FRESH_S and self._capacity >= cost:
            return True
        deadline = time.monotonic() + grace
        while True:
            if self.sample() >= cost:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.interval, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def memory_report(peak: int, largest: int, read_ahead: int = 0) -> dict[str, object]:
    """What `plan` shows about memory: what this process may use now (and where that figure comes from),
    and whether the estimate fits it. `fits` False with `runs` True: the merge runs with fewer tensors in
    flight than planned; `runs` False: not even the largest tensor's working set fits."""
    room = memory_room()
    usable = max(0, room.available - RESERVE_BYTES)
    fits = peak <= usable
    runs = largest + read_ahead <= usable
    if fits:
        warning = None
    elif runs:
        warning = (
            f"the peak memory estimate ({human_size(peak, 2)}) is more than this process may use now "
            f"({room.describe()}); "
            "the merge will run fewer tensors at once"
        )
    else:
        warning = (
            f"the largest tensor's working set ({human_size(largest, 2)} plus {human_size(read_ahead, 2)} of "
            "read-ahead buffers) is "
            f"more than this process may use now ({room.describe()}); the merge will stop at that tensor"
        )
    return {
        "available_bytes": room.available,
        "system_available_bytes": room.system_available,
        "system_total_bytes": room.system_total,
        "cgroup": None
        if room.cgroup is None
        else {
            "path": str(room.cgroup.path),
            "version": room.cgroup.version,
            "limit_bytes": room.cgroup.limit,
            "used_bytes": room.cgroup.used,
        },
        "description": room.describe(),
        "fits": fits,
        "runs": runs,
        "warning": warning,
    }
