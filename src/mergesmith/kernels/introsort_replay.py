"""sort_select's introsort replay as one compiled loop: the same moves, made entry by entry in machine code.

Why: sort_select replays libstdc++'s introsort (the sort torch's CPU `sort` is) along the ranges that straddle
the ends of the wanted window, to find which entries the full sort puts there (TIES' and Breadcrumbs' magnitude
selection, bit-equal to mergekit). In numpy each Hoare partition is vectorised by counting and bisecting the
scans' stops, and the entries the window's ends cut are followed by a sorted tracker that numpy searches per
exchange: on the 1 B TIES bench merge that was 56% of the workers' time (bench/README.md, issue 21). Compiled,
the partition is what libstdc++ does, with the scans' stops gathered 64 entries at a time without a branch per
entry (block_stops: by a compare and a compress where the CPU has AVX-512; the i-th stop from the left is
exchanged with the i-th from the right, as in Hoare's loop, so the pairs and the cut are Hoare's). On tensors of
up to IDS_MAX_ENTRIES the followed entries carry their starting position
in an int32 array beside the keys, swapped with every exchange, whether the entries are followed or not: 4 bytes
an entry, and no test per swap. Timed ad hoc on `model.layers.3.mlp.up_proj.weight`'s two task vectors of the 1 B
bench (~1.9% of their entries followed; the replay alone, one thread, ns an entry; `python
bench/profile_compiled.py` times the whole selection on synthetic data): ids 4.7-5.5; without
following 2.3-2.6; stop 26's hash table keyed by position, tested per gathered block of stops, 8.8-9.5. Larger
tensors keep a hash table of the followed entries only (memory: see IDS_MAX_ENTRIES); in this module's shared
partition code that way measures 14-16 ns on the same data, slower than stop 26's dedicated loop (8.8) for a
cause not found yet (bench/README.md, "Fifth round"). Which way is told by the type of the `track` argument,
so numba compiles the partition once per way with nothing tested per exchange; a mode tested at run time, or
an exchange too big to inline, measured up to 5x slower.
tests/test_sort_select.py checks every way against torch.sort and against the numpy replay.

The moves, as sort_select's module docstring states them (libstdc++'s bits/stl_algo.h): while a range holds
more than 16 entries, move the median of (first + 1, middle, last - 1) to first, Hoare-partition the rest
around it, and go on with both parts with one less depth budget (2 floor(log2 n) at the top; spent: the
range would be heap-sorted, and the replay gives up); ranges of at most 16 entries end stably sorted.
"""

from __future__ import annotations

import numpy as np

from .block_stops import BLOCK, SPILL, backward_stops, forward_stops, lowest_bit, matching_bits
from .compiled import AVAILABLE, KernelGroup, compiled, numba_extension

INSERTION_THRESHOLD = 16
"""libstdc++'s `_S_threshold` (sort_select's numpy replay uses this one too)."""

ID_BYTES = 4
"""Bytes an entry the replay adds when it follows entries by their ids (int32)."""

IDS_MAX_ENTRIES = 1 << 24
"""Up to this many entries (64 MiB of ids) the followed entries carry ids; above it, a hash table of only the
followed entries keeps the selection's memory at its keys and mask (the planner's charge, magnitude_blocks'
totals_memory, says which): a 7 B model's 45 M-entry MLP matrices would otherwise need 180 MB more each, and
the 0.25 B bench set's embedding would no longer fit issue 17's --max-memory 300MB. Above it the running merge may
still lend the ids' memory where it has room (sort_select.lending: the table costs ~29 ns an entry on the 1b
embedding against ~5 by ids)."""

MAX_TRACKED_SHARE = 1 / 32
"""Above this share of all entries, the table (8 bytes a slot, at most half full) would cost more than the numpy
tracker; sort_select then replays a tensor too large for ids with numpy."""


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@compiled
def _home(position, shift):
    """The table slot a position hashes to (Fibonacci hashing: the top bits of position * 2**64 / phi)."""
    return np.int64((np.uint64(position) * _GOLDEN) >> np.uint64(shift))


@compiled
def _find(slot_position, position, shift, mask):
    slot = _home(position, shift)
    while slot_position[slot] != position:
        slot = (slot + 1) & mask
    return slot


@compiled
def _insert(slot_position, slot_original, position, original, shift, mask):
    slot = _home(position, shift)
    while slot_position[slot] != -1:
        slot = (slot + 1) & mask
    slot_position[slot] = position
    slot_original[slot] = original


