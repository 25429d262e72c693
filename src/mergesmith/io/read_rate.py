"""How fast the disk under an input file reads, measured with a short O_DIRECT read.

Why: a method with a totals pass reads a row-blocked tensor twice (engine/execution/input_feed.py). A second read from
the disk costs no CPU; a second read through the page cache costs the page cache's first touch, 2.3-4.9 ns a
bf16 entry on our 2-core VM. Which is cheaper depends on the disk. Cold 1 B dare_ties bench merge, one run each:
at the VM's own ~1.2-2.2 GB/s, 23.4 s read twice against 27.4 s through the cache; throttled to 300 MB/s
(blkio cgroup), 44.3 s against 28.9 s (bench/README.md, "Third round"). No flag the system reports says which
kind of disk it is (this VM's virtio disk calls itself rotational), so the merge measures: ROUNDS x PROBE_BYTES
read around the page cache at the feed's queue depth, about 0.1 s at 1.3 GB/s and 0.5 s at 300 MB/s.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .direct_write import ALIGN, anonymous_buffer

PROBE_BYTES = 64 << 20
"""Bytes of the timed read: four 16 MB reads in flight, the input feed's queue depth and a typical block size."""

PIECES = 4

ROUNDS = 2
"""The probe reads PROBE_BYTES this many times, one range after the other, and times the last: a throttled or
network volume serves a short burst faster than it sustains (a 300 MB/s blkio throttle measured 590-720 MB/s on
the first 64 MB, 316 MB/s after it)."""


def direct_read_rate(path: Path, offset: int = 0) -> float | None:
    """Bytes per second of O_DIRECT reads of `path` from `offset` on, as the last of ROUNDS rounds of PROBE_BYTES
    measured them (None where the file is too small to tell, or the filesystem refuses O_DIRECT)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None
    try:
        size = os.fstat(fd).st_size
        start = min(offset, max(0, size - ROUNDS * PROBE_BYTES)) // ALIGN * ALIGN
        piece = (min(PROBE_BYTES, (size - start) // ROUNDS) // PIECES) // ALIGN * ALIGN
        if piece < (1 << 20):
            return None  # a small file reads in a few requests whose latency says little about the rate
        buffers = [anonymous_buffer(piece) for _ in range(PIECES)]
        try:
            with ThreadPoolExecutor(PIECES) as pool:
                for round_ in range(ROUNDS):
                    first = start + round_ * PIECES * piece
                    began = time.perf_counter()
                    offsets = [first + i * piece for i in range(PIECES)]
                    done = sum(pool.map(lambda memory, at: os.preadv(fd, [memory], at), buffers, offsets))
                    seconds = time.perf_counter() - began
        finally:
            for memory in buffers:
                memory.close()
        return done / seconds if seconds > 0 and done else None
    except OSError:
        return None
    finally:
        os.close(fd)
