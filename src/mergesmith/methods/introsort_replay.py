"""sort_select's introsort replay as one compiled loop: the same moves, made entry by entry in machine code.

Why: sort_select replays libstdc++'s introsort (the sort torch's CPU `sort` is) along the ranges that straddle
the ends of the wanted window, to find which entries the full sort puts there (TIES' and Breadcrumbs' magnitude
selection, bit-equal to mergekit). In numpy each Hoare partition is vectorised by counting and bisecting the
scans' stops, and the entries the window's ends cut are followed by a sorted tracker that numpy searches per
exchange: on the 1 B TIES bench merge that was 56% of the workers' time (bench/README.md, issue 21). Compiled,
the partition is what libstdc++ does, with the scans' stops gathered 64 entries at a time without a branch per
entry (the i-th stop from the left is exchanged with the i-th from the right, as in Hoare's loop, so the pairs
and the cut are Hoare's), and the followed entries live in a small hash table keyed by their position.
`python bench/profile_compiled.py` (half of 8 M bf16 magnitudes kept, one thread): the whole selection 18.0 -> 11.9
ns an entry (tests/test_sort_select.py checks it against torch.sort and against the numpy replay).

The moves, as sort_select's module docstring states them (libstdc++'s bits/stl_algo.h): while a range holds
more than 16 entries, move the median of (first + 1, middle, last - 1) to first, Hoare-partition the rest
around it, and go on with both parts with one less depth budget (2 floor(log2 n) at the top; spent: the
range would be heap-sorted, and the replay gives up); ranges of at most 16 entries end stably sorted.
"""

from __future__ import annotations

import numpy as np

from .compiled import AVAILABLE, compiled

BLOCK = 64
"""Entries whose stops one scan gathers at a time."""

INSERTION_THRESHOLD = 16
"""libstdc++'s `_S_threshold` (sort_select's numpy replay uses this one too)."""

MAX_TRACKED_SHARE = 1 / 32
"""Above this share of all entries, the followed entries' table (8 bytes a slot, at most half full) would cost
more than the numpy tracker; sort_select then replays with numpy."""

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
def _exchange(entries, i, j, followed_low, followed_high, slot_position, slot_original, shift, mask):
    """Swap entries i and j, and the positions of the followed ones among them."""
    a = entries[i]
    b = entries[j]
    entries[i] = b
    entries[j] = a
    moves_a = _followed(a, followed_low, followed_high)
    moves_b = _followed(b, followed_low, followed_high)
    if moves_a and moves_b:
        slot_i = _find(slot_position, i, shift, mask)
        slot_j = _find(slot_position, j, shift, mask)
        original = slot_original[slot_i]
        slot_original[slot_i] = slot_original[slot_j]
        slot_original[slot_j] = original
    elif moves_a:
        slot = _find(slot_position, i, shift, mask)
        original = slot_original[slot]
        _delete(slot_position, slot_original, slot, shift, mask)
        _insert(slot_position, slot_original, j, original, shift, mask)
    elif moves_b:
        slot = _find(slot_position, j, shift, mask)
        original = slot_original[slot]
        _delete(slot_position, slot_original, slot, shift, mask)
        _insert(slot_position, slot_original, i, original, shift, mask)


@compiled
def _precedes(a, b, descending):
    return a > b if descending else a < b


@compiled
def _any_followed(entries, start, followed_low, followed_high):
    """Whether the BLOCK entries from `start` hold a followed one (no branch per entry)."""
    found = 0
    for t in range(BLOCK):
        entry = entries[start + t]
        found += (entry == followed_low) + (entry == followed_high)
    return found > 0


@compiled
def _gathered_exchanges(entries, low, high, pivot, descending, key_shift, followed_low, followed_high, table, buffers):
    """Hoare's exchanges of [low, high] (inclusive) around `pivot`, a block of each scan's stops at a time, while
    the entries not yet scanned fill two blocks; returns Hoare's (i, j) state for the entry-by-entry finish."""
    slot_position, slot_original, shift, mask = table
    left, right = buffers
    left_count = left_used = right_count = right_used = 0
    left_start = low
    right_start = high
    left_follows = right_follows = False
    while True:
        if left_used == left_count:
            if high - low + 1 < 2 * BLOCK:
                break
            left_start, left_count, left_used = low, 0, 0
            if descending:  # a forward stop: an entry the pivot does not follow
                for t in range(BLOCK):
                    left[left_count] = t
                    left_count += (entries[left_start + t] >> key_shift) <= pivot
            else:
                for t in range(BLOCK):
                    left[left_count] = t
                    left_count += (entries[left_start + t] >> key_shift) >= pivot
            left_follows = _any_followed(entries, left_start, followed_low, followed_high)
            low += BLOCK
        if right_used == right_count:
            if high - low + 1 < BLOCK:
                break
            right_start, right_count, right_used = high, 0, 0
            if descending:  # a backward stop: an entry that does not follow the pivot
                for t in range(BLOCK):
                    right[right_count] = t
                    right_count += (entries[right_start - t] >> key_shift) >= pivot
            else:
                for t in range(BLOCK):
                    right[right_count] = t
                    right_count += (entries[right_start - t] >> key_shift) <= pivot
            right_follows = _any_followed(entries, right_start - BLOCK + 1, followed_low, followed_high)
            high -= BLOCK
        pairs = min(left_count - left_used, right_count - right_used)
        if left_follows or right_follows:
            for q in range(pairs):
                _exchange(entries, left_start + left[left_used + q], right_start - right[right_used + q],
                          followed_low, followed_high, slot_position, slot_original, shift, mask)
        else:  # nothing followed moves: plain swaps (most blocks; the checks per swap doubled the replay's time)
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
def _partition(entries, first, last, descending, key_shift, followed_low, followed_high, table, buffers):
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
    slot_position, slot_original, shift, mask = table
    _exchange(entries, first, picked, followed_low, followed_high, slot_position, slot_original, shift, mask)
    pivot = entries[first] >> key_shift
    i, j = _gathered_exchanges(entries, first + 1, last - 1, pivot, descending, key_shift, followed_low,
                               followed_high, table, buffers)
    while True:
        while _precedes(entries[i] >> key_shift, pivot, descending):
            i += 1
        j -= 1
        while _precedes(pivot, entries[j] >> key_shift, descending):
            j -= 1
        if not i < j:
            return i
        _exchange(entries, i, j, followed_low, followed_high, slot_position, slot_original, shift, mask)
        i += 1