@compiled
def _delete(slot_position, slot_original, slot, shift, mask):
    """Empty a slot of the linear-probing table, moving back the entries after it that would be cut off."""
    hole = slot
    while True:
        slot_position[hole] = -1
        probe = hole
        while True:
            probe = (probe + 1) & mask
            if slot_position[probe] == -1:
                return
            home = _home(slot_position[probe], shift)
            if hole <= probe:
                if hole < home <= probe:
                    continue
            elif home > hole or home <= probe:
                continue
            slot_position[hole] = slot_position[probe]
            slot_original[hole] = slot_original[probe]
            hole = probe
            break


@compiled
def _followed(entry, followed_low, followed_high):
    return entry == followed_low or entry == followed_high


@compiled
def _any_followed(entries, start, followed_low, followed_high):
    """Whether the BLOCK entries from `start` hold a followed one (no branch per entry)."""
    found = 0
    for t in range(BLOCK):
        entry = entries[start + t]
        found += (entry == followed_low) + (entry == followed_high)
    return found > 0


@compiled
def _precedes(a, b, descending):
    return a > b if descending else a < b


# How the entries are followed is told by the type of `track` (see the module docstring):
# - None: nothing is followed (no followed entries, or packed entries that carry their own index);
# - an int32 array, an id an entry: every exchange swaps the ids too, followed or not (cheaper than a test);
# - a tuple (followed_low, followed_high, slot_position, slot_original, shift, mask): the followed entries'
#   positions in a hash table, updated where a block holds a followed entry.


def _exchange(entries, i, j, track):
    """Swap entries i and j, and what follows them."""


def _block_follows(entries, start, track):
    """Whether an exchange in the BLOCK entries from `start` must update `track`."""


def _leaf_tag(entries, position, track):
    """What follows the entry at `position`, taken out of `track` while a leaf is sorted (-1: nothing)."""


def _leaf_put(position, tag, track):
    """Put a _leaf_tag back, for the entry now at `position`."""


def _swap(entries, i, j):
    a = entries[i]
    entries[i] = entries[j]
    entries[j] = a


_swap = compiled(_swap)


@numba_extension
def _typing() -> None:
    """The overloads that pick how an exchange and a leaf follow entries, by the type of `track` (none, ids,
    table), registered once numba is loaded (compiled.numba_extension)."""
    from numba import types
    from numba.extending import overload

    @overload(_exchange)
    def _exchange_by_track(entries, i, j, track):
        if isinstance(track, types.NoneType):
            return lambda entries, i, j, track: _swap(entries, i, j)
        if isinstance(track, types.Array):
            def by_ids(entries, i, j, track):
                _swap(entries, i, j)
                _swap(track, i, j)
            return by_ids
        def by_table(entries, i, j, track):
            a = entries[i]
            b = entries[j]
            entries[i] = b
            entries[j] = a
            moves_a = _followed(a, track[0], track[1])
            moves_b = _followed(b, track[0], track[1])
            if moves_a or moves_b:
                _, _, slot_position, slot_original, shift, mask = track
                if moves_a and moves_b:
                    slot_i = _find(slot_position, i, shift, mask)
                    slot_j = _find(slot_position, j, shift, mask)
                    original = slot_original[slot_i]
                    slot_original[slot_i] = slot_original[slot_j]
                    slot_original[slot_j] = original
                else:
                    slot = _find(slot_position, i if moves_a else j, shift, mask)
                    original = slot_original[slot]
                    _delete(slot_position, slot_original, slot, shift, mask)
                    _insert(slot_position, slot_original, j if moves_a else i, original, shift, mask)
        return by_table

    @overload(_block_follows)
    def _block_follows_by_track(entries, start, track):
        if isinstance(track, types.NoneType):
            return lambda entries, start, track: False
        if isinstance(track, types.Array):
            return lambda entries, start, track: True
        return lambda entries, start, track: _any_followed(entries, start, track[0], track[1])

    @overload(_leaf_tag)
    def _leaf_tag_by_track(entries, position, track):
        if isinstance(track, types.NoneType):
            return lambda entries, position, track: np.int64(-1)
        if isinstance(track, types.Array):
            return lambda entries, position, track: np.int64(track[position])
        return lambda entries, position, track: _take_from_table(entries, position, track)

    @overload(_leaf_put)
    def _leaf_put_by_track(position, tag, track):
        if isinstance(track, types.NoneType):
            return lambda position, tag, track: None
        if isinstance(track, types.Array):
            def put_id(position, tag, track):
                track[position] = tag
            return put_id
        return lambda position, tag, track: _put_in_table(position, tag, track)


