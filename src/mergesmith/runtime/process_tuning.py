"""Process settings for a long streaming merge that only the command line may change.

Both are process-wide, so a library must not impose them on its host program; `mergesmith` the command
owns its process and sets them:

- Huge pages for torch's large buffers. Every recipe converts its inputs to the compute dtype and
  allocates an output: tens of MB of fresh memory per tensor, which glibc maps anew each time (above
  its mmap threshold) or gets back from `malloc_trim`. Each 4 KB page of it then costs the kernel a
  fault and a memory-cgroup charge. With `THP_MEM_ALLOC_ENABLE=1` torch advises buffers of 2 MB or
  more as transparent huge pages, one fault per 2 MB. Measured on the 1 B-parameter slerp bench merge
  (warm cache): minor faults 2.1-2.4 M -> 0.3-0.4 M, system time 9-11 s -> 5.4-5.9 s. torch reads the
  variable once, at its first allocation, so it must be set before torch allocates anything; a user's
  own setting (`THP_MEM_ALLOC_ENABLE=0`) wins.
- A quiet garbage collector. Once the plan is built, the process holds many long-lived objects
  (torch's modules, the plan, headers) that every full collection walks again while the merge
  allocates small objects per tensor; `gc.freeze()` moves them out of the collector's sight (in a
  profile of the slerp bench merge the collector's share of CPU fell from 1.7% to 1.1%).
  Objects made later are collected as usual, and the command thaws everything when it ends (an
  in-process caller, such as a test suite, gets its collector back as it was). No collection first: at that
  point one found 20 garbage objects among ~181 K and took 90-95 ms of the merge's start-up, before its first
  read (a trace of the 1b linear merge's start, bench/README.md, issue 33); those few stay frozen. Until the
  freeze, while the command imports torch, numba and the rest, the collector runs less often
  (`quiet_collector_while_starting`): with its default thresholds it made 427 collections, four of them full,
  in the ~0.95 s of a merge command's imports (~170 ms, before the first read); with (10000, 20, 100), 29 and
  ~60 ms (two runs each).
- numba without scipy's BLAS. numba's import asks whether scipy's BLAS can be imported (for its np.dot and
  linalg support) by importing scipy.linalg: ~0.23 s of the GIL while the merge's first blocks are read, and
  scipy's OpenBLAS threads, which then spin for CPU time of their own (perf on the 1b dare_ties bench merge:
  ~0.2 CPU-s in `blas_thread_server`). No compiled loop of mergesmith's uses BLAS, so the merge command makes
  that one import fail for the thread that imports numba (`numba_without_blas`); numba then leaves its BLAS-backed
  functions out, for the rest of the process. Another thread's imports of scipy are not touched.
- A quick exit. Tearing down an interpreter that has loaded torch (module teardown, collecting every
  object, C++ static destructors) takes about 0.5 s here, 3-5% of a 1 B-parameter merge, and buys the
  command nothing: its files are closed and fsync'ed by then. The console script runs the registered
  atexit handlers, flushes its streams and logging, and leaves with `os._exit`. With Ray loaded it
  exits normally, so that Ray's own shutdown stops its workers.
"""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    """Ask torch for transparent huge pages on large CPU buffers (call before torch allocates)."""
    os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")


STARTING_THRESHOLDS = (10_000, 20, 100)
"""The collector's thresholds while a command starts (quiet_collector_while_starting)."""

_thresholds_before: tuple[int, int, int] | None = None


def quiet_collector_while_starting() -> None:
    """Collect garbage less often until the plan is built (freeze_long_lived_objects) or the command ends
    (thaw_objects): the imports make long-lived objects by the hundred thousand, which collections only walk."""
    global _thresholds_before
    if _thresholds_before is None:
        _thresholds_before = gc.get_threshold()
        gc.set_threshold(*STARTING_THRESHOLDS)


def _collector_as_before() -> None:
    global _thresholds_before
    if _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None


def freeze_long_lived_objects() -> None:
    """Exclude everything alive now from future garbage collections (call once the plan is built), which run as
    often as before the command again."""
    gc.freeze()
    _collector_as_before()


def thaw_objects() -> None:
    """Undo `freeze_long_lived_objects` and `quiet_collector_while_starting` (the command is over)."""
    gc.unfreeze()
    _collector_as_before()


def exit_code_of(exc: SystemExit) -> int:
    """The process exit status `sys.exit(value)` would give: None is 0, an int itself, anything else 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    """End the process with `code` without tearing the interpreter down (see the module docstring)."""
    if "ray" in sys.modules:
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)


NUMBA_BLAS_PROBE = "scipy.linalg"
"""The module numba's import imports to learn whether BLAS is there (numba.np.arraymath)."""

_numba_blas_wanted = True


def skip_numba_blas() -> None:
    """Have numba imported without scipy's BLAS from now on in this process (the merge command; see the module
    docstring): what numba's BLAS-backed functions need, no kernel of mergesmith's uses."""
    global _numba_blas_wanted
    _numba_blas_wanted = False


class _RefusedInThread(importlib.abc.MetaPathFinder):
    """Refuses one module to one thread (ModuleNotFoundError, as where it is not installed); others import it."""

    def __init__(self, name: str, thread: threading.Thread) -> None:
        self.name = name
        self.thread = thread

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == self.name and threading.current_thread() is self.thread:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not imported with numba here)", name=fullname)
        return None


@contextmanager
def numba_without_blas() -> Iterator[None]:
    """Around numba's import: where skip_numba_blas was called and nothing has imported scipy.linalg yet, this
    thread's import of it fails inside the block, so numba does not load scipy's BLAS. Elsewhere, nothing."""
    if _numba_blas_wanted or NUMBA_BLAS_PROBE in sys.modules:
        yield
        return
    finder = _RefusedInThread(NUMBA_BLAS_PROBE, threading.current_thread())
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
