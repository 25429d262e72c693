"""Reads the inputs of the tensors (or row blocks) a merge will compute, ahead of the workers, in plan order.

Why: a merge reads each input byte once, in an order the plan fixes before anything runs (copies and
elementwise methods by row blocks, other methods whole tensors). Reading in that order ahead of the workers, with
a few I/O threads (`io.direct_read`), keeps the disk busy while earlier blocks are merged; with O_DIRECT
into reused buffers the reads cost neither page-cache pages nor page faults. Memory is the reader's pool,
a fixed size for the whole merge: the feed waits while it is full and goes on as workers hand blocks back.

Workers usually take blocks in the order they were fed. A worker that takes a block the feed has not
reached (the executor admitted a later recipe first, under its memory budget) reads that block itself
at once, into buffers of its own, and the feed skips it. The feed reserves a block's buffers all at
once before claiming it, so a worker never waits on buffers the feed holds for blocks that only run later.
A block larger than the whole pool (a large tensor of a method that needs it whole) is read alone, once
the blocks before it are handed back: the feed never holds two of those.

A method that needs a totals pass over a tensor's row blocks before it merges them (blocks.two_pass: the
L1 norms of DARE's rescale, TIES' magnitude ranking) takes each block twice, once per pass. Where all of a
recipe's blocks fit in half the pool (KEEP_PARTS; the pool grows up to KEEP_POOL_BYTES for the largest such
recipe, keeping_pool), the feed reads each block once, for the totals pass, and keeps its buffers for the merge
pass: `done(TOTALS)` hands them to the same rows' MERGE block, which the feed never reads, and the totals pass's
early `release`s leave them be (no totals pass writes into its inputs, which with the compute dtype of the
inputs are the buffers themselves: tests/test_read_once.py checks every method with one). A block a worker read
itself, ahead of the feed, is kept only where the pool has room for it (BufferPool.adopt), so what is kept stays
within the pool. A stop, an error or `forget` between the passes hands the kept buffers back at once
(local_executor._write_recipe). On the 1 B bench (3 x 2.2 GB bf16) every layer matrix is kept: the feed read
7.39 GB for the 6.60 GB of inputs of ties and dare_ties, 13.2 GB before (0.79 GB of it the embeddings' second
read); dare_ties, cold, one run each on the shared 2-core VM: 14.1 -> 7.8-8.2 GB read by the process (startup
included), 16.9 -> 12.3-15.0 s (bench/README.md, issue 33).

Larger recipes (embeddings, a 7 B model's MLP matrices) are read twice, from the disk each time. Read through the
page cache instead (once from the disk, then again from the cache) every 4 KB of input is a fresh page-cache page
faulted into the process; on this project's 2-core VM that first touch cost ~2.3-4.9 ns per bf16 entry against
~0.3 for a buffer the feed read (measured on the 1 B dare_ties bench merge, bench/README.md, issue 21), 15 of its
44 CPU-seconds, where a second disk read of the same bytes costs no CPU and overlaps the merging. Where the disk
is the bottleneck instead (a network volume capped at a few hundred MB/s, a hard disk), those recipes are read
through the memory maps, so the disk reads each byte once: a short probe of the disk decides (see second_read;
`MERGESMITH_SECOND_READ=disk|cache` chooses instead).

Inputs that cannot be streamed (`.bin` checkpoints, LoRA-adapted tensors, files on filesystems without
O_DIRECT) come back as None and are read through the checkpoint's memory map, as are the inputs of
operations other than copies and merges (tokenizer surgery, MoE gates), which index them freely.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ...io.checkpoint import Checkpoint
from ...io.direct_read import BufferPool, DirectReader, ReadBuffer, capacity_for
from ...io.direct_write import direct_io_supported
from ...io.dtypes import SAFETENSORS_TO_TORCH
from ...io.read_rate import direct_read_rate
from ..plan import InputRef, TensorRecipe
from .blocks import row_blocks, two_pass

STREAMED_OPS = frozenset({"copy", "merge"})
"""Operations whose inputs are read whole or by the same rows as their output (others index freely)."""

Rows = tuple[int, int]
SECOND_READ_ENV = "MERGESMITH_SECOND_READ"
"""How a two-pass recipe's inputs are read again where its blocks are too large to keep between the passes: "disk"
(the feed reads them once per pass), "cache" (through the memory maps, so the second pass finds them in the page
cache), or "auto" (the default: "disk" when a short probe of the disk reads at REREAD_MIN_RATE or more,
io/read_rate.py)."""

REREAD_MIN_RATE = 800e6
"""Bytes per second from which reading twice from the disk beats a second read through the page cache.
Measured on the 1 B dare_ties bench merge (two cores): the disk read twice was 15% faster at the VM's
1.3-1.5 GB/s (as the probe measures it) and 35% slower at 300 MB/s; reading twice overlaps the merging as
long as the disk keeps up with it, which for that merge (13.6 GB read in ~22 s) takes ~0.6 GB/s. A faster
CPU needs a faster disk: the margin is above that."""


def second_read(probe: Callable[[], float | None] | None = None) -> str:
    """"disk" or "cache": what the environment asks for, or with "auto" what `probe` (the disk's read rate, None
    when unknown: "cache") says."""
    asked = os.environ.get(SECOND_READ_ENV, "auto").strip().lower()
    if asked in ("disk", "cache"):
        return asked
    rate = probe() if probe is not None else None
    return "disk" if rate is not None and rate >= REREAD_MIN_RATE else "cache"


KEEP_PARTS = 2
"""One two-pass recipe's totals-pass buffers are kept for its merge pass where they take at most 1 / KEEP_PARTS of
the feed's pool, so that one recipe never fills it: the feed goes on reading ahead for the other workers beside
it. (Nothing deadlocks however full the pool gets: a worker never waits for the feed's buffers, it reads a block
the feed has not reached itself, see `take`.) On the 1 B bench merges, cold, every kept block reached its merge
pass with half the pool as with a third (only the embeddings read twice; in ties no block read by a worker ahead
of the feed); half costs the less memory."""

KEEP_POOL_BYTES = 256 << 20
"""How large the feed's pool may grow (from io.direct_read.POOL_BYTES) so that two-pass recipes are kept: the 1 B
bench's MLP matrices (3 inputs x 11-12 row blocks in 2.25 MB buffers: 74 MB) take a pool of 148 MB; a 7 B model's
(3 inputs x 90 MB) would take 600 MB and are read twice, as are embeddings (the 1 B's: 3 x 131 MB)."""


TOTALS = "totals"
MERGE = "merge"
"""The passes a block is fed for: a two-pass method's totals pass, and the merge (every block)."""

Key = tuple[str, int, str]  # (output tensor name, first row of the block, pass)


@dataclass(frozen=True)
class Part:
    """The bytes of one input that one output row block needs, and how to view them."""

    path: Path
    offset: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the bytes read: (rows read, *row shape)
    pad_rows: int  # zero rows below them (the input has fewer rows than the output)
    repeated: bool = False  # other blocks read the same bytes: read through the page cache


def part_of(
    ckpt: Checkpoint, ref: InputRef, rows: Rows, direct: Callable[[Path], bool] = direct_io_supported
) -> Part | None:
    """What input `ref` contributes to output rows [start, end), or None when it is not streamed (`direct`:
    whether a file is read around the page cache).

    As `compute.load_input` does for a whole tensor: the input's rows are cut or zero-padded to
    `ref.rows` (vocabularies of different sizes), then the block's rows are taken."""
    located = ckpt.byte_range(ref.tensor)
    if located is None or not direct(located[0]):
        return None
    path, offset, info = located
    dtype = SAFETENSORS_TO_TORCH[info.dtype]
    if not info.shape:  # 0-dim: the whole value
        return Part(path, offset, info.nbytes, dtype, (), 0)
    start, end = rows
    have = info.shape[0] if ref.rows is None else min(info.shape[0], ref.rows)
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    take = max(0, min(end, have) - start)
    return Part(path, offset + start * row_bytes, take * row_bytes, dtype, (take, *info.shape[1:]), end - start - take)


def _other_rows(ckpt: Checkpoint, ref: InputRef, recipe: TensorRecipe) -> bool:
    """An input whose rows are not the output's and that no `ref.rows` lines up with them (regmean's in x in Gram
    beside an out x in weight): compute reads it whole from its mapping, never cut to the output's rows."""
    info = ckpt.tensors.get(ref.tensor)
    if ref.rows is not None or info is None or not info.shape or not recipe.shape:
        return False
    return info.shape[0] != recipe.shape[0]


class _Block:
    """One block's parts (None: that input is not streamed) and, once claimed, their reads; `keep`: a totals-pass
    block whose buffers go on to the same rows' merge pass (`tensors`: what `take` handed out, handed on)."""

    __slots__ = ("parts", "reads", "claimed", "keep", "tensors")

    def __init__(self, parts: list[Part | None], keep: bool = False) -> None:
        self.parts = parts
        self.reads: list[Future[ReadBuffer] | None] | None = None
        self.claimed = False
        self.keep = keep
        self.tensors: list[torch.Tensor | None] | None = None


class InputFeed:
    """Feeds the streamable inputs of `blocks` (recipe, rows), in the given order."""

    def __init__(
        self,
        blocks: Sequence[tuple[TensorRecipe, Rows, str]],
        checkpoints: dict[str, Checkpoint],
        reader: DirectReader,
        reread: Callable[[TensorRecipe], bool] | None = None,
    ) -> None:
        """`blocks`: a two-pass recipe's blocks for both passes (TOTALS, then MERGE). Those whose totals-pass
        buffers fit in `keep_limit(pool)` are read once and kept for the merge pass; for the others `reread`
        (asked once, about the first of them) says whether the feed reads them again for the merge pass
        (True, or without it) or not at all (False: both passes through the memory maps)."""
        self.reader = reader
        self._order: list[Key] = []
        self._blocks: dict[Key, _Block] = {}
        self._streamed: dict[str, frozenset[int]] = {}
        direct = functools.cache(direct_io_supported)  # once per file, not per block (it reads the mount table)
        recipes: dict[str, TensorRecipe] = {}
        for recipe, rows, pass_ in blocks:
            parts = [
                None if _other_rows(ckpt, ref, recipe) else part_of(ckpt, ref, rows, direct)
                for ref in recipe.inputs
                for ckpt in (checkpoints[ref.model],)
            ]
            if any(p is not None for p in parts):
                key = (recipe.name, rows[0], pass_)
                self._order.append(key)
                self._blocks[key] = _Block(parts)
                self._streamed[recipe.name] = frozenset(i for i, p in enumerate(parts) if p is not None)
                recipes[recipe.name] = recipe
        self._plan_second_reads(recipes, reread)
        self._mark_repeated()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="merge-feed", daemon=True)

    def _plan_second_reads(
        self, recipes: dict[str, TensorRecipe], reread: Callable[[TensorRecipe], bool] | None
    ) -> None:
        """Decide, per two-pass recipe, how its merge pass gets its inputs: from the totals pass's buffers (kept:
        its MERGE blocks leave the feed's order, `done(TOTALS)` hands them their buffers), read again by the
        feed, or (`reread` says no) through the memory maps for both passes."""
        held: Counter[str] = Counter()
        for key, block in self._blocks.items():
            if key[2] == TOTALS:
                held[key[0]] += sum(_capacities(block))
        limit = keep_limit(self.reader.pool.limit)
        kept = {name for name, nbytes in held.items() if nbytes <= limit}
        again = [name for name in held if name not in kept]
        dropped = set(again) if again and reread is not None and not reread(recipes[again[0]]) else set()
        for key, block in self._blocks.items():
            block.keep = key[2] == TOTALS and key[0] in kept
        self._order = [
            key for key in self._order if key[0] not in dropped and not (key[2] == MERGE and key[0] in kept)
        ]
        for name in dropped:
            self._streamed.pop(name, None)
        self._blocks = {key: b for key, b in self._blocks.items() if key[0] not in dropped}

    def __len__(self) -> int:
        return len(self._order)

    def _mark_repeated(self) -> None:
        """Bytes that several blocks read (a layer a frankenmerge uses twice, a model listed twice) are read
        through the page cache, so that every read after the first finds them there: read around the cache
        they would cost the disk each time, and holding them in memory until their last use could take
        gigabytes."""
        readers = Counter(  # a two-pass block's second read is its own, not another block's
            (p.path, p.offset, p.length)
            for key, b in self._blocks.items()
            if key[2] == MERGE
            for p in b.parts
            if p is not None
        )
        for block in self._blocks.values():
            block.parts = [
                replace(p, repeated=True) if p is not None and readers[(p.path, p.offset, p.length)] > 1 else p
                for p in block.parts
            ]

    def streamed(self, recipe: TensorRecipe) -> frozenset[int]:
        """Indices of the recipe's inputs this feed reads."""
        return self._streamed.get(recipe.name, frozenset())

    def start(self) -> None:
        if self._order:
            self._thread.start()

    def _feed(self) -> None:
        pool = self.reader.pool
        for key in self._order:
            block = self._blocks.get(key)
            if block is None or block.claimed:
                continue
            buffers = pool.take_all(_capacities(block), self._stop)
            if buffers is None:
                return
            with self._lock:
                if block.claimed:  # a worker took it meanwhile
                    mine = False
                else:
                    block.claimed = mine = True
            if not mine:
                for memory in buffers:
                    pool.give(memory)
                continue
            reads = self._submit(block, buffers, pooled=True)
            with self._lock:
                block.reads = reads

    def _submit(self, block: _Block, buffers: list[mmap.mmap], pooled: bool) -> list[Future[ReadBuffer] | None]:
        """Start the block's reads into `buffers` (one per part with bytes, in order)."""
        reads: list[Future[ReadBuffer] | None] = []
        spare = iter(buffers)
        for part in block.parts:
            if part is None or part.length == 0:
                reads.append(None)
                continue
            memory = next(spare)
            reads.append(
                self.reader.submit(part.path, part.offset, part.length, memory, pooled, through_cache=part.repeated)
            )
        return reads

    def take(self, recipe: TensorRecipe, rows: Rows, pass_: str = MERGE) -> list[torch.Tensor | None] | None:
        """The block's inputs in recipe order (None for those read from the memory map), or None when
        nothing of this block is streamed. Hand them back with `done` once the block is written.

        A kept block's merge pass gets the very tensors its totals pass got (no read)."""
        block = self._blocks.get((recipe.name, rows[0], pass_))
        if block is None:
            return None
        with self._lock:
            own = not block.claimed
            block.claimed = True
            handed = block.tensors
        if handed is not None:
            return handed
        if own:  # the feed has not reached it: read it now, into buffers of its own
            capacities = _capacities(block)
            # kept for the merge pass only where the pool has room for it, so the kept bytes stay in its bound
            pooled = block.keep = block.keep and self.reader.pool.adopt(sum(capacities))
            block.reads = self._submit(block, self.reader.pool.spares(capacities), pooled=pooled)
        if not self._reads_submitted(block):
            raise RuntimeError("the input feed stopped before reading this block")
        tensors: list[torch.Tensor | None] = []
        for part, read in zip(block.parts, block.reads):
            if part is None:
                tensors.append(None)
                continue
            data = (
                read.result().tensor(part.dtype, part.shape)
                if read is not None
                else torch.empty(part.shape, dtype=part.dtype)
            )
            if part.pad_rows:
                padded = torch.zeros((part.shape[0] + part.pad_rows, *part.shape[1:]), dtype=part.dtype)
                padded[: part.shape[0]] = data
                data = padded
                if read is not None:
                    read.result().release()  # copied out: its buffer is spent
            tensors.append(data)
        if block.keep:
            block.tensors = tensors
        return tensors

    def release(self, recipe: TensorRecipe, rows: Rows, index: int, pass_: str = MERGE) -> None:
        """Hand back the buffer of one input of a taken block early: the method is done reading it (a task-
        vector method has taken its difference), or it was converted to the compute dtype. On an embedding-
        sized TIES block that is hundreds of MB less at the peak. Not a kept block's: its merge pass reads it."""
        block = self._blocks.get((recipe.name, rows[0], pass_))
        if block is not None and not block.keep and block.reads is not None and block.reads[index] is not None:
            block.reads[index].result().release()  # type: ignore[union-attr]

    def done(self, recipe: TensorRecipe, rows: Rows, pass_: str = MERGE) -> None:
        """Hand a taken block's buffers back (its tensors must no longer be used); a kept totals-pass block's go
        to the same rows' merge pass instead, unless the feed is stopping."""
        block = self._blocks.pop((recipe.name, rows[0], pass_), None)
        if block is None or block.reads is None:
            return
        if block.keep and block.tensors is not None:
            with self._lock:
                merge = self._blocks.get((recipe.name, rows[0], MERGE))
                if merge is not None and not merge.claimed and not self._stop.is_set():
                    merge.reads, merge.tensors, merge.claimed = block.reads, block.tensors, True
                    return
        _release(block.reads)

    def forget(self, recipe: TensorRecipe) -> None:
        """Drop every block of `recipe` not yet taken, giving back what was read for them: the method merges the
        tensor whole after all (registry.MERGE_WHOLE), through the memory maps."""
        with self._lock:
            blocks = [self._blocks.pop(key) for key in [k for k in self._blocks if k[0] == recipe.name]]
            claimed = [block for block in blocks if block.claimed]
            for block in blocks:
                block.claimed = True  # the feed skips it (or gives back the buffers it is taking for it)
            self._streamed.pop(recipe.name, None)
        for block in claimed:
            if self._reads_submitted(block):
                _release(block.reads)  # type: ignore[arg-type]

    def _reads_submitted(self, block: _Block) -> bool:
        """Wait while the feed, having claimed `block`, submits its reads; False when it stopped first."""
        while block.reads is None:
            if self._stop.wait(0.0002) or not self._thread.is_alive():
                return block.reads is not None
        return True

    def close(self) -> None:
        """Stop feeding, give back every buffer still held, close the reader (also after a failure)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for block in self._blocks.values():
            if block.reads is not None:
                _release(block.reads)
        self._blocks.clear()
        self.reader.close()


def open_feed(recipes: Sequence[TensorRecipe], checkpoints: dict[str, Checkpoint], pool_bytes: int) -> InputFeed | None:
    """A started feed for the blocks of these recipes' copies and merges (rows as blocks.row_blocks cuts them;
    those of a two-pass merge once per pass: all for its totals pass, then all for its merge, where the merge pass
    takes the totals pass's buffers or second_read says "disk"), in this order; None when no input of them can be
    streamed."""
    blocks = [
        (recipe, rows, pass_)
        for recipe in recipes
        if recipe.op in STREAMED_OPS
        for pass_ in ((TOTALS, MERGE) if two_pass(recipe) else (MERGE,))
        for rows in row_blocks(recipe)
    ]
    if not blocks:
        return None

    def reread(recipe: TensorRecipe) -> bool:  # two-pass recipes too large to keep: read again, or through the maps
        return second_read(lambda: _probe(recipe, checkpoints)) == "disk"

    feed = InputFeed(blocks, checkpoints, DirectReader(BufferPool(pool_bytes)), reread)
    if not len(feed):
        feed.close()
        return None
    feed.start()
    return feed


def keep_limit(pool_limit: int) -> int:
    """The most pool bytes one two-pass recipe's blocks may hold between its passes (1 / KEEP_PARTS of the pool)."""
    return pool_limit // KEEP_PARTS


