"""Read the files the merge command imports ahead of the imports themselves, from a list the last run left.

Why: with a cold page cache, importing torch and the rest of a merge's modules (about 1,200 modules, 53 MB of
bytecode and extension libraries here) takes 3-4 s, and most of it is waiting: Python opens and reads each
module's file one at a time, at the disk's latency, not its bandwidth. Reading those files first, eight at a
time, turns the waits into a short burst (cold `import mergesmith.engine.run` on this VM, 3 runs each: median 3.2 s
without, 2.75 s with the read-ahead running beside the import; reading *all* of torch's, numpy's and the
standard library's bytecode instead was slower than nothing, 3.6-4.5 s, as it reads far more than is used).

Which files: those the previous merge command imported, in the order it imported them, recorded under the
cache directory when it finished (`record`). The list depends on the interpreter and the installed packages
only, so it is kept per interpreter; a file that is gone is skipped, and the list is rewritten when a run
imports something else. The first run on a machine has no list and reads nothing ahead. Everything here is
best-effort: a read-ahead that fails costs nothing but its own time. The list is read and written through
descriptors of its cache directory (cache_root.open_cache_dir): a link planted as that directory, as the
list or as its temporary file is never followed; where the directory is a link, nothing is recorded or
read ahead (silently: every command starts here, and the read-ahead is an optimisation only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

from ..errors import OutputError
from ..io import safe_fs
from .cache_root import cache_root, open_cache_dir

READERS = 8
"""Files read at once: enough to keep this disk's queue busy with small files (one reader waits on each)."""


def manifest_path() -> Path:
    """The list of this interpreter (its executable and version name it: another venv imports other files)."""
    tag = hashlib.sha1(f"{sys.executable}\0{sys.version}".encode()).hexdigest()[:16]
    return cache_root() / "imports" / f"{tag}.txt"


def imported_files() -> list[str]:
    """The files behind the modules imported so far, in import order: a source module's bytecode where
    Python keeps it (what the next import reads), else its source; extension modules as they are."""
    files: list[str] = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        if path.endswith(".py"):
            try:
                cached = importlib.util.cache_from_source(path)
            except (NotImplementedError, ValueError):
                cached = None
            path = cached if cached and os.path.exists(cached) else path
        files.append(path)
    return list(dict.fromkeys(files))


def record() -> None:
    """Leave the files imported so far for the next run (rewritten only when the list changed)."""
    try:
        name = manifest_path().name
        data = ("\n".join(imported_files()) + "\n").encode()
        dfd = open_cache_dir("imports")
    except (OSError, OutputError):
        return
    try:
        try:
            if safe_fs.read_regular(dfd, name, limit=64 << 20) == data:
                return
        except OSError:
            pass
        partial = f"{name}.{os.getpid()}.tmp"
        safe_fs.write_new_file(dfd, partial, data)  # created new: a link in its place is removed, not followed
        safe_fs.replace_atomically(dfd, partial, dfd, name)  # a reader never sees half a list
    except OSError:
        return
    finally:
        os.close(dfd)


def read_ahead() -> list[threading.Thread]:
    """Start reading the recorded files into the page cache, READERS at a time, in import order (the
    threads, daemons, are returned; none when nothing is recorded)."""
    try:
        dfd = open_cache_dir("imports", create=False)
    except (OSError, OutputError):
        return []
    try:
        paths = safe_fs.read_regular(dfd, manifest_path().name, limit=64 << 20).decode().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    finally:
        os.close(dfd)
    if not paths or not hasattr(os, "posix_fadvise"):
        return []
    threads = [
        threading.Thread(target=_read_each, args=(paths[k::READERS],), name=f"warm-imports-{k}", daemon=True)
        for k in range(min(READERS, len(paths)))
    ]
    for thread in threads:
        thread.start()
    return threads


def _read_each(paths: list[str]) -> None:
    """Open each file (the path lookup is the slow, synchronous part of a cold small file) and ask for all
    of it; a missing or unreadable file is skipped."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