@compiled
def _take_from_table(entries, position, track):
    followed_low, followed_high, slot_position, slot_original, shift, mask = track
    if not _followed(entries[position], followed_low, followed_high):
        return np.int64(-1)
    slot = _find(slot_position, position, shift, mask)
    original = np.int64(slot_original[slot])
    _delete(slot_position, slot_original, slot, shift, mask)
    return original


@compiled
def _put_in_table(position, tag, track):
    if tag >= 0:
        _, _, slot_position, slot_original, shift, mask = track
        _insert(slot_position, slot_original, position, tag, shift, mask)


@compiled
def _gathered_exchanges(entries, low, high, pivot, descending, key_shift, track, buffers):
    """Hoare's exchanges of [low, high] (inclusive) around `pivot`, a block of each scan's stops at a time, while
    the entries not yet scanned fill two blocks; returns Hoare's (i, j) state for the entry-by-entry finish."""
    left, right = buffers
    left_follows = right_follows = False
    left_count = left_used = right_count = right_used = 0
    left_start = low
    right_start = high
    while True:
        if left_used == left_count:
            if high - low + 1 < 2 * BLOCK:
                break
            left_start, left_count, left_used = low, 0, 0
            # a forward stop: an entry the pivot does not precede (descending: key <= pivot)
            left_count = forward_stops(entries, left_start, pivot, key_shift, descending, left)
            left_follows = _block_follows(entries, left_start, track)
            low += BLOCK
        if right_used == right_count:
            if high - low + 1 < BLOCK:
                break
            right_start, right_count, right_used = high, 0, 0
            # a backward stop: an entry that does not precede the pivot (descending: key >= pivot)
            right_count = backward_stops(entries, right_start, pivot, key_shift, not descending, right)
            right_follows = _block_follows(entries, right_start - BLOCK + 1, track)
            high -= BLOCK
        pairs = min(left_count - left_used, right_count - right_used)
        if left_follows or right_follows:
            for q in range(pairs):
                _exchange(entries, left_start + left[left_used + q], right_start - right[right_used + q], track)
        else:  # nothing in these blocks is followed: plain swaps
            for q in range(pairs):
                i, j = left_start + left[left_used + q], right_start - right[right_used + q]
                entries[i], entries[j] = entries[j], entries[i]
        left_used += pairs
        right_used += pairs
    # the next forward stop (or the first entry not scanned), and one past the next backward stop
    i = left_start + left[left_used] if left_used < left_count else low
    j = right_start - right[right_used] + 1 if right_used < right_count else high + 1
    return i, j


@compiled
def _partition(entries, first, last, descending, key_shift, track, buffers):
    """libstdc++'s `__unguarded_partition_pivot` on [first, last); returns the cut."""
    middle = first + (last - first) // 2
    a, b, c = entries[first + 1] >> key_shift, entries[middle] >> key_shift, entries[last - 1] >> key_shift
    if _precedes(a, b, descending):
        if _precedes(b, c, descending):
            picked = middle
        elif _precedes(a, c, descending):
            picked = last - 1
        else:
            picked = first + 1
    elif _precedes(a, c, descending):
        picked = first + 1
    elif _precedes(b, c, descending):
        picked = last - 1
    else:
        picked = middle
    _exchange(entries, first, picked, track)
    pivot = entries[first] >> key_shift
    i, j = _gathered_exchanges(entries, first + 1, last - 1, pivot, descending, key_shift, track, buffers)
    while True:
        while _precedes(entries[i] >> key_shift, pivot, descending):
            i += 1
        j -= 1
        while _precedes(pivot, entries[j] >> key_shift, descending):
            j -= 1
        if not i < j:
            return i
        _exchange(entries, i, j, track)
        i += 1


@compiled
def _sort_leaf(entries, first, last, descending, key_shift, track):
    """Stably sort [first, last) (at most 16 entries) by key, as the final insertion sort leaves it, with what
    follows the entries."""
    count = last - first
    keys = np.empty(INSERTION_THRESHOLD, dtype=entries.dtype)
    tags = np.empty(INSERTION_THRESHOLD, dtype=np.int64)
    for q in range(count):
        keys[q] = entries[first + q]
        tags[q] = _leaf_tag(entries, first + q, track)
    for q in range(1, count):
        key, tag = keys[q], tags[q]
        r = q
        while r > 0 and _precedes(key >> key_shift, keys[r - 1] >> key_shift, descending):
            keys[r] = keys[r - 1]
            tags[r] = tags[r - 1]
            r -= 1
        keys[r] = key
        tags[r] = tag
    for q in range(count):
        entries[first + q] = keys[q]
        _leaf_put(first + q, tags[q], track)