BlockBytes = Callable[[TensorRecipe, InputRef, Rows], int]
"""The bytes of one input that one row block of a recipe reads (0: none streamed)."""


def keeping_pool(recipes: Sequence[TensorRecipe], block_bytes: BlockBytes) -> int:
    """The pool that keeps the largest two-pass recipe whose blocks fit keep_limit(KEEP_POOL_BYTES) (0: none does).
    A merge's feed gets at least this where its memory budget allows (io.direct_read.pool_bytes): local_executor
    with the bytes the feed would read (streamed_bytes), the plan's estimate with the inputs' sizes."""
    need = 0
    for recipe in recipes:
        if recipe.op not in STREAMED_OPS or not two_pass(recipe):
            continue
        held = 0
        for rows in row_blocks(recipe):
            held += sum(capacity_for(n) for ref in recipe.inputs if (n := block_bytes(recipe, ref, rows)))
        if held <= keep_limit(KEEP_POOL_BYTES):
            need = max(need, held * KEEP_PARTS)
    return need


def streamed_bytes(checkpoints: dict[str, Checkpoint]) -> BlockBytes:
    """BlockBytes for these checkpoints: what the feed reads of each input (part_of)."""
    direct = functools.cache(direct_io_supported)

    def block_bytes(recipe: TensorRecipe, ref: InputRef, rows: Rows) -> int:
        ckpt = checkpoints[ref.model]
        part = None if _other_rows(ckpt, ref, recipe) else part_of(ckpt, ref, rows, direct)
        return 0 if part is None else part.length

    return block_bytes


def _probe(recipe: TensorRecipe, checkpoints: dict[str, Checkpoint]) -> float | None:
    """The read rate of the disk under the recipe's first input that the feed could read (None: none can)."""
    for ref in recipe.inputs:
        part = part_of(checkpoints[ref.model], ref, (0, recipe.shape[0] if recipe.shape else 1))
        if part is not None:
            return direct_read_rate(part.path, part.offset)
    return None


def _capacities(block: _Block) -> list[int]:
    """The buffer sizes of a block's reads (its parts with bytes)."""
    return [capacity_for(p.length) for p in block.parts if p is not None and p.length]


def _release(reads: list[Future[ReadBuffer] | None]) -> None:
    for read in reads:
        if read is None:
            continue
        try:
            read.result().release()
        except BaseException:  # noqa: BLE001 - a failed read gave its buffer back already
            pass
