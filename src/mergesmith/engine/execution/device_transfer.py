"""The pipelined CUDA path of compute.py: per-thread streams, pinned staging buffers, asynchronous copies.

Why: the first GPU path did `tensor.to(device=cuda, dtype=...)` from pageable memory on the default stream, which
every worker thread shares. A pageable host-to-device copy is staged by the driver and blocks the calling thread,
and one stream serialises every worker's copies and kernels behind each other, so reads, copies, arithmetic and
writes of different tensors did not overlap: on an H100 the GPU merge (linear, 1b bench) took longer than the CPU
one (issue 33). Here each worker thread gets

- its own CUDA stream (created the first time the thread computes on that device), made current for the thread
  while it copies and merges, so one worker's copies overlap another's kernels and a third's file I/O;
- a small pool of page-locked (pinned) staging buffers, reused from tensor to tensor: pinning memory is slow
  (a syscall and page-table work per call), so the pool grows each slot to the largest block it has seen (rounded
  up to a power of two) and never holds more than PINNED_BYTES_PER_THREAD; a block too large for that takes the
  old synchronous pageable copy instead;
- copies with non_blocking=True from and to those buffers, an event per staging slot so a slot is never
  overwritten while its copy is still in flight, and one stream synchronize before the output bytes go to the
  writer.

The output bytes are the old path's: an input is widened on the device only where that is exact (bf16 or fp16
to fp32 or fp64, fp32 to fp64: every value is representable); any other conversion (fp32 to bf16 rounding,
integers to floats) is done on the CPU into the staging buffer by the same `copy_` cast the old `.to()` made
(a blocking host-to-device `.to()` converts on the CPU), and the output is converted to its dtype on the device
before the copy back, as before. compute.py's CPU path does not come here (`lane_for` returns None off CUDA).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

PINNED_BYTES_PER_THREAD = 512 << 20
"""The most page-locked bytes one worker thread keeps for staging (inputs and the output of one block). A merge
of elementwise methods holds blocks of a few MB (blocks.BLOCK_ELEMENTS); only tensors merged whole need more, and
those past the cap take the pageable copy. Counted as held host memory by the executor."""

MIN_SLOT_BYTES = 1 << 20
"""The smallest staging buffer pinned (small tensors share its reuse instead of each being pinned)."""

_EXACT_WIDENING = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def staging_dtype(source: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype an input crosses the bus in: its own where widening it to `compute_dtype` on the device is exact
    (fewer bytes over PCIe, the same values), else `compute_dtype` (converted on the CPU, as the old path did)."""
    if source == compute_dtype or compute_dtype in _EXACT_WIDENING.get(source, ()):
        return source
    return compute_dtype


def slot_size(needed: int, cap: int) -> int:
    """Bytes to pin for a slot that must hold `needed`: the next power of two from MIN_SLOT_BYTES, at most `cap`
    (0 when `needed` is over the cap: that block is not staged)."""
    if needed > cap:
        return 0
    size = MIN_SLOT_BYTES
    while size < needed:
        size *= 2
    return min(size, cap)


def _pin(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass
class _Slot:
    buffer: torch.Tensor
    fence: Any = None  # an event recorded after the last copy from or to the buffer (None: nothing in flight)


@dataclass
class PinnedPool:
    """One thread's staging buffers, by slot (an input's position in its recipe, or the output's): each grown to the
    largest block seen, the whole pool at most `cap` bytes. `pin(nbytes)` allocates one (page-locked by default;
    tests pass a plain allocator to exercise the sizing on the CPU)."""

    cap: int = PINNED_BYTES_PER_THREAD
    pin: Callable[[int], torch.Tensor] = _pin
    slots: dict[Any, _Slot] = field(default_factory=dict)
    pinned_calls: int = 0  # how many buffers were pinned: a statistic for tests

    @property
    def held(self) -> int:
        return sum(slot.buffer.numel() for slot in self.slots.values())

    def take(self, key: Any, nbytes: int) -> torch.Tensor | None:
        """A staging buffer of at least `nbytes` for slot `key`, its previous copy finished (None: over the cap,
        copy without staging). A slot grows by pinning a larger buffer (the old one is dropped once unused)."""
        slot = self.slots.get(key)
        if slot is not None and slot.fence is not None:
            slot.fence.synchronize()  # the copy that used it last must have read (or written) it
            slot.fence = None
        if slot is not None and slot.buffer.numel() >= nbytes:
            return slot.buffer[:nbytes]
        others = self.held - (slot.buffer.numel() if slot is not None else 0)
        size = slot_size(nbytes, self.cap - others)
        if size == 0:
            return None
        if slot is not None:
            del self.slots[key]
        self.slots[key] = _Slot(self.pin(size))
        self.pinned_calls += 1
        return self.slots[key].buffer[:nbytes]

    def fence(self, key: Any, event: Any) -> None:
        """Record that a copy from or to slot `key` is in flight until `event` completes."""
        if key in self.slots:
            self.slots[key].fence = event


OUTPUT_SLOT = "output"


class DeviceLane:
    """One worker thread's way to one CUDA device: its stream and its staging buffers."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = pool or PinnedPool()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make this lane's stream the thread's current one: the copies, the method's kernels and its allocations
        all go on it. It first waits for what the thread queued on its previous stream (a two-pass method's totals,
        finished outside the lane, are read by the blocks merged in it)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def settle(self) -> None:
        """Wait for everything queued on the stream (a totals pass's state is next used outside the lane)."""
        self.stream.synchronize()

    def to_device(self, tensor: torch.Tensor, compute_dtype: torch.dtype, slot: Any) -> torch.Tensor:
        """`tensor.to(device, compute_dtype)` with the same values, through a pinned buffer and asynchronously."""
        wire = staging_dtype(tensor.dtype, compute_dtype) if tensor.is_floating_point() else compute_dtype
        buffer = self.pool.take(slot, tensor.numel() * wire.itemsize)
        if buffer is None:  # too large to stage: the old synchronous copy
            return tensor.to(device=self.device, dtype=compute_dtype)
        staged = buffer.view(wire).view(tensor.shape)
        staged.copy_(tensor)  # the CPU cast where `wire` is the compute dtype: the old path's conversion
        moved = staged.to(self.device, non_blocking=True)
        self.pool.fence(slot, _recorded(self.stream))
        return moved if wire == compute_dtype else moved.to(compute_dtype)

    def to_host(self, tensor: torch.Tensor, dtype: torch.dtype, lend: bool) -> torch.Tensor:
        """`tensor.to(dtype).cpu()`: converted on the device (as before), copied into a pinned buffer, the stream
        synchronized. `lend`: the caller is done with it before this thread's next block (the executor's writer
        copies the bytes out), so the pinned buffer itself is returned; else a copy of it."""
        converted = tensor.to(dtype=dtype)
        nbytes = converted.numel() * converted.element_size()
        buffer = self.pool.take(OUTPUT_SLOT, nbytes)
        if buffer is None:
            return converted.cpu()
        host = buffer.view(dtype).view(converted.shape)
        host.copy_(converted, non_blocking=True)
        self.stream.synchronize()
        return host if lend else host.clone()


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


_lanes = threading.local()


def lane_for(device: torch.device) -> DeviceLane | None:
    """This thread's lane to `device` (made on first use), or None off CUDA: the caller's plain path."""
    if device.type != "cuda":
        return None
    lanes: dict[torch.device, DeviceLane] | None = getattr(_lanes, "by_device", None)
    if lanes is None:
        lanes = _lanes.by_device = {}
    lane = lanes.get(device)
    if lane is None:
        lane = lanes[device] = DeviceLane(device)
    return lane
