"""sort_select's introsort replay as one compiled loop: the same moves, made entry by entry in machine code.

Why: sort_select replays libstdc++'s introsort (the sort torch's CPU `sort` is) along the ranges that straddle
the ends of the wanted window, to find which entries the full sort puts there (TIES' and Breadcrumbs' magnitude
selection, bit-equal to mergekit). In numpy each Hoare partition is vectorised by counting and bisecting the
scans' stops, and the entries the window's ends cut are followed by a sorted tracker that numpy searches per
exchange: on the 1 B TIES bench merge that was 56% of the workers' time (bench/README.md, issue 21). Compiled,
the partition is what libstdc++ does, with the scans' stops gathered 64 entries at a time without a branch per
entry (the i-th stop from the left is exchanged with the i-th from the right, as in Hoare's loop, so the pairs
and the cut are Hoare's). The followed entries carry their starting position in an int32 array beside the keys,
swapped with every exchange, whether the entries are followed or not: 4 bytes an entry, and no test per swap.
Two cheaper-looking ways were measured slower on the 1 B bench's task vectors (~1.9% of their entries followed),
both with a test per gathered block of stops: a hash table keyed by position (8.8 ns an entry for the replay),
and the dense array swapped only in blocks holding a followed entry (7 ns); swapping always: 4.4-5.1 ns, without
following 2.3 (sort_select on `model.layers.3.mlp.up_proj.weight`'s two task vectors, one thread). A branch per
block mispredicts a third of the time when 70% of the blocks hold a followed entry.
tests/test_sort_select.py checks the replay against torch.sort and against the numpy replay.

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

ID_BYTES = 4
"""Bytes an entry the replay adds when it follows entries (their ids, int32)."""

@compiled
def _followed(entry, followed_low, followed_high):
    return entry == followed_low or entry == followed_high


@compiled
def _exchange(entries, i, j, ids, follow):
    """Swap entries i and j, and their ids where entries are followed (the ids of entries that are not followed
    are junk, swapped along: cheaper than a test per swap)."""
    a = entries[i]
    entries[i] = entries[j]
    entries[j] = a
    if follow:
        t = ids[i]
        ids[i] = ids[j]
        ids[j] = t


@compiled
def _precedes(a, b, descending):
    return a > b if descending else a < b


@compiled
def _gathered_exchanges(entries, low, high, pivot, descending, key_shift, ids, follow, buffers):
    """Hoare's exchanges of [low, high] (inclusive) around `pivot`, a block of each scan's stops at a time, while
    the entries not yet scanned fill two blocks; returns Hoare's (i, j) state for the entry-by-entry finish."""
    left, right = buffers
    left_count = left_used = right_count = right_used = 0
    left_start = low
    right_start = high
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
            high -= BLOCK
        pairs = min(left_count - left_used, right_count - right_used)
        for q in range(pairs):
            _exchange(entries, left_start + left[left_used + q], right_start - right[right_used + q], ids, follow)
        left_used += pairs
        right_used += pairs
    # the next forward stop (or the first entry not scanned), and one past the next backward stop
    i = left_start + left[left_used] if left_used < left_count else low
    j = right_start - right[right_used] + 1 if right_used < right_count else high + 1
    return i, j


@compiled
def _partition(entries, first, last, descending, key_shift, ids, follow, buffers):
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
    _exchange(entries, first, picked, ids, follow)
    pivot = entries[first] >> key_shift
    i, j = _gathered_exchanges(entries, first + 1, last - 1, pivot, descending, key_shift, ids, follow, buffers)
    while True:
        while _precedes(entries[i] >> key_shift, pivot, descending):
            i += 1
        j -= 1
        while _precedes(pivot, entries[j] >> key_shift, descending):
            j -= 1
        if not i < j:
            return i
        _exchange(entries, i, j, ids, follow)
        i += 1


@compiled
def _sort_leaf(entries, first, last, descending, key_shift, ids, follow):
    """Stably sort [first, last) (at most 16 entries) by key, as the final insertion sort leaves it."""
    for q in range(first + 1, last):
        key = entries[q]
        ident = ids[q] if follow else 0
        r = q
        while r > first and _precedes(key >> key_shift, entries[r - 1] >> key_shift, descending):
            entries[r] = entries[r - 1]
            if follow:
                ids[r] = ids[r - 1]
            r -= 1
        entries[r] = key
        if follow:
            ids[r] = ident


@compiled
def replay(entries, lo, hi, descending, key_shift, followed_low, followed_high, followed, window, depth_budget):
    """Replay the introsort on `entries` (keys: entries >> key_shift) in place along the ranges straddling lo or
    hi, with `depth_budget` partitions along any path (libstdc++: 2 floor(log2 n)). The entries equal to
    followed_low or followed_high, at the positions `followed` at the start, are followed (ID_BYTES an entry of
    scratch; none without followed entries): window[p] is set for each such starting position p whose entry ends
    in [lo, hi). False where libstdc++ would heap-sort a range
    (a spent depth budget): only the full sort can say then."""
    n = entries.shape[0]
    follow = followed.shape[0] > 0
    ids = np.empty(n if follow else 1, dtype=np.int32)  # positions are below 2**31 (sort_select checks)
    for q in range(followed.shape[0]):
        ids[followed[q]] = followed[q]
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
            _sort_leaf(entries, first, last, descending, key_shift, ids, follow)
            continue
        if budget == 0:
            return False
        cut = _partition(entries, first, last, descending, key_shift, ids, follow, buffers)
        stack[top, 0], stack[top, 1], stack[top, 2] = first, cut, budget - 1
        stack[top + 1, 0], stack[top + 1, 1], stack[top + 1, 2] = cut, last, budget - 1
        top += 2
    if follow:  # a range's entries stay where they are once it no longer straddles lo or hi
        for p in range(lo, hi):
            if _followed(entries[p], followed_low, followed_high):
                window[ids[p]] = True
    return True


__all__ = ["AVAILABLE", "ID_BYTES", "replay"]