@compiled
def _introsort(entries, lo, hi, descending, key_shift, depth_budget, track):
    """The replay's moves (see replay), following entries by `track`."""
    buffers = (np.empty(BLOCK + SPILL, dtype=np.int32), np.empty(BLOCK + SPILL, dtype=np.int32))
    stack = np.empty((2 * depth_budget + 8, 3), dtype=np.int64)  # (first, last, depth budget left)
    stack[0, 0], stack[0, 1], stack[0, 2] = 0, entries.shape[0], depth_budget
    top = 1
    while top > 0:
        top -= 1
        first, last, budget = stack[top, 0], stack[top, 1], stack[top, 2]
        if not (first < lo < last or first < hi < last):
            continue  # its set of entries is final
        if last - first <= INSERTION_THRESHOLD:
            _sort_leaf(entries, first, last, descending, key_shift, track)
            continue
        if budget == 0:
            return False
        cut = _partition(entries, first, last, descending, key_shift, track, buffers)
        stack[top, 0], stack[top, 1], stack[top, 2] = first, cut, budget - 1
        stack[top + 1, 0], stack[top + 1, 1], stack[top + 1, 2] = cut, last, budget - 1
        top += 2
    return True


@compiled
def _window_by_ids(entries, lo, hi, followed_low, followed_high, ids, window):
    """A range's entries stay where they are once it no longer straddles lo or hi: the followed ones in [lo, hi)
    are the window's. Found a block at a time by block_stops.matching_bits (the followed are a few percent of the
    entries): 0.11 against 0.86 ns an entry of [lo, hi) entry by entry (one thread, 11.5 M bf16 keys, AMD EPYC
    family 25)."""
    p = lo
    while p + BLOCK <= hi:
        bits = matching_bits(entries, p, followed_low, followed_high)
        while bits:
            window[ids[p + lowest_bit(bits)]] = True
            bits &= bits - np.uint64(1)
        p += BLOCK
    for q in range(p, hi):
        if _followed(entries[q], followed_low, followed_high):
            window[ids[q]] = True


@compiled
def window_and_followed(keys, first, span, width_mask, inside, low, high, mask, followed):
    """One pass over a selection's keys for sort_select: where `inside`, mask[i] = whether keys[i] lies in
    [first, first + span] (keys - first wrapped to the keys' width, `width_mask`, then compared unsigned: numpy's
    way there); and the positions of the keys equal to `low` or `high` (the keys the window's ends split) into
    `followed`, ascending; returns their count. 0.12 against 0.36 ns an entry for numpy's subtract, compare, equal and
    flatnonzero (one thread, 11.5 M bf16 keys, AMD EPYC family 25)."""
    n = keys.shape[0]
    whole = n - n % BLOCK
    count = 0
    base = np.int64(first)
    for start in range(0, whole, BLOCK):
        if inside:
            block = keys[start : start + BLOCK]
            flags = mask[start : start + BLOCK]
            for t in range(BLOCK):
                flags[t] = ((np.int64(block[t]) - base) & width_mask) <= span
        bits = matching_bits(keys, start, low, high)
        while bits:
            followed[count] = start + lowest_bit(bits)
            count += 1
            bits &= bits - np.uint64(1)
    for q in range(whole, n):
        if inside:
            mask[q] = ((np.int64(keys[q]) - base) & width_mask) <= span
        if _followed(keys[q], low, high):
            followed[count] = q
            count += 1
    return count


@compiled
def _set_ids(ids, followed):
    """The followed entries' ids are their starting positions (below 2**31: sort_select checks); the others' ids
    are never read, so whatever the buffer held stays."""
    for q in range(followed.shape[0]):
        ids[followed[q]] = followed[q]


@compiled
def _table_of(followed, followed_low, followed_high):
    capacity = 16
    while capacity < 2 * followed.shape[0] + 2:
        capacity *= 2
    bits = 0
    while (1 << bits) < capacity:
        bits += 1
    slot_position = np.full(capacity, -1, dtype=np.int32)
    slot_original = np.empty(capacity, dtype=np.int32)
    for q in range(followed.shape[0]):
        _insert(slot_position, slot_original, followed[q], followed[q], 64 - bits, capacity - 1)
    return followed_low, followed_high, slot_position, slot_original, 64 - bits, capacity - 1


@compiled
def _window_by_table(lo, hi, track, window):
    _, _, slot_position, slot_original, _, _ = track
    for slot in range(slot_position.shape[0]):
        position = slot_position[slot]
        if position != -1 and lo <= position < hi:
            window[slot_original[slot]] = True