@compiled
def _sort_leaf(entries, first, last, descending, key_shift, followed_low, followed_high, table):
    """Stably sort [first, last) (at most 16 entries) by key, as the final insertion sort leaves it."""
    slot_position, slot_original, shift, mask = table
    count = last - first
    keys = np.empty(INSERTION_THRESHOLD, dtype=entries.dtype)
    originals = np.full(INSERTION_THRESHOLD, -1, dtype=np.int64)
    for q in range(count):
        keys[q] = entries[first + q]
        if _followed(keys[q], followed_low, followed_high):
            slot = _find(slot_position, first + q, shift, mask)
            originals[q] = slot_original[slot]
            _delete(slot_position, slot_original, slot, shift, mask)
    for q in range(1, count):
        key, original = keys[q], originals[q]
        r = q
        while r > 0 and _precedes(key >> key_shift, keys[r - 1] >> key_shift, descending):
            keys[r] = keys[r - 1]
            originals[r] = originals[r - 1]
            r -= 1
        keys[r] = key
        originals[r] = original
    for q in range(count):
        entries[first + q] = keys[q]
        if originals[q] >= 0:
            _insert(slot_position, slot_original, first + q, originals[q], shift, mask)


@compiled
def replay(entries, lo, hi, descending, key_shift, followed_low, followed_high, followed, window, depth_budget):
    """Replay the introsort on `entries` (keys: entries >> key_shift) in place along the ranges straddling lo or
    hi, with `depth_budget` partitions along any path (libstdc++: 2 floor(log2 n)). The entries equal to
    followed_low or followed_high, at the positions `followed` at the start, are followed: window[p] is set for
    each such starting position p whose entry ends in [lo, hi). False where libstdc++ would heap-sort a range
    (a spent depth budget): only the full sort can say then."""
    n = entries.shape[0]
    capacity = 16
    while capacity < 2 * followed.shape[0] + 2:
        capacity *= 2
    bits = 0
    while (1 << bits) < capacity:
        bits += 1
    slot_position = np.full(capacity, -1, dtype=np.int32)  # positions are below 2**31 (sort_select checks)
    slot_original = np.empty(capacity, dtype=np.int32)
    table = (slot_position, slot_original, 64 - bits, capacity - 1)
    for q in range(followed.shape[0]):
        _insert(slot_position, slot_original, followed[q], followed[q], 64 - bits, capacity - 1)
    buffers = (np.empty(BLOCK, dtype=np.int64), np.empty(BLOCK, dtype=np.int64))
    stack = np.empty((2 * depth_budget + 8, 3), dtype=np.int64)  # (first, last, depth budget left)
    stack[0, 0], stack[0, 1], stack[0, 2] = 0, n, depth_budget
    top = 1
    while top > 0:
        top -= 1
        first, last, budget = stack[top, 0], stack[top, 1], stack[top, 2]
        if not (first < lo < last or first < hi < last):
            continue  # its set of entries is final
        if last - first <= INSERTION_THRESHOLD:
            _sort_leaf(entries, first, last, descending, key_shift, followed_low, followed_high, table)
            continue
        if budget == 0:
            return False
        cut = _partition(entries, first, last, descending, key_shift, followed_low, followed_high, table, buffers)
        stack[top, 0], stack[top, 1], stack[top, 2] = first, cut, budget - 1
        stack[top + 1, 0], stack[top + 1, 1], stack[top + 1, 2] = cut, last, budget - 1
        top += 2
    for slot in range(capacity):
        position = slot_position[slot]
        if position != -1 and lo <= position < hi:
            window[slot_original[slot]] = True
    return True


__all__ = ["AVAILABLE", "MAX_TRACKED_SHARE", "replay"]
