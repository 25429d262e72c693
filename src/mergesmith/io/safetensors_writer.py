"""Streaming safetensors writer: the layout is fixed first, each tensor's bytes land at their offset.

A safetensors file is a little-endian u64 header length, a JSON header (dtype, shape, data offsets,
optional `__metadata__`), then the raw bytes. Because the plan knows every output tensor's shape and
dtype before anything is computed, the header can be written first and the file reserved at its full
size; tensors then arrive in any order and are written with `pwrite` at their offsets, then freed.
Memory is bounded by the tensors in flight, never by the shard.

Every tensor is just bytes here: views, transposes, non-contiguous, zero-size and 0-dim tensors, and
tensors sharing storage with others (tied embeddings, a layer used twice) all save with no flag and
no warning. The file is written under a temporary name and only renamed into place once complete
and fsync'ed, so a file with the final name is always whole. Bulk bytes bypass the page cache where
the filesystem allows it (`direct_write.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import safe_fs
from ._test_hooks import kill_point
from .direct_write import DirectWriter, pwrite_all
from .dtypes import dtype_size, from_torch

try:  # zlib's CRC-32, the same numbers, by zlib-ng's vectorised code: ~37 GB/s against zlib's ~7 (AMD EPYC, 64 MB)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without its wheel
    from zlib import crc32

if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian by definition
    raise ImportError("mergesmith's safetensors writer needs a little-endian machine")


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a shard: absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def layout(
    entries: Sequence[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[Slot]]:
    """The header bytes (length prefix included) and each tensor's absolute slot, in entry order."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    relative: list[tuple[str, str, tuple[int, ...], int, int]] = []
    for name, dtype, shape in entries:
        numel = 1
        for d in shape:
            numel *= d
        size = numel * dtype_size(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        relative.append((name, dtype, tuple(shape), offset, offset + size))
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad so tensor data starts 8-byte aligned
    prefix = struct.pack("<Q", len(blob)) + blob
    base = len(prefix)
    return prefix, [Slot(n, d, s, base + b, base + e) for n, d, s, b, e in relative]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw little-endian bytes in row-major order, whatever its strides or sharing."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)  # contiguous() copies only when the layout needs it
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # torch calls size-1 dims contiguous whatever their stride: (1,) may have stride 2
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return memoryview(flat.view(torch.uint8).numpy())


class ShardWriter:
    """Writes one shard file: header at creation, tensors at their offsets, rename on `finish`."""

    def __init__(
        self,
        final_path: Path,
        temp_path: Path,
        entries: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        resume: dict[str, int] | None = None,
        root: Path | None = None,
    ) -> None:
        """Create the partial file, or with `resume` (name -> CRC of tensors a journal says are durable)
        reopen an existing one whose header matches, keeping each listed tensor whose bytes still
        match its CRC; `done` then names the tensors that need no writing.

        `root` (default: the final file's directory) is trusted as given; the directories from it down
        to both files are opened without following links (`safe_fs`), the partial file is created new
        (a link in its place is removed, never written through) and renamed between those descriptors."""
        self.final_path = final_path
        self.temp_path = temp_path
        root = final_path.parent if root is None else root
        header, slots = layout(entries, metadata)
        self.slots = {s.name: s for s in slots}
        self.size = slots[-1].end if slots else len(header)
        self._crcs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._fd = -1
        self._direct: DirectWriter | None = None
        self._temp_dir = -1
        self._final_dir = -1
        self._temp_dir = safe_fs.dir_of(root, temp_path, create=True)
        try:
            self._final_dir = safe_fs.dir_of(root, final_path)
        except BaseException:
            self._close_dirs()
            raise
        if resume and self._reopen(header, resume):
            self._direct = DirectWriter.open(temp_path, self._fd)
            return
        try:
            self._fd = safe_fs.create_new_file(self._temp_dir, temp_path.name)
        except BaseException:
            self._close_dirs()
            raise
        try:
            _reserve(self._fd, self.size)
            pwrite_all(self._fd, memoryview(header), 0)
            self._direct = DirectWriter.open(temp_path, self._fd)
        except BaseException:
            self.abort()
            raise

    def _reopen(self, header: bytes, resume: dict[str, int]) -> bool:
        try:
            fd = safe_fs.open_regular(self._temp_dir, self.temp_path.name, os.O_RDWR)  # a link: not reused
        except OSError:
            return False
        if os.fstat(fd).st_size != self.size:
            os.close(fd)
            return False
        if os.pread(fd, len(header), 0) != header:
            os.close(fd)
            return False
        self._fd = fd
        for name, crc in resume.items():
            slot = self.slots.get(name)
            if slot is not None and _crc_of_range(fd, slot.start, slot.end) == crc:
                self._crcs[name] = crc
        return True

    @property
    def done(self) -> set[str]:
        with self._lock:
            return set(self._crcs)

    def sync(self) -> dict[str, int]:
        """Make every tensor written so far durable; returns their CRCs (safe to journal now).

        Runs from the executor's background flusher, so the page cache is written back while the
        merge goes on instead of all at once at the end; `_fd_lock` keeps `finish`/`close` from closing
        the descriptor under it, without ever blocking tensor writes."""
        with self._lock:
            snapshot = dict(self._crcs)
        if self._direct is not None:
            self._direct.drain()  # every tensor in the snapshot has its bytes queued by now
        with self._fd_lock:
            if self._fd >= 0:
                os.fdatasync(self._fd)
        return snapshot

    def _put(self, data: memoryview, offset: int) -> None:
        if self._direct is not None:
            self._direct.write(data, offset)
        else:
            pwrite_all(self._fd, data, offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Place `tensor`'s bytes in its slot. Thread-safe; each name is written once."""
        slot = self.slots[name]
        if from_torch(tensor.dtype) != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"tensor {name!r}: planned {slot.dtype}{list(slot.shape)}, got {from_torch(tensor.dtype)}"
                f"{list(tensor.shape)}"
            )
        data = tensor_bytes(tensor)
        crc = crc32(data)
        self._put(data, slot.start)
        kill_point("tensor", name)
        with self._lock:
            if name in self._crcs:
                raise ValueError(f"tensor {name!r} written twice")
            self._crcs[name] = crc

    def open_tensor(self, name: str) -> TensorSink:
        """A sequential sink for one tensor written in row blocks (memory: one block, not the tensor)."""
        return TensorSink(self, self.slots[name])

    def _commit(self, name: str, crc: int) -> None:
        with self._lock:
            if name in self._crcs:
                raise ValueError(f"tensor {name!r} written twice")
            self._crcs[name] = crc

    def forget(self, name: str) -> None:
        """Drop a written tensor's record (its bytes turned out bad after the write): never journaled as done."""
        with self._lock:
            self._crcs.pop(name, None)

    @property
    def complete(self) -> bool:
        return len(self._crcs) == len(self.slots)

    def checksum(self) -> str:
        """A digest of every tensor's CRC in file order: independent of the order of writes."""
        return combine_checksums([(s.name, self._crcs[s.name]) for s in self.slots.values()])

    def finish(self) -> str:
        """fsync, close and rename into place; returns the shard's checksum."""
        missing = [n for n in self.slots if n not in self._crcs]
        if missing:
            raise ValueError(f"shard {self.final_path.name}: {len(missing)} tensors never written, e.g. {missing[0]!r}")
        digest = self.checksum()
        if self._direct is not None:
            self._direct.drain()
        with self._fd_lock:
            self._close_direct()
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        safe_fs.replace_atomically(self._temp_dir, self.temp_path.name, self._final_dir, self.final_path.name)
        safe_fs.fsync_fd(self._final_dir)
        self._close_dirs()
        kill_point("shard_renamed", self.final_path.name)
        return digest

    def close(self) -> None:
        """Close the file but keep the partial file, whose journaled tensors a resume will reuse."""
        with self._fd_lock:
            self._close_direct()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _close_dirs(self) -> None:
        for attr in ("_temp_dir", "_final_dir"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)

    def _close_direct(self) -> None:
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()

    def __del__(self) -> None:
        # An interrupted or failed merge drops its unfinished writers without finishing them; without
        # this each would keep its descriptor open for the life of the process (an API user's, a
        # multi-stage merge's), one per unfinished shard.
        try:
            self.close()
            self._close_dirs()
        except (AttributeError, OSError, TypeError):  # half-built writer, or interpreter shutdown
            pass

    def abort(self) -> None:
        """Close and delete the partial file (used on error; a kill leaves it for the next run to discard)."""
        self.close()
        if self._temp_dir >= 0:
            try:
                os.unlink(self.temp_path.name, dir_fd=self._temp_dir)
            except FileNotFoundError:
                pass
        self._close_dirs()


class TensorSink:
    """Receives one tensor's bytes as consecutive row blocks, in order, and commits its CRC at the end."""

    def __init__(self, writer: ShardWriter, slot: Slot) -> None:
        self.writer = writer
        self.slot = slot
        self.pos = slot.start
        self.crc = 0

    def write(self, part: torch.Tensor) -> None:
        if from_torch(part.dtype) != self.slot.dtype:
            raise ValueError(f"tensor {self.slot.name!r}: planned {self.slot.dtype}, got {from_torch(part.dtype)}")
        data = tensor_bytes(part)
        if self.pos + len(data) > self.slot.end:
            raise ValueError(f"tensor {self.slot.name!r}: more bytes than its planned shape {list(self.slot.shape)}")
        self.crc = crc32(data, self.crc)
        self.writer._put(data, self.pos)
        self.pos += len(data)

    def close(self) -> None:
        if self.pos != self.slot.end:
            raise ValueError(
                f"tensor {self.slot.name!r}: {self.pos - self.slot.start} of "
                f"{self.slot.end - self.slot.start} bytes written"
            )
        kill_point("tensor", self.slot.name)
        self.writer._commit(self.slot.name, self.crc)


def combine_checksums(crcs: Sequence[tuple[str, int]]) -> str:
    h = hashlib.sha256()
    for name, crc in crcs:
        h.update(name.encode("utf-8") + b"\0" + crc.to_bytes(4, "little"))
    return h.hexdigest()


def file_checksum(path: Path) -> str:
    """Recompute a finished shard's checksum from its bytes (to verify it before a resume skips it)."""
    from .checkpoint import read_safetensors_header

    tensors, _meta, _raw = read_safetensors_header(path)
    ordered = sorted(tensors.values(), key=lambda i: i.data_offset)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a shard is never a link
    try:
        crcs = [(i.name, _crc_of_range(fd, i.data_offset, i.data_offset + i.nbytes)) for i in ordered]
    finally:
        os.close(fd)
    return combine_checksums(crcs)


def _crc_of_range(fd: int, start: int, end: int) -> int:
    crc = 0
    pos = start
    while pos < end:
        chunk = os.pread(fd, min(end - pos, 64 << 20), pos)
        if not chunk:
            break
        crc = crc32(chunk, crc)
        pos += len(chunk)
    return crc


def _reserve(fd: int, size: int) -> None:
    """Claim the file's full size now, so a full disk fails at the start rather than mid-merge."""
    if size == 0:
        return
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (getattr(os, "EOPNOTSUPP", 95), 95, 22):  # filesystems without fallocate
                raise
    os.ftruncate(fd, size)


def fsync_dir(path: Path) -> None:
    """Make a rename durable: fsync the directory that holds the entry."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, root: Path | None = None) -> None:
    """Write a small file (index, config) under a temporary name, fsync, then rename into place.

    The temporary file is created new (a link in its place is removed, never written through); the
    directories from `root` (default: the file's own directory, trusted as given) down to the file are
    opened without following links."""
    tmp = f".{path.name}.tmp"
    dfd = safe_fs.dir_of(path.parent if root is None else root, path, create=True)
    try:
        safe_fs.write_new_file(dfd, tmp, data)
        kill_point("atomic_tmp", path.name)
        safe_fs.replace_atomically(dfd, tmp, dfd, path.name)
        safe_fs.fsync_fd(dfd)
    finally:
        os.close(dfd)
    kill_point("atomic_done", path.name)
