"""Read-ahead that actually reads ahead: WILLNEED advice split into pieces the kernel honours whole.

Why: Linux caps one `posix_fadvise(WILLNEED)` / `madvise(MADV_WILLNEED)` call at the device's read-ahead
size (`max(read_ahead_kb, max_sectors_kb)`, 8 MB on this machine's disk, 128 KB on many), silently
dropping the rest of the range (mm/readahead.c, force_page_cache_ra). Advising a whole 1 GB shard or a
23 MB tensor in one call therefore reads its first few MB only, and the merge then waits on page faults
for the rest. Advising consecutive pieces no larger than that cap starts the reads of the whole range;
the calls only queue I/O, so they return long before the data arrives.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import lru_cache

DEFAULT_PIECE = 128 << 10
"""The kernel's default read-ahead (VM_READAHEAD_PAGES): safe where the device's cap cannot be read."""

MAX_PIECE = 64 << 20
"""Never advise more than this per call, whatever a device claims."""


@lru_cache(maxsize=64)
def _piece_for_device(device: int) -> int:
    major, minor = os.major(device), os.minor(device)
    best = 0
    for name in ("read_ahead_kb", "max_sectors_kb"):
        for path in (f"/sys/dev/block/{major}:{minor}/queue/{name}", f"/sys/dev/block/{major}:{minor}/../queue/{name}"):
            try:
                with open(path) as f:
                    best = max(best, int(f.read().strip()) << 10)
                break
            except (OSError, ValueError):
                continue
    return min(max(best, DEFAULT_PIECE), MAX_PIECE) if best else DEFAULT_PIECE


def piece_size(fd_or_path: int | str | os.PathLike[str]) -> int:
    """The most bytes one WILLNEED call reads on the device holding this file (a safe guess if unknown)."""
    try:
        device = os.fstat(fd_or_path).st_dev if isinstance(fd_or_path, int) else os.stat(fd_or_path).st_dev
    except OSError:
        return DEFAULT_PIECE
    return _piece_for_device(device)


def piece_ranges(start: int, end: int, piece: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of consecutive pieces of at most `piece` bytes covering [start, end)."""
    for offset in range(start, end, piece):
        yield offset, min(piece, end - offset)


def advise_in_pieces(advise: Callable[[int, int], None], start: int, end: int, piece: int) -> None:
    """Call `advise(offset, length)` over [start, end) in consecutive pieces of at most `piece` bytes."""
    for offset, length in piece_ranges(start, end, piece):
        advise(offset, length)
