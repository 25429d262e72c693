"""The direct I/O buffers ask for transparent huge pages (io.direct_write.anonymous_buffer): a buffer of 4 KB pages
reaches the disk as 1 MB requests on a virtio disk (254 segments a request), one of 2 MB pages as one request."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

from mergesmith.io.direct_write import HUGE_PAGE_BYTES, anonymous_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _eligible(memory: mmap.mmap) -> bool:
    """smaps' THPeligible of the mapping holding `memory`."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError("mapping not found")


@pytest.mark.skipif(_mode() in (None, "never") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="no transparent huge pages here")
def test_large_buffers_are_huge_page_eligible_and_small_ones_not_advised() -> None:
    large = anonymous_buffer(HUGE_PAGE_BYTES + (256 << 10))  # a row block's buffer: 2.25 MB
    assert _eligible(large)
    if _mode() == "madvise":  # where pages must be asked for, an unadvised buffer is not eligible: the test can fail
        plain = mmap.mmap(-1, 4 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        assert not _eligible(plain)
        small = anonymous_buffer(HUGE_PAGE_BYTES // 2)
        assert not _eligible(small)  # below a huge page: not advised
        plain.close()
        small.close()
    large[:4] = b"data"
    assert large[:4] == b"data"
    large.close()
