"""Which entries torch's CPU sort puts in a window of positions, found without sorting everything.

Why this exists: TIES keeps the k largest magnitudes of each task vector and Breadcrumbs a middle band of
them; mergekit 0.1.5 picks both with a full `torch.sort`/`torch.argsort` of the magnitudes. bf16 magnitudes
repeat a lot, so *which* of the equal magnitudes at the threshold survive depends on the sort's algorithm,
and torch's CPU sort is not stable: it is libstdc++'s `std::sort`, an introsort. A selection algorithm
(kthvalue, topk) picks another subset of the ties and breaks bit-equality with mergekit; the full sort costs
n log n on one core and was nearly the whole cost of a TIES merge (about 1 CPU-second per 11 M entries).

So we replay that introsort move for move, but only where it matters. An introsort step partitions a range
around a pivot and never moves an element across the cut again, so a range that does not straddle an end
of the wanted window [lo, hi) already holds its final *set* of entries, whatever order the rest of the sort
would give it. Following only the (at most two) ranges that straddle lo or hi is a quickselect making
exactly the sort's moves: expected O(n) instead of O(n log n).

libstdc++ (bits/stl_algo.h), which this mirrors:
- `__introsort_loop`: while a range has more than 16 entries: if its depth budget (2 floor(log2 n) at the
  top) is spent, heap-sort it; else partition it with `__unguarded_partition_pivot` and go on with both parts,
  each with the budget minus one;
- `__unguarded_partition_pivot`: move the median of (first+1, middle, last-1) to first, then Hoare-partition
  [first+1, last) around it: scan forward while an entry goes before the pivot, backward while the pivot
  goes before the entry, swap the two, repeat until the scans cross;
- `__final_insertion_sort`: one insertion sort over the whole array. It is stable and, after the partitions,
  never moves an entry out of its leaf range (at most 16 entries), so each leaf ends up stably sorted.
A heap-sorted range (a spent depth budget, which takes adversarial input) is not replayed: the caller then
gets the full sort, as it does for NaN, negative zero or negative values (whose bit patterns do not order
like their values) and for small tensors (where the full sort is cheaper than the bookkeeping).

Two ways to keep track of which entry is which while the replay moves them. Usually the replay moves the bit
patterns alone (non-negative floats order like their bit patterns), 2 bytes an entry for bf16/fp16 magnitudes
and 4 for float32: a histogram of the keys (for float32, of their high 16 bits, then of the low 16 bits within
the buckets at the window's ends) tells which keys lie wholly inside or outside the window, so only the entries
of the (at most two) keys the window's ends cut are followed, by a sorted tracker. Otherwise (when those entries
are more than half of all) each entry is one int64, its key in the high 32 bits and its original index in the
low 32, so a swap moves both. The Hoare scans are vectorised with numpy
(see `_partition`), whose comparisons, nonzero and fancy indexing are several times faster than torch's on
one thread. Where numba is installed, the same replay runs as one compiled loop instead (introsort_replay.py,
which follows the entries by an int32 id an entry, or on tensors of more than IDS_MAX_ENTRIES by a hash table:
`python bench/profile_compiled.py` gives 7.3 ns an entry for the whole selection against 15.4 with the numpy
replay); the numpy one remains for where numba is not, and for large tensors whose cut keys cover more than
introsort_replay.MAX_TRACKED_SHARE of the entries. Tests compare both against `torch.sort` on many inputs.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..runtime import memory_release
from . import introsort_replay
from .work_buffers import WorkBuffers

INSERTION_THRESHOLD = introsort_replay.INSERTION_THRESHOLD
"""libstdc++'s `_S_threshold`: ranges of at most this many entries are left to the final insertion sort."""

COMPILED = introsort_replay.AVAILABLE
"""The replay runs as introsort_replay's compiled loop (the same moves; tests switch it off to compare)."""

REPLAY_MIN_ENTRIES = 1 << 16
"""Below this size the full sort is as fast as the replay's bookkeeping."""

_BLOCK = 1 << 20
"""Entries per block of the stop counts used to find the k-th stop of a scan."""

_NEAR_END = 1 << 10
"""A stop within this many of either end of its block is found by scanning from that end (the first and last
stops of a scan are asked for at every partition, and usually lie within a few entries of the ends)."""

_KEPT_BLOCKS = 2
"""Blocks whose stop positions a scan keeps at once. The crossing's bisection asks about the same one or two
blocks again and again; the chunk bounds each about another, once. Keeping every block asked about held up to
a tensor's worth of int64 positions (about 2 bytes an entry of a 32 M-entry embedding); a dropped block is found
again from the entries, which no exchange has touched yet when its stops are asked for."""

_SWAP_CHUNK = 1 << 18
"""Exchanges done per vectorised step: bounds the scratch memory of a partition to a few chunks (their int64
positions and the moved entries: with the kept blocks' positions, ~30 MB at this size, measured on a 32 M-entry
bf16 selection, against ~100 MB at 1 << 21, for about the same CPU time)."""

