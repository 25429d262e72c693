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
  read (a trace of the 1b linear merge's start, bench/README.md, issue 33); those few stay frozen.
- A quick exit. Tearing down an interpreter that has loaded torch (module teardown, collecting every
  object, C++ static destructors) takes about 0.5 s here, 3-5% of a 1 B-parameter merge, and buys the
  command nothing: its files are closed and fsync'ed by then. The console script runs the registered
  atexit handlers, flushes its streams and logging, and leaves with `os._exit`. With Ray loaded it
  exits normally, so that Ray's own shutdown stops its workers.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from typing import NoReturn

HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def prefer_huge_pages() -> None:
    """Ask torch for transparent huge pages on large CPU buffers (call before torch allocates)."""
    os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")


def freeze_long_lived_objects() -> None:
    """Exclude everything alive now from future garbage collections (call once the plan is built)."""
    gc.freeze()


def thaw_objects() -> None:
    """Undo `freeze_long_lived_objects` (the command is over)."""
    gc.unfreeze()


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
