"""Hand freed heap memory back to the operating system between recipes.

Why: glibc serves allocations below its mmap threshold (which it raises on its own up to 32 MB once a
large block is freed) from per-thread heaps and keeps what is freed there for reuse. A merge allocates
and frees tensors of every size from 1 to 32 MB hundreds of times on several threads, so the heaps grow
fragmented and the process keeps hundreds of MB it no longer uses: on a 1 B-parameter TIES merge, about
0.6 GB of a 2.3 GB peak RSS. `malloc_trim(0)` returns the free pages of every heap (including those in
the middle, with MADV_DONTNEED); calling it once per finished recipe costs far less than lowering the mmap
threshold, which makes every mid-sized allocation fault in fresh pages (measured: twice the wall time).
Elsewhere than glibc this is a no-op.

Not after every recipe, though: what `malloc_trim` hands back, the next recipe's temporaries fault in again, each
page zeroed by the kernel. So the heap's free bytes (glibc's `mallinfo2`) are handed back only once they exceed
a bound the caller names: the process then keeps at most that much it does not use. On the 1b ties bench merge,
warm, with the executor's bound of 128 MB: 6.8-7.6 s of system time against 7.7 s trimming after every large recipe
(both with io.direct_write.anonymous_buffer's private buffers; 8.6-8.7 s before either), for 1.07-1.09 GB of peak
RSS against 1.01-1.03 GB (2 runs each, bench/README.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Callable
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


def _glibc_function(name: str, argtypes: list[Any], restype: Any) -> Callable[..., Any] | None:
    """The C library's function `name` with this signature, None off Linux or where the library lacks it (musl and
    others have no malloc_trim; glibc before 2.33 no mallinfo2)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


_MALLOC_TRIM = _glibc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_MALLINFO2 = _glibc_function("mallinfo2", [], _MallInfo2) if _MALLOC_TRIM is not None else None


def free_heap_bytes() -> int | None:
    """Bytes the C heap holds free (glibc 2.33 or later), None where that cannot be asked."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def release_free_heap(keep: int = 0) -> None:
    """Return the C heap's free pages to the OS (glibc) unless it holds at most `keep` bytes free (where glibc can
    say); nothing elsewhere."""
    if _MALLOC_TRIM is None:
        return
    if keep:
        free = free_heap_bytes()
        if free is not None and free <= keep:
            return
    _MALLOC_TRIM(0)


_MADVISE = _glibc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def lazily_free(address: int, nbytes: int) -> bool:
    """madvise(MADV_FREE) over the whole pages inside [address, address + nbytes) (Linux 4.5 and later); whether it
    was done. The memory stays allocated: the kernel may take those pages back under memory pressure, and they then
    read as zeros; written again before that, they are kept, with no fault (sort_select's spare ids buffer)."""
    if _MADVISE is None or not hasattr(mmap, "MADV_FREE"):
        return False
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return end <= start or _MADVISE(start, end - start, mmap.MADV_FREE) == 0