_INDEX_BITS = 32
_INDEX_MASK = (1 << _INDEX_BITS) - 1
_KEY_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_INFINITY_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _keys_in_range(keys: np.ndarray, limit: int) -> bool:
    """Whether every key (a float's bits as a signed integer) lies in [0, limit]: no sign bit (a negative value or
    -0.0) and no nan's bits, so that the keys order like the values (numpy's min and max)."""
    return bool(keys.min() >= 0 and keys.max() <= limit)


def sorted_window_mask(
    values: torch.Tensor,
    lo: int,
    hi: int,
    descending: bool,
    remake: Callable[[], torch.Tensor] | None = None,
    zeros_free: bool = False,
    out: np.ndarray | None = None,
) -> torch.Tensor:
    """Boolean mask over the 1-D tensor `values`: True for the entries that
    `torch.sort(values.float(), descending=descending)` puts at positions [lo, hi).

    `out`, a bool buffer of at least as many entries, may hold the mask (the result is then a view of it): a caller
    that packs the mask at once passes its kept buffer, whose pages are not fresh (magnitude_blocks).

    With `remake` (which makes `values` afresh), `values`, a temporary of the caller's, may be reordered in
    place, saving a tensor-sized copy; `remake` is called if the full sort is needed after all.

    With `zeros_free`, where an end of the window cuts the run of exact zeros, which of the zeros are in may
    differ from the sort's choice (here: none): for a caller that multiplies task vector entries by the mask,
    a zero entry is zero either way. It spares following the zeros through the replay: a bf16 task vector is
    often mostly exact zeros, and the window's end then lies among them.

    On the CPU the sort's own choice among equal values is reproduced without the full sort (see the module
    docstring); on another device the full sort on that device is used, as mergekit would.
    """
    n = values.numel()
    lo, hi = max(0, lo), min(n, hi)
    if lo >= hi:
        return torch.zeros(n, dtype=torch.bool, device=values.device)
    if lo == 0 and hi == n:
        return torch.ones(n, dtype=torch.bool, device=values.device)
    replayable = n >= REPLAY_MIN_ENTRIES
    if replayable:
        consume = remake is not None and values.is_contiguous()
        try:
            mask = _keys_only_window(values, lo, hi, descending, consume, zeros_free, out)
        except _ReplayGaveUp:
            mask, replayable = None, False  # the packed replay would make the same moves and give up too
            if consume:
                assert remake is not None
                values = remake()  # the replay reordered them (a None above left them as they were)
        if mask is not None:
            return torch.from_numpy(mask)
    packed = _packed_keys(values) if replayable else None
    if packed is not None:
        dtype = values.dtype
        del values  # the packed keys hold everything; a caller's temporary magnitudes can go now
        if _replay_packed(packed, lo, hi, descending):
            mask = np.zeros(n, dtype=np.bool_)
            for start in range(lo, hi, _BLOCK):  # in blocks: no window-sized index temporary
                mask[packed[start : min(hi, start + _BLOCK)] & _INDEX_MASK] = True
            return torch.from_numpy(mask)
        values = _unpacked_values(packed, dtype)
    order = torch.sort(values.float() if values.device.type == "cpu" else values, descending=descending).indices
    mask = torch.zeros(n, dtype=torch.bool, device=values.device)
    mask[order[lo:hi]] = True
    return mask


class _ReplayGaveUp(Exception):
    """The sort would heap-sort a range here (a spent depth budget): only the full sort can say."""


KEYS_ONLY_MAX_TRACKED = 1 / 2
"""The keys-only replay tracks the entries whose key the window splits; above this fraction of all entries
(say, a window ending inside a sea of exact zeros) the packed replay is used instead."""


