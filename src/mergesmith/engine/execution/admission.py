"""Admission: which recipes may run now, under the memory budget and the memory this process really has.

The local executor admits a recipe only while the estimated bytes in flight stay under the budget (one that
alone exceeds it runs by itself), so peak memory depends on the largest tensors in flight, never on shard or
model size; with a memory watch it also admits less when another process takes memory, and stops with a
one-line MemoryShortage instead of an out-of-memory kill. On CUDA a second budget counts the device bytes in
flight (DeviceBudget): a recipe is admitted only when it fits both.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...errors import MemoryShortage
from ...runtime.memory_limits import MemoryWatch
from ...sizes import human_size

ADMISSION_WINDOW = 16
"""How far past a recipe that does not fit the budget the executor looks for one that does (so a thread
is not idle while, say, lm_head waits for embed_tokens to finish); after this many recipes have gone past
it, the waiting one is protected: a recipe still passes it only when it leaves room for it (`leaves_room`),
so that it is admitted, at the latest, when the largest item in flight finishes."""


def leaves_room(limit: int | None, running: list[int], cost: int, head: int) -> bool:
    """Whether admitting `cost` beside `running` (the items in flight) still lets `head` in once the largest of
    them (or `cost` itself, if larger) has finished.

    Why this rule for a recipe that has waited long enough: it must not wait for work admitted after it, but
    blocking every other recipe until it fits left a thread idle for as long as the item it waits for ran (the
    1b TIES merge: the other core idle ~1.3 s while lm_head's selection finished, before embed_tokens could start).
    What it waits for is in flight already; a recipe that passes it without taking the room it will need once
    that finishes costs it nothing."""
    if limit is None:
        return True
    total = sum(running) + cost
    return total - max([*running, cost]) + head <= limit


class DeviceBudget:
    """Device (GPU) bytes in flight against a limit (runtime/device_memory.py: --max-gpu-memory, else the
    device's free memory less a margin). Like the host budget, a lone item is admitted whatever its size: one
    that alone exceeds the limit was refused at plan time (planning/device_memory.py), unless the device's
    free memory shrank since."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running: list[int] = []  # the device cost of each item in flight
        self.peak = 0  # the most device bytes ever admitted at once

    @property
    def in_flight(self) -> int:
        return sum(self.running)

    def fits(self, cost: int) -> bool:
        return self.in_flight == 0 or self.in_flight + cost <= self.limit


class MemoryBudget:
    """Admits work while the bytes in flight fit; an oversized item waits until it is alone.

    With a `watch` (memory_limits.MemoryWatch), the bytes in flight must also fit what this process may
    really use now (its cgroup's limit, the system's available memory) less `held` (the input feed's
    buffers): when another process takes memory, less work is admitted; when even a lone item no
    longer fits, `acquire_first` raises MemoryShortage instead of letting the kernel kill the merge."""

    def __init__(self, limit: int | None, watch: MemoryWatch | None = None, held: int = 0) -> None:
        self.limit = limit
        self.watch = watch
        self.held_bytes = held
        # what of `held` is not yet in the process's memory use (which the watch's samples already count):
        # the input feed's pool tells; None counts all of `held`
        self.held_unmapped: Callable[[], int] | None = None
        # bytes the workers keep between recipes (sort_select's kept ids), counted whole in `held`
        self.kept_bytes = 0
        self.running: list[int] = []  # the cost of each item in flight (leaves_room)
        self.lent: list[int] = []  # bytes lent to items already running (`lend`), until they `repay` them
        self.peak = 0  # the most bytes ever admitted at once: a statistic for tests and reports
        self.device: DeviceBudget | None = None  # set by the executor on CUDA: device bytes admitted beside
        # `limit` is the executor's automatic budget, not the user's --max-memory: a scheduling device that keeps the
        # giants taking turns, which `lend` may go beyond where the machine has the room
        self.automatic = False
        self._cond = threading.Condition()

    @property
    def in_flight(self) -> int:
        """The bytes of the items in flight and of what was lent to them."""
        return sum(self.running) + sum(self.lent)

    def _bounded(self) -> list[int]:
        """The bytes in flight that `limit` bounds, item by item: all of them under a user's --max-memory; under an
        automatic budget only the items' own costs, not their loans.

        Why: the automatic budget is a scheduling device that keeps the largest tensors taking turns (see
        `automatic`), and `lend` may go past it where the machine has the room. Counted against it, a loan kept
        every other item out: the 1b TIES merge's selection over its 65.5 M-entry output matrix borrows 262 MB of
        ids, which left no room for a 176 MB layer tensor beside it, and the other worker waited 0.7 s, twice (once
        for the embedding; `python bench/recipe_trace.py --cold -- CONFIG OUT` prints each recipe's start and end). The
        merge's wall time did not move measurably (11.8-12.0 s against 11.4-11.9 s, two alternating cold runs):
        the work those waits delayed is CPU-bound, and the cores were busy to the end either way. The room the
        memory watch sees still counts every lent byte (`fits`)."""
        return self.running if self.automatic else self.running + self.lent

    @property
    def held(self) -> int:
        """Bytes set aside beside the work in flight that are not counted in the watch's samples yet (the workers'
        kept bytes always: once used they are counted twice, a small overestimate)."""
        feed = self.held_bytes if self.held_unmapped is None else min(self.held_bytes, self.held_unmapped())
        return feed + self.kept_bytes

    def room(self) -> int | None:
        """Bytes the work in flight may occupy now by the memory watch (None: not watched)."""
        return None if self.watch is None else max(0, self.watch.capacity() - self.held)

    def _limit(self) -> int | None:
        limit, room = self.limit, self.room()
        if room is not None:
            limit = room if limit is None else min(limit, room)
        return limit

    def fits(self, cost: int) -> bool:
        if self.in_flight == 0:
            return True
        room = self.room()
        if room is not None and self.in_flight + cost > room:
            return False
        return self.limit is None or sum(self._bounded()) + cost <= self.limit

    def acquire_first(
        self, costs: list[int], stop: threading.Event, device_costs: list[int] | None = None, protect_head: bool = False
    ) -> int | None:
        """Admit the first of `costs` that fits, waiting until one does; its position, or None when stopped.

        `device_costs` (with a `device` budget): each item's device bytes, which must fit that budget too.
        `protect_head`: the first item has waited long enough (ADMISSION_WINDOW): another passes it only where it
        leaves room for it on the host and on the device (leaves_room)."""
        device = self.device if device_costs is not None else None
        with self._cond:
            while True:
                for position, cost in enumerate(costs):
                    on_device = device_costs[position] if device is not None and device_costs is not None else 0
                    if not (self.fits(cost) and (device is None or device.fits(on_device))):
                        continue
                    if position and protect_head and not self._leaves_room(costs, device_costs, position):
                        continue
                    if self.in_flight == 0 and self.watch is not None:
                        self._check_alone(cost)
                    self.running.append(cost)
                    self.peak = max(self.peak, self.in_flight)
                    if device is not None:
                        device.running.append(on_device)
                        device.peak = max(device.peak, device.in_flight)
                    return position
                if stop.is_set():
                    return None
                self._cond.wait(0.2)

    def _check_alone(self, cost: int) -> None:
        """A lone item runs even over `limit` (a budget, not the machine); but not over the memory there is."""
        assert self.watch is not None
        # sampled afresh, not the watch's last figure: memory may have gone since (the one case where a
        # stale figure would admit a tensor into an out-of-memory kill)
        if self.watch.wait_for(cost + self.held):
            return
        room = self.room() or 0
        raise MemoryShortage(
            f"needs {human_size(cost, 2)} of working memory, only {human_size(room, 2)} is free for it "
            f"(this process may use {self.watch.last.describe()})",
            needed=cost,
            available=room,
        )

    def _leaves_room(self, costs: list[int], device_costs: list[int] | None, position: int) -> bool:
        """Whether item `position` leaves room for item 0 on the host and, with device costs, on the device."""
        if not leaves_room(self._limit(), self._bounded(), costs[position], costs[0]):
            return False
        if self.device is None or device_costs is None:
            return True
        return leaves_room(self.device.limit, self.device.running, device_costs[position], device_costs[0])

    def lend(self, nbytes: int) -> bool:
        """Count `nbytes` more in flight for a recipe already running, if they fit now (never waits): within the
        user's --max-memory where one was given, else within what the memory watch says this process may use (an
        automatic budget is no promise to the user; the machine's memory is the bound then). Give them back with
        `repay(nbytes)`. A kernel that can go faster with more memory asks (sort_select's replay by ids)."""
        with self._cond:
            room = self.room()
            # unwatched, an automatic budget is all that is known of the memory: stay within it then
            limit = None if self.automatic and room is not None else self.limit
            after = self.in_flight + nbytes
            # the watch samples now and then: an eighth of the room stays unlent for what it has not seen yet
            if (limit is not None and after > limit) or (room is not None and after > room - room // 8):
                return False
            self.lent.append(nbytes)
            self.peak = max(self.peak, self.in_flight)
            return True

    def repay(self, nbytes: int) -> None:
        """Give back bytes `lend` lent."""
        with self._cond:
            self.lent.remove(nbytes)
            self._cond.notify_all()

    def release(self, cost: int, device_cost: int = 0) -> None:
        with self._cond:
            self.running.remove(cost)
            if self.device is not None and device_cost in self.device.running:  # 0 where none was admitted
                self.device.running.remove(device_cost)
            self._cond.notify_all()
