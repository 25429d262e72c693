"""Writes a shard's bulk bytes around the page cache (O_DIRECT), from a background thread.

Why: a buffered write copies every output byte into freshly allocated page-cache pages, and the kernel
then writes them back. On the 1 B linear merge that copy alone was 17% of all CPU cycles with a warm
cache, at about 0.7 GB/s, because fresh pages are slow to touch on a VM. The fsync at the end then
waited for the writeback. `dd` here: 2.2 GB buffered + fsync takes 7.1 s and 4.3 s of system time;
with O_DIRECT it takes 3.9 s and 0.4 s.

With O_DIRECT the disk reads the bytes from a few reused, aligned buffers. A worker copies its tensor
into one buffer (a user-space memcpy at several GB/s, with the GIL released) and goes back to merging
while this module's thread hands the buffer to the disk. Memory stays bounded: `BUFFERS` buffers
of `CHUNK_BYTES`, and a worker waits for a free buffer when the disk falls behind.

Only that one thread touches the file. ext4 holds the inode's lock for the whole of a direct write
into fallocated (unwritten) blocks, so a worker's own small write would wait for the disk behind it.

O_DIRECT needs the file offset, the length and the buffer address aligned to the device's block. A
tensor's bytes start wherever the previous tensor ended, so only the aligned interior of a write goes
direct. Its unaligned head and tail (under one block each) and small writes go through the page cache
as before. Direct and buffered bytes always land in disjoint blocks, so they never race, and one
fdatasync makes both durable.

Only on local filesystems known to do O_DIRECT well (DIRECT_FILESYSTEMS): on NFS or SMB every direct
write would be a synchronous round trip to the server, and FUSE, ZFS and tmpfs refuse or emulate it.
Elsewhere, where O_DIRECT is missing (macOS, Windows) or refused, every write is a plain buffered write.
`MERGESMITH_DIRECT_IO=0` turns direct writes off.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from typing import NamedTuple

import numpy as np

ENV = "MERGESMITH_DIRECT_IO"
ALIGN = max(4096, mmap.PAGESIZE)  # a multiple of every logical block size in use; mmap buffers are page-aligned
CHUNK_BYTES = 8 << 20  # per direct write; 4-16 MB all reach the disk's rate here, smaller ones did not for reads
BUFFERS = 4  # two per worker on a 2-core machine: one being copied into while one is on its way to disk
MIN_DIRECT_BYTES = 256 << 10  # below this a write goes through the page cache (still from the thread)
MAX_QUEUED_SMALL = 64 << 20  # bytes of small (buffered) writes that may wait for the thread


DIRECT_FILESYSTEMS = frozenset({"ext4", "ext3", "xfs", "btrfs", "f2fs"})


HUGE_PAGE_BYTES = 2 << 20
"""Buffers of at least this size are advised as transparent huge pages (see anonymous_buffer)."""


def anonymous_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of `size` bytes for direct reads and writes: private anonymous memory where the platform
    has the flags, advised as transparent huge pages from HUGE_PAGE_BYTES on.

    Private: Python's default, shared anonymous memory, lives in shmem: the kernel fills each of its pages through
    the shmem fault path, and a direct read into a fresh one pins it by the slow path of get_user_pages (perf on the
    1b ties bench merge: shmem_fault was 3% of all CPU); with private memory the 1b ties merge, warm, took 7.5-8.5 s
    of system time against 9.3-10.2 s (3 runs each).

    Huge pages: a direct read or write of a buffer made of 4 KB pages reaches the block layer as one segment a page,
    and a request holds at most the device's max_segments of them (254 on this project's VM's virtio disk, so 1 MB
    requests); a 2 MB page is one segment, so a read of a 2-8 MB buffer goes out as one or two requests. On that VM
    (where transparent huge pages are given on request, `madvise`) reading the 1b bench inputs (6.6 GB, 8 MB pieces,
    4 in flight) took 1.8-2.0 s instead of 4.0-5.5 s, and writing 2.2 GB 0.44-0.46 s instead of 0.77-0.92 s
    (bench/README.md, issue 33). The 1b bench merges, cold, two alternating runs each: linear 4.9-5.1 s, dare_ties
    6.9-7.7 s, ties 11.8-13.0 s, against 5.9-6.2, 8.0-8.8 and 13.5-14.0 s with 4 KB pages (and 4.9-5.1, 7.4-7.9,
    12.7-13.5 s advised but not aligned: _huge_page_aligned). Where the system gives no huge pages, nothing changes."""
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if None in flags:
        return mmap.mmap(-1, size)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size < HUGE_PAGE_BYTES or advice is None:
        return mmap.mmap(-1, size, flags=flags[0] | flags[1])
    memory = _huge_page_aligned(size, flags[0] | flags[1])
    try:
        memory.madvise(advice)
    except OSError:  # a kernel without transparent huge pages
        pass
    return memory


def _huge_page_aligned(size: int, flags: int) -> mmap.mmap:
    """A private anonymous mapping of `size` bytes starting on a huge page boundary where the kernel places mappings
    of whole huge pages there (Linux 6.7 on): mapped as whole huge pages, then shrunk in place. A row block's 2.25 MB
    buffer mapped as it is starts anywhere, and usually holds no whole aligned 2 MB, so no huge page at all."""
    whole = -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    memory = mmap.mmap(-1, whole, flags=flags)
    if whole != size:
        try:
            memory.resize(size)  # mremap: shrinks without moving
        except (OSError, SystemError, ValueError):  # no mremap here: map the size asked for
            memory.close()
            memory = mmap.mmap(-1, size, flags=flags)
    return memory