def replay(entries, lo, hi, descending, key_shift, followed_low, followed_high, followed, window, depth_budget,
           ids=None) -> bool:
    """Replay the introsort on `entries` (keys: entries >> key_shift) in place along the ranges straddling lo or
    hi, with `depth_budget` partitions along any path (libstdc++: 2 floor(log2 n)). The entries equal to
    followed_low or followed_high, at the positions `followed` at the start, are followed (by ids in `ids`, an int32
    buffer of at least as many entries, whose contents do not matter; without it by a table of ~16 bytes a
    followed entry): window[p] is set for each such
    starting position p whose entry ends in [lo, hi). False where libstdc++ would heap-sort a range (a spent
    depth budget): only the full sort can say then."""
    if followed.shape[0] == 0:
        return bool(_introsort(entries, lo, hi, descending, key_shift, depth_budget, None))
    if ids is not None:
        ids = ids[: entries.shape[0]]
        _set_ids(ids, followed)
        if not _introsort(entries, lo, hi, descending, key_shift, depth_budget, ids):
            return False
        _window_by_ids(entries, lo, hi, followed_low, followed_high, ids, window)
        return True
    table = _table_of(followed, followed_low, followed_high)
    if not _introsort(entries, lo, hi, descending, key_shift, depth_budget, table):
        return False
    _window_by_table(lo, hi, table, window)
    return True


@compiled
def key_counts(keys, limit, counts):
    """counts[k] += the number of entries of `keys` (16-bit magnitude keys) equal to k; False, with `counts` left
    partial, where a key lies outside [0, limit] (a negative key or a nan's: the caller then does not select by keys).

    Why compiled: sort_select's histogram of a selection's keys was numpy's min and max (the range check) and
    torch's bincount, three passes: 0.74 ns an entry against 0.33 here (one thread, the 11.5 M bf16 magnitudes of
    an MLP task vector of the 1 B bench, AMD EPYC family 25), ~0.9 CPU-s of the 1b TIES merge's selections over
    2.2 G entries. Four partial histograms, merged at the end: a run of equal keys (zeros, clustered magnitudes)
    then adds to four counters in turn instead of waiting on one."""
    n = keys.shape[0]
    size = counts.shape[0]
    parts = np.zeros((4, size), dtype=np.int64)
    p0, p1, p2, p3 = parts[0], parts[1], parts[2], parts[3]
    top = np.uint16(limit)  # a negative key, seen unsigned, is above any limit
    quads = n // 4
    for q in range(quads):
        i = 4 * q
        a, b, c, d = np.uint16(keys[i]), np.uint16(keys[i + 1]), np.uint16(keys[i + 2]), np.uint16(keys[i + 3])
        if a > top or b > top or c > top or d > top:
            return False
        p0[a] += 1
        p1[b] += 1
        p2[c] += 1
        p3[d] += 1
    for i in range(4 * quads, n):
        a = np.uint16(keys[i])
        if a > top:
            return False
        p0[a] += 1
    for k in range(size):
        counts[k] += p0[k] + p1[k] + p2[k] + p3[k]
    return True


def _compile_all() -> None:
    """Compile (or load from numba's cache) the replay for the key arrays sort_select gives it (16- and 32-bit
    keys, packed 64-bit entries) and each way of following, on tiny inputs."""
    window = np.zeros(2, dtype=np.bool_)
    for dtype in (np.int16, np.int32, np.int64):
        none = dtype(-1)
        replay(np.zeros(2, dtype=dtype), 0, 1, True, 0, none, none, np.empty(0, dtype=np.int64), window, 0)
    for dtype in (np.int16, np.int32):
        both = np.arange(2, dtype=np.int64)  # the positions of every entry equal to the followed key (0)
        for ids in (np.empty(2, dtype=np.int32), None):
            replay(np.zeros(2, dtype=dtype), 0, 1, True, 0, dtype(0), dtype(0), both, window, 0, ids)
    key_counts(np.zeros(5, dtype=np.int16), 1, np.zeros(2, dtype=np.int64))
    for dtype in (np.int16, np.int32):
        window_and_followed(np.zeros(2, dtype=dtype), dtype(0), 0, 0xFFFF, True, dtype(0), dtype(0),
                            np.zeros(2, dtype=np.bool_), np.zeros(2, dtype=np.int64))


KERNELS = KernelGroup("introsort_replay", _compile_all)
"""The replay, used by sort_select only once compiled (the longest compile here: ~17 s on a fresh install): see
compiled.KernelGroup."""


def warm() -> bool:
    """Compile (or load) the replay now and wait for it: whether it is ready."""
    return KERNELS.wait()


__all__ = ["AVAILABLE", "KERNELS", "ID_BYTES", "IDS_MAX_ENTRIES", "MAX_TRACKED_SHARE", "key_counts", "replay", "warm",
           "window_and_followed"]
