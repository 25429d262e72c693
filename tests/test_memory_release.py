"""memory_release hands the heap's free pages back only above the bound its caller names."""

from __future__ import annotations

import sys

import pytest

from mergesmith.runtime import memory_release


def test_the_heap_is_trimmed_only_when_it_holds_more_free_than_the_bound(monkeypatch):
    if memory_release.free_heap_bytes() is None:
        pytest.skip("glibc's mallinfo2 is not here")
    calls: list[int] = []
    monkeypatch.setattr(memory_release, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(memory_release, "free_heap_bytes", lambda: 50 << 20)
    memory_release.release_free_heap(keep=128 << 20)
    assert calls == []  # 50 MB free, 128 MB may stay: nothing handed back
    memory_release.release_free_heap(keep=32 << 20)
    assert calls == [0]
    memory_release.release_free_heap()  # no bound: always
    assert calls == [0, 0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_free_heap_bytes_follows_what_is_freed():
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if memory_release.free_heap_bytes() is None:
        pytest.skip("glibc's mallinfo2 is not here")
    memory_release.release_free_heap()
    blocks = [libc.malloc(64 << 10) for _ in range(64)]  # below the mmap threshold: from the heap
    held = libc.malloc(64 << 10)  # keeps the freed blocks from merging into the top and being trimmed by free
    before = memory_release.free_heap_bytes()
    for block in blocks:
        libc.free(block)
    assert memory_release.free_heap_bytes() >= before + (4 << 20) - (64 << 10)
    libc.free(held)