class _Tracker:
    """Where the tracked entries are while the keys-only replay moves them: one sorted int64 per entry,
    (current position << 32) | original index, so a position is found by binary search and a range's entries
    form one slice."""

    def __init__(self, original: np.ndarray, keys: list[int]) -> None:
        self.entries = original << _INDEX_BITS
        self.entries |= original
        self.keys = keys
        self._later: list[tuple[np.ndarray, np.ndarray]] = []

    @staticmethod
    def of_keys(keys: np.ndarray, tracked_keys: list[int]) -> np.ndarray:
        """Which of `keys` are among `tracked_keys`."""
        found = keys == tracked_keys[0]
        for key in tracked_keys[1:]:
            found |= keys == key
        return found

    def tracked(self, keys: np.ndarray) -> np.ndarray:
        return self.of_keys(keys, self.keys)

    def move(self, old: np.ndarray, new: np.ndarray) -> None:
        """Entries at positions `old` (those tracked; the rest are ignored) are now at `new`."""
        slots, hit = self._slots(old)
        self._write(slots, new[hit])

    def move_where_tracked(
        self, keys: np.ndarray, old: np.ndarray, new: np.ndarray, later: bool = False, base: int = 0
    ) -> None:
        """Entries with these keys moved from positions `old` + `base` to `new` + `base` (the base is added to
        the few tracked ones only, not to whole exchange lists). With `later` the new positions are only
        written by `apply_later`: the tracker must stay sorted while a partition's exchanges are looked up."""
        found = np.flatnonzero(self.tracked(keys))  # few: indexing by them beats a boolean mask's indexing
        if not found.size:
            return
        slots, hit = self._slots(old[found] + base)
        if later:
            # as int32 (positions and slots are below 2**31): a partition's pending moves are 8 bytes each
            self._later.append((slots.astype(np.int32), (new[found][hit] + base).astype(np.int32)))
        else:
            self._write(slots, new[found][hit] + base)

    def apply_later(self) -> None:
        for slots, new in self._later:
            self._write(slots, new)
        self._later.clear()

    def _slots(self, old: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the tracked entries at positions `old` are in `entries`, and which of `old` are tracked."""
        if not self.entries.size or not old.size:
            return np.empty(0, dtype=np.int64), np.zeros(old.size, dtype=np.bool_)
        slots = np.minimum(np.searchsorted(self.entries, old.astype(np.int64) << _INDEX_BITS), self.entries.size - 1)
        hit = (self.entries[slots] >> _INDEX_BITS) == old
        return slots[hit], hit

    def _write(self, slots: np.ndarray, new: np.ndarray) -> None:
        self.entries[slots] = (new.astype(np.int64) << _INDEX_BITS) | (self.entries[slots] & _INDEX_MASK)

    def resort(self, first: int, last: int) -> None:
        """Restore the order after moves inside [first, last) (moves never leave the range they are in)."""
        a, b = np.searchsorted(self.entries, [first << _INDEX_BITS, last << _INDEX_BITS])
        self.entries[a:b].sort(kind="stable")  # in place; timsort: the moves leave long sorted runs

    def originals_in(self, first: int, last: int) -> np.ndarray:
        a, b = np.searchsorted(self.entries, [first << _INDEX_BITS, last << _INDEX_BITS])
        return self.entries[a:b] & _INDEX_MASK


def _keys_only_window(
    values: torch.Tensor,
    lo: int,
    hi: int,
    descending: bool,
    consume: bool = False,
    zeros_free: bool = False,
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """The window mask by replaying on the keys alone (2 or 4 bytes an entry instead of 8); None where this
    way does not apply, _ReplayGaveUp where the replay does not.

    A key's entries hold a run of consecutive ranks, which a histogram gives, so every key whose run lies
    inside [lo, hi) is in, every key whose run misses it is out, and only the entries of the (at most two)
    keys whose runs the window's ends cut need the replay to say which are in: only they are tracked.
    """
    view = _KEY_VIEW.get(values.dtype)
    if values.device.type != "cpu" or values.dim() != 1 or view is None:
        return None
    if values.numel() >= 2**31:
        return None  # the tracker packs positions into 32 bits, and kept stop positions are int32
    n = values.numel()
    keys = values.contiguous().view(view).numpy()
    if view is torch.int16:
        counts = _narrow_key_counts(keys, _INFINITY_BITS[values.dtype])
        if counts is None:
            return None
        inside, split = _narrow_window_keys(counts, lo, hi, descending)
    else:
        if not _keys_in_range(keys, _INFINITY_BITS[values.dtype]):
            return None
        inside, split = _wide_window_keys(keys, lo, hi, descending)
    if zeros_free:
        split.pop(0, None)  # free zeros: all out
    split_keys = sorted(split)
    tracked_count = sum(split.values())
    if tracked_count > n * KEYS_ONLY_MAX_TRACKED:
        return None
    if out is None:
        mask = np.zeros(n, dtype=np.bool_)
    else:
        mask = out[:n]
        if inside is None:  # else the comparison below writes every entry
            mask.fill(False)
    compiled_now = COMPILED and introsort_replay.KERNELS.ready(n)  # once per selection: one path throughout
    tracked = np.empty(tracked_count, dtype=np.int64)
    if compiled_now:  # the mask and the tracked positions in one compiled pass
        first, span = (inside[0], inside[1] - inside[0]) if inside is not None else (0, 0)
        none = keys.dtype.type(-1)  # no key: every key is in [0, limit]
        low, high = (keys.dtype.type(split_keys[0]), keys.dtype.type(split_keys[-1])) if split_keys else (none, none)
        width_mask = (1 << 8 * keys.itemsize) - 1  # keys - first wraps to the keys' width, as numpy's does
        found = introsort_replay.window_and_followed(keys, keys.dtype.type(first), span, width_mask,
                                                     inside is not None, low, high, mask, tracked)
        assert found == tracked_count, (found, tracked_count)
    else:
        _numpy_window_and_tracked(keys, inside, split_keys, mask, tracked)
    if not split_keys:
        return mask
    if not consume:
        keys = keys.copy()  # the replay reorders them
    use_ids = compiled_now and follows_by_ids(n)
    lent = _borrow_ids(n) if compiled_now and not use_ids else 0
    if not (use_ids or lent):
        _drop_held_ids()  # no loan for a held buffer this time: its memory goes now
    if use_ids or lent or (compiled_now and tracked_count <= n * introsort_replay.MAX_TRACKED_SHARE):
        low, high = keys.dtype.type(split_keys[0]), keys.dtype.type(split_keys[-1])
        try:
            ids = _ids_buffer(n) if use_ids or lent else None
            replayed = introsort_replay.replay(keys, lo, hi, descending, 0, low, high, tracked, mask,
                                               depth_budget(n), ids)
        finally:
            if lent:
                _lender.give_back(lent)
        if not replayed:
            raise _ReplayGaveUp
        return mask
    tracker = _Tracker(tracked, split_keys)
    del tracked
    if not _replay(keys, lo, hi, descending, shift=0, tracker=tracker):
        raise _ReplayGaveUp
    mask[tracker.originals_in(lo, hi)] = True
    return mask


def _numpy_window_and_tracked(keys: np.ndarray, inside: tuple[int, int] | None, split_keys: list[int],
                              mask: np.ndarray, tracked: np.ndarray) -> None:
    """introsort_replay.window_and_followed by numpy (its kernels not ready): mask[i] where keys[i] lies inside
    [inside[0], inside[1]], and the positions of the split keys into `tracked`, a block at a time (the temporaries
    stay a block big, not 2-3 bytes an entry)."""
    n = keys.size
    if inside is not None:  # keys - first <= last - first, unsigned: one comparison instead of two and an and
        first, span = keys.dtype.type(inside[0]), inside[1] - inside[0]
        unsigned = np.dtype(f"u{keys.itemsize}")
        for start in range(0, n, _BLOCK):
            part = slice(start, start + _BLOCK)
            np.less_equal(np.subtract(keys[part], first).view(unsigned), span, out=mask[part])
    if not split_keys:
        return
    filled = 0
    for start in range(0, n, _BLOCK):
        found = np.flatnonzero(_Tracker.of_keys(keys[start : start + _BLOCK], split_keys))
        found += start
        tracked[filled : filled + found.size] = found
        filled += found.size


LENT_IDS_MAX_ENTRIES = 1 << 28
"""Up to this many entries (1 GiB of ids) a selection over IDS_MAX_ENTRIES follows by ids with memory lent for it."""


class _Lender:
    """Where a selection too large for the ids its plan charged may borrow their memory: the running merge's memory
    budget (MemoryBudget.lend), set by the executor while it runs (`lending`), else nowhere. Following by ids took
    the 1b TIES merge's four selections over its 65.5 M-entry embedding and output matrices from 7.5 s to ~1.5 s of
    CPU (29 ns an entry by the table, ~5 by ids), and the merge from 17.5 to 14.0 s (bench/README.md), for their
    262 MB of ids while each runs."""

    def __init__(self) -> None:
        self.lend: Callable[[int], bool] | None = None
        self.repay: Callable[[int], None] | None = None
        self.kept_ids = 0  # entries of ids a thread may keep from one selection to the next (_ids_buffer)

    def give_back(self, nbytes: int) -> None:
        if self.repay is not None:
            self.repay(nbytes)


_lender = _Lender()


@contextmanager
def lending(lend: Callable[[int], bool], repay: Callable[[int], None], kept_ids: int = 0) -> Iterator[None]:
    """Let selections borrow their ids' memory by `lend(nbytes)` (whether granted; never waits), given back by
    `repay(nbytes)` (MemoryBudget.lend and .repay), inside the block, and let each thread keep the ids of a
    selection over up to `kept_ids` entries for its next one (_ids_buffer: the caller counts ids_bytes(kept_ids) a
    thread as held memory, and runs the selections on threads that end with the block, which frees what they kept).
    One lender at a time in a process: a second merge running beside the first in the same process borrows from
    whichever set it last, which bounds the memory no worse than not lending."""
    before = (_lender.lend, _lender.repay, _lender.kept_ids)
    _lender.lend, _lender.repay, _lender.kept_ids = lend, repay, kept_ids
    try:
        yield
    finally:
        _lender.lend, _lender.repay, _lender.kept_ids = before
        _SPARE.clear()


_IDS = WorkBuffers()
"""Each thread's ids buffer, kept from selection to selection where `lending` allows."""


class _Held(threading.local):
    """Whether this thread keeps its ids buffer whatever its size until `holding_ids` ends."""

    on = False


_HELD = _Held()


@contextmanager
def holding_ids() -> Iterator[None]:
    """Inside, this thread keeps the ids buffer of a selection over more than the kept entries (a lent one) for its
    next selection, and drops it at the end: a tensor's task vectors, selected one after another, then share one.

    Why: a lent buffer is fresh memory, whose pages the kernel zeroes as the replay first touches them, and on this
    project's VM that zeroing is slow: on the 1b TIES bench merge the four selections over the embedding and output
    matrices (262 MB of ids each) took ~1.2 s of CPU in `clear_page_erms` under `_set_ids` (perf). Between two
    selections the buffer is repaid and borrowed again; where the second loan is refused, it is dropped at once."""
    _HELD.on = True
    try:
        yield
    finally:
        _HELD.on = False
        _drop_held_ids()


def _drop_held_ids() -> None:
    """Forget this thread's ids buffer where it is larger than a merge lets a thread keep: left as the spare (see
    _SpareIds) where the merge lets threads keep buffers at all."""
    held = _IDS.arrays.get(_IDS_KEY)
    if held is not None and held.size > _lender.kept_ids:
        if _lender.kept_ids > 0:
            _SPARE.put(held)
        _IDS.forget_array("ids", np.int32, above=_lender.kept_ids)


class _SpareIds:
    """One large ids buffer (a lent one, over the kept size) left by a tensor's selections for the next large
    tensor's, whichever thread runs them, with its pages lazily freed meanwhile.

    Why: a lent buffer is fresh memory, and on this project's VMs the kernel's zeroing of fresh pages runs at ~0.5-1
    GB/s (the host backs them as they are first touched). The 1b TIES merge's embedding and output matrix each took
    a 262 MB buffer: `perf` put ~1.0 CPU-s of the merge in `clear_page_erms` under `_set_ids` (4.1% of its samples),
    ~0.55-0.65 CPU-s with the second reusing the first's pages; the merge's wall time, three alternating cold pairs,
    stayed within the VM's noise (11.9-13.2 s against 12.3-12.7 s; bench/README.md, ninth session of issue 33).

    The spare is held outside the memory budget, so its pages are handed to the kernel as lazily freeable
    (MADV_FREE): under memory pressure the kernel takes them back instead of swapping or killing, and the next user
    finds zeros there, which it may (an ids buffer's contents are undefined); until then reusing them costs no
    fault. Kept only in a merge that lets threads keep buffers (not under a user's --max-memory), one at a time
    (the larger), and dropped when the merge ends (`lending`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None

    def put(self, buffer: np.ndarray) -> None:
        """Keep `buffer` as the spare where it is larger than the one kept (and the system can lazily free it)."""
        with self._lock:
            if self._buffer is not None and self._buffer.size >= buffer.size:
                return
            if memory_release.lazily_free(buffer.ctypes.data, buffer.nbytes):
                self._buffer = buffer

    def take(self, n: int) -> np.ndarray | None:
        """The spare, no longer kept, where it holds n entries; else None."""
        with self._lock:
            if self._buffer is None or self._buffer.size < n:
                return None
            buffer, self._buffer = self._buffer, None
            return buffer

    def clear(self) -> None:
        with self._lock:
            self._buffer = None


_SPARE = _SpareIds()
_IDS_KEY = ("ids", np.dtype(np.int32))


def _ids_buffer(n: int) -> np.ndarray:
    """An int32 id for each of n entries (contents undefined): the thread's kept buffer where it is large enough,
    else a fresh one, kept for the next selection where n is within the running merge's kept_ids.

    Why keep it: a fresh buffer's pages fault in at random as the replay's exchanges first touch them. The 1b TIES
    merge's 132 selections over 11.5 M-entry matrices faulted in 6 GB of ids that way (1.9 M page faults; the merge
    took 14.5-16.0 s, 4.8-6.9 s of it system time); reused, 160 K faults and 13.3-14.6 s, 4.1-5.5 s (bench/README.md,
    issue 33). A fresh buffer comes from numpy, which asks for transparent huge pages where the system grants them on
    request (a 2 MB fault instead of 512)."""
    if n > _lender.kept_ids:  # a lent buffer: the thread's held one, the spare or a fresh map
        held = _IDS.arrays.get(_IDS_KEY)
        if held is None or held.size < n:
            held = _SPARE.take(n)
            if held is None:
                held = np.empty(n, dtype=np.int32)
            if _HELD.on:
                _IDS.arrays[_IDS_KEY] = held
        return held[:n]
    return _IDS.array("ids", n, np.int32, keep_up_to=_lender.kept_ids)


def kept_entries() -> int:
    """The largest selection whose buffers a worker keeps for the next (`lending`'s kept_ids; 0: keep none, as
    under a user's --max-memory or outside a merge): its ids here, its magnitudes in magnitude_blocks."""
    return _lender.kept_ids


def kept_ids_entries(selection_sizes: Iterable[int]) -> int:
    """The kept_ids (see `lending`) that lets a thread keep the ids of any of these selections that are followed by
    ids without a loan (follows_by_ids): the largest of them, 0 where none is."""
    return max((n for n in selection_sizes if follows_by_ids(n)), default=0)


def ids_bytes(entries: int) -> int:
    """Bytes of the ids of `entries` entries (a selection's, lent or kept)."""
    return entries * introsort_replay.ID_BYTES


def _borrow_ids(n: int) -> int:
    """Bytes lent for the ids of a selection over n entries (0: none, and the table follows the entries)."""
    lend = _lender.lend
    if lend is None or n > LENT_IDS_MAX_ENTRIES:
        return 0
    nbytes = ids_bytes(n)
    return nbytes if lend(nbytes) else 0


def follows_by_ids(n: int) -> bool:
    """Whether a selection over n entries is replayed compiled with an id an entry (introsort_replay.ID_BYTES
    each: magnitude_blocks charges them); else by the compiled replay's table or by numpy, whose memory the keys
    and mask bound. Memory is charged by this answer also while the replay is still compiling and numpy's path
    runs instead: an upper bound then."""
    return COMPILED and n <= introsort_replay.IDS_MAX_ENTRIES


def _narrow_key_counts(keys: np.ndarray, limit: int) -> np.ndarray | None:
    """The histogram of 16-bit keys over all 32768 values, None where a key lies outside [0, limit] (a sign bit or
    a nan's bits). Compiled where the replay's kernels are ready (introsort_replay.key_counts: one pass), else
    numpy's min and max and torch's bincount."""
    counts = np.zeros(1 << 15, dtype=np.int64)
    if COMPILED and introsort_replay.KERNELS.ready(keys.size):
        return counts if introsort_replay.key_counts(keys, limit, counts) else None
    if not _keys_in_range(keys, limit):
        return None
    total = torch.from_numpy(counts)
    key_tensor = torch.from_numpy(keys)
    for start in range(0, keys.size, _BLOCK):  # torch's bincount takes int16 as it is; numpy's widens it first
        total += torch.bincount(key_tensor[start : start + _BLOCK], minlength=1 << 15)
    return counts


def _narrow_window_keys(counts: np.ndarray, lo: int, hi: int, descending: bool) -> tuple[tuple[int, int] | None,
                                                                                     dict[int, int]]:
    """16-bit keys, from their histogram (`counts`, _narrow_key_counts): the interval of key values wholly inside
    [lo, hi) (None: none is) and the keys the window's ends cut, with their counts."""
    in_order = counts[::-1] if descending else counts
    first_rank = np.concatenate(([0], np.cumsum(in_order)[:-1]))
    last_rank = first_rank + in_order
    present = in_order > 0
    inside = present & (first_rank >= lo) & (last_rank <= hi)
    split = present & ~inside & (first_rank < hi) & (last_rank > lo)
    if descending:
        inside, split = inside[::-1], split[::-1]
    inside_keys = np.flatnonzero(inside)  # one interval of key values (ranks follow key order)
    interval = (int(inside_keys[0]), int(inside_keys[-1])) if inside_keys.size else None
    return interval, {int(k): int(counts[k]) for k in np.flatnonzero(split)}


def _wide_window_keys(keys: np.ndarray, lo: int, hi: int, descending: bool) -> tuple[tuple[int, int] | None,
                                                                                 dict[int, int]]:
    """32-bit keys (float32 magnitudes): as _narrow_window_keys, from a histogram of the high 16 bits and, for
    the (at most two) buckets holding ranks lo and hi - 1, one of the low 16 bits of their entries."""
    coarse = np.zeros(1 << 16, dtype=np.int64)
    for start in range(0, keys.size, _BLOCK):
        coarse += np.bincount(keys[start : start + _BLOCK] >> 16, minlength=1 << 16)

    def key_at(rank: int) -> tuple[int, int, int]:
        """The key at this rank of the sort, the rank of its first entry, and its count."""
        order = coarse[::-1] if descending else coarse
        running = np.cumsum(order)
        at = int(np.searchsorted(running, rank, side="right"))
        bucket = coarse.size - 1 - at if descending else at
        before = int(running[at] - order[at])
        fine = np.zeros(1 << 16, dtype=np.int64)
        for start in range(0, keys.size, _BLOCK):
            part = keys[start : start + _BLOCK]
            fine += np.bincount(part[(part >> 16) == bucket] & 0xFFFF, minlength=1 << 16)
        fine_order = fine[::-1] if descending else fine
        fine_running = np.cumsum(fine_order)
        within = int(np.searchsorted(fine_running, rank - before, side="right"))
        low = fine.size - 1 - within if descending else within
        count = int(fine_order[within])
        return (bucket << 16) | low, before + int(fine_running[within]) - count, count

    ends = [key_at(lo), key_at(hi - 1)]
    whole = [first >= lo and first + count <= hi for _, first, count in ends]
    (key_lo, _, _), (key_hi, _, _) = ends
    # the keys strictly between the two ends' keys in sort order are inside, and each end's key if its run is
    if descending:
        interval = (key_hi + (0 if whole[1] else 1), key_lo - (0 if whole[0] else 1))
    else:
        interval = (key_lo + (0 if whole[0] else 1), key_hi - (0 if whole[1] else 1))
    split = {key: count for (key, _, count), inside in zip(ends, whole) if not inside}
    return (interval if interval[0] <= interval[1] else None), split


def _packed_keys(values: torch.Tensor) -> np.ndarray | None:
    """(bit pattern << 32) | index for each entry, or None where bit patterns would not order like values."""
    if values.device.type != "cpu" or values.dim() != 1 or values.dtype not in _KEY_VIEW or values.numel() >= 2**31:
        return None
    bits = values.contiguous().view(_KEY_VIEW[values.dtype]).numpy()
    if not _keys_in_range(bits, _INFINITY_BITS[values.dtype]):
        return None
    packed = bits.astype(np.int64)
    packed <<= _INDEX_BITS
    for start in range(0, packed.size, _BLOCK):
        packed[start : start + _BLOCK] |= np.arange(start, min(start + _BLOCK, packed.size), dtype=np.int64)
    return packed


def _unpacked_values(packed: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The values `_packed_keys` was given, back in their original order (whatever the replay did to packed)."""
    bits = np.empty(packed.size, dtype=np.dtype(f"i{_KEY_VIEW[dtype].itemsize}"))
    bits[packed & _INDEX_MASK] = packed >> _INDEX_BITS
    return torch.from_numpy(bits).view(dtype)


def _replay_packed(packed: np.ndarray, lo: int, hi: int, descending: bool) -> bool:
    """_replay on packed entries (each carries its index: nothing to follow), compiled where numba is there."""
    if COMPILED and introsort_replay.KERNELS.ready(packed.size):
        none = np.int64(-1)  # no packed entry is negative: none is followed
        nothing = np.empty(0, dtype=np.int64)
        unused = np.empty(0, dtype=np.bool_)
        return bool(introsort_replay.replay(packed, lo, hi, descending, _INDEX_BITS, none, none, nothing, unused,
                                            depth_budget(packed.size)))
    return _replay(packed, lo, hi, descending)


def depth_budget(n: int) -> int:
    """`std::sort`'s partition depth limit for n entries: 2 floor(log2 n)."""
    return 2 * (n.bit_length() - 1)


def _replay(
    entries: np.ndarray, lo: int, hi: int, descending: bool, shift: int = _INDEX_BITS, tracker: _Tracker | None = None
) -> bool:
    """Replay the introsort on `entries` (keys in the bits above `shift`) in place, along the ranges straddling
    lo or hi, so that positions [lo, hi) end up holding the entries the full sort puts there; the `tracker`,
    if any, follows the entries it tracks. False where the replay cannot be used."""
    n = entries.size
    pending = [(0, n, depth_budget(n))]  # (first, last, depth budget)
    while pending:
        first, last, depth = pending.pop()
        if not (first < lo < last or first < hi < last):
            continue  # its set of entries is final
        if last - first <= INSERTION_THRESHOLD:
            leaf = entries[first:last]
            keys = leaf >> shift
            order = np.argsort(-keys if descending else keys, kind="stable")
            entries[first:last] = leaf[order]
            if tracker is not None:
                tracker.move(first + order, first + np.arange(order.size))
                tracker.resort(first, last)
            continue
        if depth == 0:
            return False  # libstdc++ would heap-sort this range
        cut = first + _partition(entries[first:last], descending, shift, tracker, first)
        pending.append((first, cut, depth - 1))
        pending.append((cut, last, depth - 1))
    return True


def _precedes(a: int, b: int, descending: bool) -> bool:
    """The sort's comparator on two keys: does a go strictly before b?"""
    return a > b if descending else a < b


def _median_of_three(keys: list[int], descending: bool) -> int:
    """Which of (first+1, middle, last-1), as 0, 1, 2, `__move_median_to_first` moves to the front."""
    a, b, c = keys
    if _precedes(a, b, descending):
        if _precedes(b, c, descending):
            return 1
        return 2 if _precedes(a, c, descending) else 0
    if _precedes(a, c, descending):
        return 0
    return 2 if _precedes(b, c, descending) else 1


class _Stops:
    """Where one Hoare scan stops in a range: the entries with packed value in [low, high) (None: no upper end).

    Positions are found a block at a time and kept: a partition asks for the k-th stop several times (the
    crossing, the chunk bounds), mostly in the same few blocks, and finding a block's stops costs a pass over
    it. A range of one block has its stops found outright. The kept positions describe the entries as they
    were; `_partition` only reads them for spans no exchange has touched yet.
    """

    def __init__(self, entries: np.ndarray, low: int, high: int | None):
        self.entries, self.low, self.high = entries, low, high
        self._found: dict[int, np.ndarray] = {}
        if entries.size <= _BLOCK:
            self._found[0] = np.flatnonzero(self.mask(0, entries.size))
            counts = [self._found[0].size]
        else:
            counts = [int(np.count_nonzero(self.mask(i, i + _BLOCK))) for i in range(0, entries.size, _BLOCK)]
        self.before_block = [0, *itertools.accumulate(counts)]
        self.total = self.before_block[-1]

    def mask(self, start: int, end: int) -> np.ndarray:
        part = self.entries[start:end]
        if self.high is None:
            return part >= self.low
        if self.low <= 0:
            return part < self.high
        return (part >= self.low) & (part < self.high)

    def _in_block(self, block: int) -> np.ndarray:
        """Positions of the stops in one block (kept for the next question about it)."""
        found = self._found.get(block)
        if found is None:
            start = block * _BLOCK
            found = np.flatnonzero(self.mask(start, start + _BLOCK)).astype(np.int32)  # kept: half the bytes
            found += start
            if len(self._found) >= _KEPT_BLOCKS:  # the oldest goes: a block's positions are 8 bytes a stop
                del self._found[next(iter(self._found))]
            self._found[block] = found
        return found

    def positions(self, start: int, end: int) -> np.ndarray:
        block = start // _BLOCK
        found = self._found.get(block)
        if found is not None and (end - 1) // _BLOCK == block:
            a, b = np.searchsorted(found, [start, end])
            return found[a:b]
        return np.flatnonzero(self.mask(start, end)) + start

    def block_of(self, k: int) -> int:
        """The block holding the stop numbered k (from 0, left to right)."""
        return bisect.bisect_right(self.before_block, k) - 1

    def kth(self, k: int) -> int:
        """Position of the stop numbered k (from 0, left to right)."""
        block = self.block_of(k)
        within = k - self.before_block[block]
        if block not in self._found:  # near either end of its block: look at that end only
            from_end = self.before_block[block + 1] - self.before_block[block] - 1 - within
            if min(within, from_end) < _NEAR_END:
                return self._near_end(block, within, from_end)
        return int(self._in_block(block)[within])

    def _near_end(self, block: int, within: int, from_end: int) -> int:
        """The stop numbered `within` in `block` (`from_end` counting from its right), found by scanning a
        window at the nearer end of the block that grows until it holds that stop, not the whole block."""
        start = block * _BLOCK
        end = min(start + _BLOCK, self.entries.size)
        width = 4 * _NEAR_END
        while True:
            if within <= from_end:
                found = np.flatnonzero(self.mask(start, min(end, start + width)))
                if found.size > within:
                    return start + int(found[within])
            else:
                first = max(start, end - width)
                found = np.flatnonzero(self.mask(first, end))
                if found.size > from_end:
                    return first + int(found[found.size - 1 - from_end])
            width *= 4

    def from_right(self, k: int) -> int:
        """Position of the stop numbered k counting from the right (from 0)."""
        return self.kth(self.total - 1 - k)


def _partition(entries: np.ndarray, descending: bool, shift: int, tracker: _Tracker | None, offset: int) -> int:
    """One `__unguarded_partition_pivot` step on `entries`, in place; returns the cut.

    The Hoare scans, vectorised: with the pivot p at position 0, the forward scan stops at the entries that p
    does not follow (forward stops L0 < L1 < ...), the backward scan at those that do not follow p (R0 > R1 >
    ...). The i-th exchange swaps Li with Ri while Li < Ri. Until the scans cross they only meet entries no
    exchange has touched, so the number of exchanges m and the cut (where the forward scan stops after the
    last exchange: min(Lm, R(m-1)), or L0 when m = 0) follow from the entries as they were.
    """
    n = entries.size
    picked = (1, n // 2, n - 1)[_median_of_three([int(entries[i]) >> shift for i in (1, n // 2, n - 1)], descending)]
    if tracker is not None:
        tracker.move_where_tracked(entries[[0, picked]] >> shift, np.array([0, picked]) + offset,
                                   np.array([picked, 0]) + offset)
        tracker.resort(offset, offset + n)
    entries[[0, picked]] = entries[[picked, 0]]
    pivot = int(entries[0]) >> shift
    at_or_above, above = pivot << shift, (pivot + 1) << shift
    rest = entries[1:]
    # descending: forward stops at values <= pivot, backward at values >= pivot; ascending the other way round
    lowest, highest = 0, None
    if descending:
        forward, backward = _Stops(rest, lowest, above), _Stops(rest, at_or_above, highest)
    else:
        forward, backward = _Stops(rest, at_or_above, highest), _Stops(rest, lowest, above)
    swaps, cut = _crossing(forward, backward)
    # chunk bounds first: an exchange rewrites entries that a later chunk's stop count would look at
    chunks = [
        (forward.kth(i), forward.kth(j - 1), backward.from_right(j - 1), backward.from_right(i))
        for i, j in ((i, min(swaps, i + _SWAP_CHUNK)) for i in range(0, swaps, _SWAP_CHUNK))
    ]
    for left_first, left_last, right_first, right_last in chunks:
        left = forward.positions(left_first, left_last + 1)
        right = backward.positions(right_first, right_last + 1)[::-1]
        moved, incoming = rest[left], rest[right]
        rest[left] = incoming
        rest[right] = moved
        if tracker is not None:  # positions in rest are one past those in entries
            tracker.move_where_tracked(moved >> shift if shift else moved, left, right, later=True, base=offset + 1)
            tracker.move_where_tracked(incoming >> shift if shift else incoming, right, left, later=True,
                                       base=offset + 1)
    if tracker is not None:
        tracker.apply_later()
        tracker.resort(offset, offset + n)
    return 1 + cut


def _crossing(forward: _Stops, backward: _Stops) -> tuple[int, int]:
    """(m, cut) of a Hoare partition (see `_partition`).

    Li grows with i and Ri shrinks, so Li < Ri holds for i < m and for no i after: m is found by bisection.
    Most probes are settled by which blocks Li and Ri lie in (the block counts say that without a pass over
    the entries); the probes where both lie in one block are all in the same block (the gap between the two
    block numbers only grows with i), so at most that block's stops are found entry by entry.
    """
    def exchanged(i: int) -> bool:
        left_block, right_block = forward.block_of(i), backward.block_of(backward.total - 1 - i)
        if left_block != right_block:
            return left_block < right_block
        return forward.kth(i) < backward.from_right(i)

    low, high = 0, min(forward.total, backward.total)
    while low < high:
        middle = (low + high) // 2
        if exchanged(middle):
            low = middle + 1
        else:
            high = middle
    swaps = low
    if swaps == 0:
        return 0, forward.kth(0)
    cut = backward.from_right(swaps - 1)
    if swaps < forward.total:
        cut = min(cut, forward.kth(swaps))
    return swaps, cut
