"""block_stops: a scan step's stops, by compress and by the loop, are the same offsets in the same order.

The replay's exchanges (and so TIES' selection, bit-equal to mergekit) depend on every stop and its order: both
ways must give numpy's answer for every key width the replay takes (16-bit and 32-bit keys, 64-bit packed
entries shifted), both comparisons, both scan directions, keys equal to the pivot, negative keys, and blocks that
start anywhere in the array.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mergesmith.kernels import block_stops, compiled

pytestmark = pytest.mark.skipif(not compiled.AVAILABLE, reason="numba is not installed")

WAYS = ["loop", "compress"]


def _expected(keys: np.ndarray, first: int, pivot: int, at_most: bool, backward: bool) -> np.ndarray:
    positions = first - np.arange(block_stops.BLOCK) if backward else first + np.arange(block_stops.BLOCK)
    block = keys[positions]
    return np.flatnonzero(block <= pivot if at_most else block >= pivot).astype(np.int32)


def _gather(way: str):
    compiled.load()
    if way == "compress":
        import llvmlite.binding as llvm

        if llvm.llvm_version_info < (19,):
            pytest.skip("LLVM older than 19 has no generic compress")
        return block_stops.stops_by_compress
    return block_stops.stops_by_loop


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype,shift", [(np.int16, 0), (np.int32, 0), (np.int64, 0), (np.int64, 30)])
def test_stops_are_numpys(way, dtype, shift):
    gather = _gather(way)
    rng = np.random.default_rng(7)
    n = 1000
    # few distinct keys, so that many equal the pivot; some negative (packed entries' signed keys)
    keys = rng.integers(-3, 9, size=n).astype(dtype)
    entries = (keys.astype(np.int64) << shift | rng.integers(0, 1 << shift, size=n) if shift else keys).astype(dtype)
    out = np.full(block_stops.BLOCK + block_stops.SPILL, -1, dtype=np.int32)
    for first, at_most, backward in itertools.product([0, 1, 5, 63, 200, n - 64], [True, False], [True, False]):
        start = first + block_stops.BLOCK - 1 if backward else first
        for pivot in (-3, 0, 4, 8):
            count = gather(entries, start, dtype(pivot), shift, at_most, backward, out)
            expected = _expected(keys, start, pivot, at_most, backward)
            assert count == expected.size
            np.testing.assert_array_equal(out[:count], expected)


def test_the_replay_uses_compress_where_the_target_has_avx512():
    compiled.load()
    assert block_stops.COMPRESS == block_stops.target_compresses()


def test_the_stops_compile_when_numba_was_loaded_first():
    """compiled.numba_extension runs a module's typing hook at its import when numba is loaded already (a process
    that loaded the kernel groups of other modules first): the hook must find everything it uses defined."""
    import subprocess
    import sys

    code = ("from mergesmith.kernels import compiled; compiled.load()\n"
            "from mergesmith.kernels import block_stops, introsort_replay\n"
            "assert introsort_replay.warm(), introsort_replay.KERNELS.error\n"
            "print(block_stops.COMPRESS)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("True", "False")


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
@pytest.mark.parametrize("n", [63, 64, 1000, 4099])
def test_the_compiled_window_pass_gives_numpys_mask_and_positions(dtype, n):
    """introsort_replay.window_and_followed (matching_bits a block at a time, the tail entry by entry) against
    sort_select's numpy path: the inside mask with keys wrapped below `first`, and the split keys' positions."""
    from mergesmith.kernels import introsort_replay, sort_select

    assert introsort_replay.warm()
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 40, size=n).astype(dtype)
    width = 0xFFFF if dtype == np.int16 else 0xFFFFFFFF
    for inside, split_keys in [((10, 20), [9, 21]), ((0, 39), []), (None, [7]), (None, [3, 30]), ((5, 5), [4])]:
        count = int(np.isin(keys, split_keys).sum())
        expected_mask, expected = np.zeros(n, dtype=np.bool_), np.empty(count, dtype=np.int64)
        sort_select._numpy_window_and_tracked(keys, inside, split_keys, expected_mask, expected)
        mask, followed = np.zeros(n, dtype=np.bool_), np.empty(count, dtype=np.int64)
        low, high = (dtype(split_keys[0]), dtype(split_keys[-1])) if split_keys else (dtype(-1), dtype(-1))
        first, span = inside if inside is not None else (0, 0)
        found = introsort_replay.window_and_followed(keys, dtype(first), span - first if inside else 0, width,
                                                     inside is not None, low, high, mask, followed)
        assert found == count
        np.testing.assert_array_equal(followed, expected)
        np.testing.assert_array_equal(mask, expected_mask)
