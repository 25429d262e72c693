"""Reads input bytes around the page cache (O_DIRECT) into a few reused, aligned buffers.

Why: a merge reads every input byte once. Through a memory map (or a buffered read) each 4 KB of input
first becomes a freshly allocated page-cache page, then is faulted into the process, then unmapped
again; on a VM every fresh page also costs the hypervisor a fault on first touch. Measured on the 1 B
linear bench merge with a cold cache: 28 CPU-s (11 of them system time) against 17.5 CPU-s for the
same merge with the inputs already cached, and converting 2 GB of bf16 read through a map cost 1.3-2.7
CPU-s against 0.75 CPU-s read with O_DIRECT into one reused buffer. With O_DIRECT the disk writes
straight into memory the process already owns: no page-cache pages, no faults, no unmapping (and no
TLB shootdowns across the worker threads).

What is already in the page cache (inputs read moments ago, a rerun) is copied from there instead:
`mincore` tells which pages are resident without reading anything (a RWF_NOWAIT probe would start the
kernel's read-ahead into the cache, the very thing avoided here).

O_DIRECT needs offsets, lengths and buffer addresses aligned to the device's block, so a read covers the
aligned range around the requested bytes and the caller views the bytes inside it. Only on local
filesystems known to do O_DIRECT well (the same list and `MERGESMITH_DIRECT_IO` switch as the writer);
`direct_write.direct_io_supported` says whether a file qualifies, and a file whose filesystem refuses a direct read
(EINVAL) is read through the page cache from then on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from .direct_write import ALIGN, anonymous_buffer

IO_THREADS = 4
"""Reads in flight at once: a few MB requests reach this disk's full rate only at a queue depth of 4 or
more (about 2.2 GB/s, against 0.65 GB/s one at a time, measured with buffers of 4 KB pages; into huge-page buffers,
direct_write.anonymous_buffer's, 3.3-3.6 GB/s at a depth of 4 or 8 alike, bench/README.md, issue 33)."""

POOL_BYTES = 128 << 20
"""Read-ahead buffers of a merge's input feed: a fixed size, whatever the model (more, up to 256 MB, where the feed
keeps two-pass recipes' blocks between their passes: engine/execution/input_feed.py). Under a memory budget
(--max-memory) at most a quarter of it, never under MIN_POOL_BYTES (see pool_bytes)."""
MIN_POOL_BYTES = 16 << 20

UNCOUNTED_SPARE_BYTES = 32 << 20
"""Spare buffers a pool keeps beyond its limit for the reads it does not count (BufferPool.recycle): a worker's own
reads of blocks the feed has not reached, while the feed's read-ahead fills the pool. Enough for a few row blocks'
inputs; reused, their pages are not zeroed again by the kernel. At most a quarter of the pool's limit, which a user's
--max-memory sizes (pool_bytes): a small budget keeps few."""

SIZE_STEP = 1 << 18
"""Buffers of 1 MB or more are made in steps of 256 KB (smaller ones in powers of two), so that the few block sizes
of a model's tensors each find their buffers again instead of mapping fresh memory. Not whole MB: a row block of
blocks.BLOCK_ELEMENTS bf16 entries (2 MB, plus the alignment slack) took a 3 MB buffer, a third of the pool idle,
and of the room two-pass blocks are kept in between their passes (engine/execution/input_feed.py)."""


def pool_bytes(max_memory: int | None, wanted: int = POOL_BYTES) -> int:
    """The feed's buffer pool under a user's memory budget (None: none given): POOL_BYTES, or `wanted` where more
    (a pool that keeps two-pass blocks between passes, engine/execution/input_feed.py)."""
    wanted = max(POOL_BYTES, wanted)
    if max_memory is None:
        return wanted
    return max(MIN_POOL_BYTES, min(wanted, max_memory // 4))


def capacity_for(nbytes: int) -> int:
    """The buffer size a read of `nbytes` at any offset needs (its aligned span), rounded to its size class."""
    span = -(-nbytes // ALIGN) * ALIGN + ALIGN  # the aligned range around nbytes at any offset
    if span >= 1 << 20:
        return -(-span // SIZE_STEP) * SIZE_STEP
    return 1 << (span - 1).bit_length()


class BufferPool:
    """Aligned anonymous buffers in at most `limit` bytes, reused by size.

    `take_all` waits while the buffers asked for do not fit beside those in use, so a reader that runs
    ahead stalls instead of growing memory. Buffers that together exceed the whole pool (a large tensor
    read whole) are let in alone, once nothing else is in use; the spare buffers are unmapped then (the
    peak memory of a merge is at its largest tensors, and spares would only add to it), and so are the
    giant's own when given back.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._uncounted: dict[int, list[mmap.mmap]] = {}  # spares beyond `limit` (recycle), for `spares` only
        self._uncounted_bytes = 0
        self._cond = threading.Condition()
        self._closed = False

    def take_all(self, capacities: list[int], stop: threading.Event | None = None) -> list[mmap.mmap] | None:
        """Buffers of these capacities, all at once (None when `stop` is set or the pool is closed while
        waiting). All or nothing, so a caller never holds part of what it needs while waiting for the rest."""
        total = sum(capacities)
        with self._cond:
            while True:
                if self._closed or (stop is not None and stop.is_set()):
                    return None
                if self.in_use + total <= self.limit or self.in_use == 0:
                    if total > self.limit:  # a giant, alone: no spare can serve it, so none stays resident
                        self._drop_free(self._free_bytes)
                    self.in_use += total
                    return [self._reuse_or_map(c) for c in capacities]
                self._cond.wait(0.2)

    def adopt(self, nbytes: int) -> bool:
        """Count `nbytes` of buffers mapped elsewhere as the pool's, if they fit beside those in use now (never
        waits): given back, they join its spares like its own. The input feed keeps a block a worker read
        itself this way, within the pool's bound."""
        with self._cond:
            if self._closed or self.in_use + nbytes > self.limit:
                return False
            self.in_use += nbytes
            excess = self.in_use + self._free_bytes - self.limit
            if excess > 0:
                self._drop_free(excess)
            return True

    def _reuse_or_map(self, capacity: int) -> mmap.mmap:
        """A free buffer of this size, or a new one once spares of other sizes make room (holding the lock)."""
        spare = self._free_spare(capacity)
        if spare is not None:
            return spare
        excess = self.in_use + self._free_bytes - self.limit
        if excess > 0:
            self._drop_free(excess)
        return anonymous_buffer(capacity)

    def spares(self, capacities: list[int]) -> list[mmap.mmap]:
        """Buffers of these capacities for reads outside the pool's count (a worker that reads a block itself, ahead
        of the feed): spares where there are some, fresh ones for the rest. A fresh buffer's pages are zeroed by
        the kernel as the read first touches them (~0.1 ms a 2 MB huge page): on the 1b TIES bench merge, 717 such
        buffers (1.6 GB) were mapped fresh, and the page clearing of all reads was ~0.6 CPU-s. Hand them back
        with `recycle` (or `give`, once `adopt` counted them)."""
        with self._cond:
            found = [self._spare_of(c) for c in capacities]
        return [memory if memory is not None else anonymous_buffer(c) for c, memory in zip(capacities, found)]

    def _spare_of(self, capacity: int) -> mmap.mmap | None:
        """A spare of this size, an uncounted one first (holding the lock)."""
        found = self._uncounted.get(capacity)
        if found:
            self._uncounted_bytes -= capacity
            return found.pop()
        return self._free_spare(capacity)

    def _free_spare(self, capacity: int) -> mmap.mmap | None:
        """A spare of this size among those the pool counts, None where there is none (holding the lock)."""
        found = self._free.get(capacity)
        if not found:
            return None
        self._free_bytes -= capacity
        return found.pop()

    def _keep_within_limit(self, memory: mmap.mmap) -> bool:
        """Keep `memory` among the spares the pool counts where it has room for it beside those in use and its
        spares (holding the lock); whether it did."""
        capacity = len(memory)
        if self._closed or self.in_use + self._free_bytes + capacity > self.limit:
            return False
        self._free.setdefault(capacity, []).append(memory)
        self._free_bytes += capacity
        return True

    def recycle(self, memory: mmap.mmap) -> None:
        """Take back a buffer the pool did not count (from `spares`) as a spare: among its own where it has room
        beside those in use and its spares, else among a few uncounted ones (UNCOUNTED_SPARE_BYTES; the feed
        fills the pool while the workers that ran ahead of it read for themselves); unmapped otherwise."""
        capacity = len(memory)
        with self._cond:
            if self._keep_within_limit(memory):
                self._cond.notify_all()
            elif not self._closed and self._uncounted_bytes + capacity <= min(UNCOUNTED_SPARE_BYTES, self.limit // 4):
                self._uncounted.setdefault(capacity, []).append(memory)
                self._uncounted_bytes += capacity
            else:
                _unmap(memory)

    def _drop_free(self, needed: int) -> None:
        """Unmap free buffers until `needed` bytes are released (call holding the lock)."""
        for size in sorted(self._free, reverse=True):
            spares = self._free[size]
            while spares and needed > 0:
                _unmap(spares.pop())
                self._free_bytes -= size
                needed -= size

    def unmapped(self) -> int:
        """Bytes the pool may still map beyond what it holds now. What it holds is already in the process's
        memory use (and so in what a cgroup or the system reports as used); only this part is yet to come."""
        with self._cond:
            return max(0, self.limit - self.in_use - self._free_bytes)

    def give(self, memory: mmap.mmap) -> None:
        """Return a buffer `take_all` handed out."""
        capacity = len(memory)
        with self._cond:
            self.in_use -= capacity
            if not self._keep_within_limit(memory):
                _unmap(memory)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for kept in (self._free, self._uncounted):
                for spares in kept.values():
                    for memory in spares:
                        _unmap(memory)
                kept.clear()
            self._free_bytes = self._uncounted_bytes = 0
            self._cond.notify_all()


class ReadBuffer:
    """The bytes of one read, inside an aligned buffer; `release` hands the buffer back to the pool (once): as one it
    counts (`counted`: BufferPool.give) or as a spare it may keep (BufferPool.recycle)."""

    __slots__ = ("memory", "start", "length", "_pool", "_counted")

    def __init__(
        self, memory: mmap.mmap, start: int, length: int, pool: BufferPool | None, counted: bool = True
    ) -> None:
        self.memory = memory
        self.start = start
        self.length = length
        self._pool: BufferPool | None = pool
        self._counted = counted

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes as a tensor (a view: valid until `release`)."""
        count = self.length // dtype.itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.memory, dtype=dtype, count=count, offset=self.start).view(shape)

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            _hand_back(pool, self.memory, self._counted)


def _hand_back(pool: BufferPool, memory: mmap.mmap, counted: bool) -> None:
    """Give a buffer back to `pool`: one it counts, or one it may keep as a spare."""
    if counted:
        pool.give(memory)
    else:
        pool.recycle(memory)


class _File:
    """One input file's descriptors and residency map."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.buffered = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.buffered).st_size
        self.direct: int | None = None
        try:
            self.direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            self.direct = None
        self.refused = False  # the filesystem rejected a direct read (EINVAL): read buffered from then on
        self.view: mmap.mmap | None = None
        self.address = 0
        if self.size and _MINCORE is not None:
            self.view = mmap.mmap(self.buffered, 0, access=mmap.ACCESS_READ)
            self.address = np.frombuffer(self.view, dtype=np.uint8).ctypes.data

    def resident(self, offset: int, length: int) -> bool:
        """Whether every page of [offset, offset + length) is in the page cache (reads nothing).

        The first page is asked alone first: mincore costs ~4 us for one page and ~30 us for a 2.25 MB row block's
        576 (the kernel looks each one up in the file's page cache), and where the first page is not there (every
        read of a cold merge: 3,825 on the 1b dare_ties bench merge, ~0.1 CPU-s saved) the answer is no without
        asking about the rest."""
        if self.view is None or _MINCORE is None:
            return False
        page = mmap.PAGESIZE
        lo = offset // page * page
        hi = min(-(-(offset + length) // page) * page, -(-self.size // page) * page)
        if hi <= lo:
            return True
        return self._all_resident(lo, min(hi, lo + page)) and (hi - lo <= page or self._all_resident(lo, hi))

    def _all_resident(self, lo: int, hi: int) -> bool:
        """mincore over the pages [lo, hi) (page-aligned, inside the file's map): whether all are resident."""
        page = mmap.PAGESIZE
        pages = (hi - lo) // page
        vector = (ctypes.c_ubyte * pages)()
        if _MINCORE(ctypes.c_void_p(self.address + lo), ctypes.c_size_t(hi - lo), vector) != 0:
            return False
        return bool(np.all(np.frombuffer(vector, dtype=np.uint8) & 1))

    def close(self) -> None:
        for fd in (self.buffered, self.direct):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.direct = None
        self.buffered = -1
        if self.view is not None:
            try:
                self.view.close()
            except BufferError:  # a numpy view of it is still alive somewhere; unmapped when freed
                pass
            self.view = None


class DirectReader:
    """Reads byte ranges of input files into pooled buffers on a few I/O threads."""

    def __init__(self, pool: BufferPool, io_threads: int = IO_THREADS) -> None:
        self.pool = pool
        self._files: dict[Path, _File] = {}
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="merge-read")

    def submit(
        self, path: Path, offset: int, length: int, memory: mmap.mmap, pooled: bool, through_cache: bool = False
    ) -> Future[ReadBuffer]:
        """Start reading [offset, offset + length) of `path` into `memory` (at least `capacity_for(length)`
        bytes; `pooled`: the pool counts it, else it is a buffer of the caller's own, which the pool takes back on
        release as a spare where it has room: BufferPool.recycle). `through_cache`: read through the page cache
        (bytes that will be read again)."""
        return self._threads.submit(self._read, path, offset, length, memory, pooled, through_cache)

    def _file(self, path: Path) -> _File:
        with self._lock:
            file = self._files.get(path)
            if file is None:
                try:
                    file = self._files[path] = _File(path)
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
            return file

    def _read(
        self, path: Path, offset: int, length: int, memory: mmap.mmap, pooled: bool, through_cache: bool
    ) -> ReadBuffer:
        try:
            file = self._file(path)
            if offset + length > file.size:
                raise CheckpointError(
                    f"{path}: the file ends at {file.size} bytes, before the tensor data it lists "
                    f"(truncated or replaced during the merge?)"
                )
            lo = offset // ALIGN * ALIGN
            if through_cache or file.direct is None or file.refused or file.resident(offset, length):
                _read_into(file.buffered, memoryview(memory)[offset - lo : offset - lo + length], offset, path)
            else:
                hi = -(-(offset + length) // ALIGN) * ALIGN
                if not self._read_direct(file, memory, lo, hi, offset + length):
                    _read_into(file.buffered, memoryview(memory)[offset - lo : offset - lo + length], offset, path)
        except BaseException:
            _hand_back(self.pool, memory, pooled)
            raise
        return ReadBuffer(memory, offset - lo, length, self.pool, counted=pooled)

    def _read_direct(self, file: _File, memory: mmap.mmap, lo: int, hi: int, needed: int) -> bool:
        """Read [lo, hi) with O_DIRECT (a short read at the end of the file is fine once `needed` is in).
        False when the filesystem refuses direct reads: this file is read buffered from now on."""
        view = memoryview(memory)
        position = lo
        while position < needed:
            if file.direct is None or file.refused:
                return False
            try:
                got = os.preadv(file.direct, [view[position - lo : hi - lo]], position)
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # not closed here: another reader may be using the descriptor
                    file.refused = True
                    return False
                raise CheckpointError(f"{file.path}: cannot read ({exc.strerror or exc})") from None
            if got <= 0:
                raise CheckpointError(f"{file.path}: unexpected end of file at byte {position}")
            position += got
        return True

    def close(self) -> None:
        """Wait for reads in flight, close every file and the pool."""
        self._threads.shutdown(wait=True)
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
        self.pool.close()


def _unmap(memory: mmap.mmap) -> None:
    try:
        memory.close()
    except BufferError:  # a tensor still views it: unmapped when that tensor is freed
        pass


def _read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """pread until `view` is full (a read may be short)."""
    while len(view):
        try:
            got = os.preadv(fd, [view], offset)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if got <= 0:
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset}")
        view = view[got:]
        offset += got


def _find_mincore():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    mincore.restype = ctypes.c_int
    return mincore


_MINCORE = _find_mincore()
