"""Test-only crash injection, so the crash-consistency tests can kill a merge at exact points.

Random-time kills rarely land inside the few microseconds between writing a file and renaming it, or
between two renames at the end of a merge, yet those are the points where a wrong order would leave a
directory that looks complete but is not. So the writer and the API call `kill_point(event)` at a few
such places, and with the environment variable `MERGESMITH_TEST_KILL_AT=<event>:<n>` the process
SIGKILLs itself the n-th time it reaches `event` (counted per process), or with `<event>@<name>` the
first time it reaches `event` for the file or tensor `name` (robust to how many journal saves a slow
run makes). `MERGESMITH_TEST_SLOW=<s>` sleeps that many seconds at each `tensor` point, to give
interrupt tests a merge that lasts.

Events: `tensor` (a tensor's bytes are in the partial file, not yet journaled), `shard_renamed` (a shard
has its final name, not yet journaled), `atomic_tmp` / `atomic_done` (a small file such as the
journal, index or config.json is written under its temporary name / renamed into place), `unlink` (the
API removed one output file). Unset variables cost one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time

KILL_ENV = "MERGESMITH_TEST_KILL_AT"
SLOW_ENV = "MERGESMITH_TEST_SLOW"

_counts: dict[str, int] = {}
_lock = threading.Lock()


def kill_point(event: str, name: str = "") -> None:
    """SIGKILL this process if `MERGESMITH_TEST_KILL_AT` names this occurrence of `event` (about `name`)."""
    if event == "tensor":
        slow = os.environ.get(SLOW_ENV)
        if slow:
            time.sleep(float(slow))
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    if "@" in spec:
        if spec == f"{event}@{name}":
            os.kill(os.getpid(), signal.SIGKILL)
        return
    wanted, _, nth = spec.rpartition(":")
    if wanted != event:
        return
    with _lock:
        count = _counts[event] = _counts.get(event, 0) + 1
    if count == int(nth):
        os.kill(os.getpid(), signal.SIGKILL)
