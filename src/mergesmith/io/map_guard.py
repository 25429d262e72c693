"""Surviving an input file that shrinks while the merge reads it through a memory map.

Why: a read of a mapped page past the end of its file raises SIGBUS, which kills the process with no message
and no journal update (a download rewritten in place, a file truncated on tmpfs, NFS or overlay, where the merge
reads through maps because O_DIRECT is unavailable, `.bin` inputs, MERGESMITH_DIRECT_IO=0). Python cannot
catch it: its `signal` handlers run later, between bytecodes, while the faulting instruction is retried at once,
and faulthandler only prints a traceback before dying.

What is done instead, in two layers:
1. sizes are checked where that is cheap: a file is compared with the end of the tensor data its header lists
   before it is mapped and before every tensor is viewed through the map (io.checkpoint), and once more after
   each computed block (executor), so a file truncated before or between reads fails with one line;
2. for a truncation *during* a read, a process-wide SIGBUS handler (installed with sigaction through ctypes,
   so it runs at the fault, not later) checks that the faulting address lies in one of the registered input
   maps, maps a zero page over it so the read completes, and records the file. The executor then sees the
   record (or the smaller size) before the block's output is committed and raises the same one-line
   "unexpected end of file" error as the direct-read path; the zeros are never kept. A SIGBUS anywhere else
   restores the previous handler and lets the fault happen again, as it would have without this module.

Only on Linux with glibc's sigaction layout (x86-64, aarch64); elsewhere layer 1 alone applies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
import signal
import sys
import threading
from pathlib import Path

_SA_SIGINFO = 0x4
_SA_NODEFER = 0x40000000
_SI_ADDR_OFFSET = 16  # siginfo_t: three ints, padding, then si_addr (64-bit Linux)
_PROT_READ_WRITE = 0x3
_MAP_PRIVATE_FIXED_ANONYMOUS = 0x02 | 0x10 | 0x20


class _SigAction(ctypes.Structure):
    """glibc's `struct sigaction` on 64-bit Linux: handler, 1024-bit mask, flags, restorer."""

    _fields_ = [
        ("sa_sigaction", ctypes.c_void_p),
        ("sa_mask", ctypes.c_ulong * 16),
        ("sa_flags", ctypes.c_int),
        ("sa_restorer", ctypes.c_void_p),
    ]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class MapGuard:
    """The registered input maps (address ranges per file) and the files a SIGBUS hit."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, Path]] = []
        self._faulted: set[Path] = set()
        self._lock = threading.Lock()
        self._installed = False
        self._libc: ctypes.CDLL | None = None
        self._previous: _SigAction | None = None
        self._handler = _HANDLER_TYPE(self._on_sigbus)  # kept alive: the kernel calls it

    @staticmethod
    def supported() -> bool:
        return (
            sys.platform.startswith("linux")
            and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64")
            and platform.libc_ver()[0] == "glibc"
        )

    def register(self, path: Path, start: int, end: int) -> None:
        """Guard reads of [start, end) (addresses of a map of `path`)."""
        if end <= start or not self._install():
            return
        with self._lock:
            self._ranges = [*self._ranges, (start, end, path)]  # replaced, never mutated: the handler reads it
            self._faulted.discard(path)  # a new map of the file (reopened after it was replaced) starts clean

    def unregister(self, path: Path, start: int) -> None:
        """Stop guarding the map of `path` registered at `start` (a map closed: its addresses may be reused)."""
        with self._lock:
            self._ranges = [r for r in self._ranges if (r[2], r[0]) != (path, start)]

    def faulted(self, path: Path) -> bool:
        """Whether a read of `path`'s map ran past the end of the file (the bytes read there are zeros)."""
        return path in self._faulted

    def _install(self) -> bool:
        if self._installed:
            return True
        if not self.supported():
            return False
        with self._lock:
            if self._installed:
                return True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_size_t,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_int,
                    ctypes.c_long,
                ]
                action = _SigAction()
                action.sa_sigaction = ctypes.cast(self._handler, ctypes.c_void_p).value
                action.sa_flags = _SA_SIGINFO | _SA_NODEFER
                previous = _SigAction()
                if libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(previous)) != 0:
                    return False
            except (OSError, AttributeError):
                return False
            self._libc, self._previous, self._installed = libc, previous, True
            return True

    def _on_sigbus(self, _signum: int, info: int, _context: int) -> None:
        """At the fault: a zero page over the faulting address of a registered map (the read then completes),
        or, for any other address, the previous handler back so that the retried access faults as before."""
        address = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value or 0
        for start, end, path in self._ranges:
            if start <= address < end and self._libc is not None:
                page = address // mmap.PAGESIZE * mmap.PAGESIZE
                self._libc.mmap(page, mmap.PAGESIZE, _PROT_READ_WRITE, _MAP_PRIVATE_FIXED_ANONYMOUS, -1, 0)
                self._faulted.add(path)
                return
        if self._libc is not None and self._previous is not None:
            self._libc.sigaction(signal.SIGBUS, ctypes.byref(self._previous), None)
            self._installed = False


GUARD = MapGuard()
