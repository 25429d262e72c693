"""Torch's intra-op threads while the executor's own worker threads merge: the cores shared out, not multiplied.

Why: the executor runs one worker thread per core (`--threads`, default the core count), and each worker's torch
operations on blocks of 2**18 or more entries would start an OpenMP team of torch's default size (the core count)
of their own: 4 busy threads on 2 cores, each operation waking its team through the kernel. Measured on the 1 B
dare_ties bench merge on this project's 2-core VM (cold cache, bench/README.md, issue 21): 1.56 M futex calls
and 10 s of system time with the default, 0.67 M and 4 s with one intra-op thread per worker, and the wall
time 28.5-30.0 s -> 22.0-24.0 s (five cold runs). So while workers run, torch gets cores // workers threads
each (at least 1), and its setting is put back afterwards: a library call must not leave its host program's
torch changed.

torch keeps one process-wide thread count, which a thread reads when it first runs a parallel operation; the
executor's workers are new threads, so setting it before they start is enough. Reductions here do not depend on
it (kernels/reductions.py), so the merged bytes are the same either way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's share)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks on this platform
        return max(1, os.cpu_count() or 1)


@contextmanager
def shared_between(workers: int) -> Iterator[int]:
    """Give torch usable_cores() // workers intra-op threads (at least 1) inside the block; yields that count."""
    before = torch.get_num_threads()
    each = max(1, usable_cores() // max(1, workers))
    if each != before:
        torch.set_num_threads(each)
    try:
        yield each
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