def filesystem_type(path: os.PathLike[str] | str) -> str | None:
    """The type of the filesystem holding `path` (Linux: the longest matching mount in /proc/self/mounts)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for fields in entries:
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def direct_io_wanted() -> bool:
    """O_DIRECT exists on this platform and the user has not turned it off."""
    value = os.environ.get(ENV, "1").strip().lower()
    return hasattr(os, "O_DIRECT") and value not in ("0", "false", "no", "off")


def direct_io_supported(path: os.PathLike[str] | str) -> bool:
    """Whether bytes of `path` should go around the page cache: O_DIRECT wanted and the file on a local
    filesystem that does it well (the writer may still find it refused, and then writes buffered)."""
    return direct_io_wanted() and filesystem_type(path) in DIRECT_FILESYSTEMS


class _Job(NamedTuple):
    payload: mmap.mmap | bytes  # a pooled aligned buffer (direct) or a private copy (buffered)
    length: int
    offset: int
    direct: bool
    ticket: int


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite until every byte is written (a write may be short)."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


class DirectWriter:
    """Writes byte ranges into one file: aligned interiors with O_DIRECT, the rest buffered.

    `write` returns once the bytes are copied out of the caller's memory; `drain` waits until every
    queued byte has reached the file (then an fdatasync makes it durable) and re-raises the first
    error the background thread met."""

    def __init__(self, direct_fd: int, buffered_fd: int) -> None:
        self._direct_fd = direct_fd
        self._buffered_fd = buffered_fd
        self._cond = threading.Condition()
        self._free: list[mmap.mmap] = []
        self._made = 0
        self._outstanding: set[int] = set()  # tickets of jobs queued (or being queued) and not yet written
        self._tickets = 0
        self._queued_small = 0
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._refused = False  # the filesystem opened O_DIRECT but rejected a write: fall back for good

    @classmethod
    def open(cls, path: os.PathLike[str] | str, buffered_fd: int) -> DirectWriter | None:
        """A direct writer for `path`, or None where O_DIRECT is unavailable, refused or turned off."""
        if not direct_io_supported(path):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        # The second descriptor must be the file the caller created: a name swapped for a link or another
        # file in between would otherwise receive the bulk bytes (see safe_fs).
        mine, theirs = os.fstat(fd), os.fstat(buffered_fd)
        if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
            os.close(fd)
            return None
        return cls(fd, buffered_fd)

    def write(self, data: memoryview, offset: int) -> None:
        """Place `data` at `offset`. The caller may reuse its memory as soon as this returns."""
        end = offset + len(data)
        first = -(-offset // ALIGN) * ALIGN
        last = end // ALIGN * ALIGN
        if last - first < MIN_DIRECT_BYTES:
            self._queue_small(data, offset)
            return
        self._queue_small(data[: first - offset], offset)
        source = np.frombuffer(data, dtype=np.uint8)
        for start in range(first, last, CHUNK_BYTES):
            length = min(CHUNK_BYTES, last - start)
            buffer, ticket = self._take_buffer()
            # numpy copies with the GIL released, so the other workers keep merging meanwhile.
            np.frombuffer(buffer, dtype=np.uint8, count=length)[:] = source[start - offset : start - offset + length]
            self._jobs.put(_Job(buffer, length, start, True, ticket))
        self._queue_small(data[last - offset :], last)

    def _queue_small(self, data: memoryview, offset: int) -> None:
        if not len(data):
            return
        with self._cond:
            while self._queued_small and self._queued_small + len(data) > MAX_QUEUED_SMALL:
                self._raise_error()
                self._cond.wait()
            self._raise_error()
            self._queued_small += len(data)
            ticket = self._new_ticket()
        self._jobs.put(_Job(bytes(data), len(data), offset, False, ticket))

    def drain(self) -> None:
        """Wait until every write queued so far is in the file; re-raise the first error of one.

        Writes queued meanwhile are not waited for: workers that never pause must not starve the
        journal's periodic sync."""
        with self._cond:
            earlier = set(self._outstanding)
            while earlier & self._outstanding:
                self._cond.wait()
        self._raise_error()

    def close(self) -> None:
        """Finish queued writes (errors are kept for `drain`), stop the thread, close the O_DIRECT fd."""
        with self._cond:
            while self._outstanding:
                self._cond.wait()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=60)
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
        self._free.clear()  # unmapped once unreferenced (an error's traceback may still hold a view of one)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _new_ticket(self) -> int:
        """Register a job about to be queued (call holding the lock)."""
        self._tickets += 1
        self._outstanding.add(self._tickets)
        self._start_thread()
        return self._tickets

    def _take_buffer(self) -> tuple[mmap.mmap, int]:
        with self._cond:
            while True:
                self._raise_error()
                if self._free:
                    buffer = self._free.pop()
                    break
                if self._made < BUFFERS:
                    self._made += 1
                    buffer = anonymous_buffer(CHUNK_BYTES)
                    break
                self._cond.wait()
            return buffer, self._new_ticket()

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="merge-direct-write", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._error is None:
                    self._write_out(memoryview(job.payload)[: job.length], job.offset, job.direct)
            except BaseException as exc:  # noqa: BLE001 - handed to the writing threads via drain/write
                self._error = exc
            finally:
                with self._cond:
                    if job.direct:
                        self._free.append(job.payload)  # type: ignore[arg-type]
                    else:
                        self._queued_small -= job.length
                    self._outstanding.discard(job.ticket)
                    self._cond.notify_all()

    def _write_out(self, data: memoryview, offset: int, direct: bool) -> None:
        while len(data):
            if self._refused or not direct:
                pwrite_all(self._buffered_fd, data, offset)
                return
            try:
                written = os.pwrite(self._direct_fd, data, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refused = True  # opened with O_DIRECT, but this filesystem will not do it
                continue
            data = data[written:]
            offset += written
