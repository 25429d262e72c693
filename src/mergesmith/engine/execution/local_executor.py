"""The local executor: runs a Plan's recipes on a thread pool under a memory budget.

Torch math and file I/O release the GIL, so a few threads overlap reading one tensor, merging
another and writing a third. This module orchestrates; its parts are admission.py (the memory budget a
recipe waits for), compute.py (one recipe's tensor), writing.py (shard writers and the journal), with the
input feed (input_feed.py) reading ahead of the workers. What stays here is the thread pool, the row blocks
of a large recipe, the page-cache advice (read-ahead, release), the kernel warm-up and progress events.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, MemoryShortage, MergeInterrupted
from ...io.checkpoint import Checkpoint
from ...io.direct_read import pool_bytes
from ...io.dtypes import to_torch
from ...io.journal import Journal
from ...io.quantized import quantize_output
from ...io.safetensors_writer import ShardWriter
from ...kernels import introsort_replay, magnitude_blocks, sort_select
from ...kernels.compiled import LOAD_WAIT_ENTRIES, KernelGroup, waits
from ...methods import require_method
from ...methods.registry import MERGE_WHOLE
from ...runtime import intra_op_threads
from ...runtime.device_memory import device_limit
from ...runtime.devices import resolve_device
from ...runtime.memory_limits import MemoryWatch, memory_room
from ...runtime.memory_release import release_free_heap
from ..plan import InputRef, Plan, ShardPlan, TensorRecipe
from ..planning.device_memory import device_recipe_memory, staging_bytes
from ..planning.shared import MergeOptions, automatic_budget, distinct_input_bytes, recipe_memory
from .admission import ADMISSION_WINDOW, DeviceBudget, MemoryBudget
from .blocks import block_numel, row_blocks, two_pass
from .compute import Gathered, advise_inputs, compute
from .device_transfer import PINNED_BYTES_PER_THREAD
from .input_feed import MERGE, TOTALS, InputFeed, keeping_pool, open_feed, streamed_bytes
from .kernel_warmup import kernel_groups, recipes_using
from .nonfinite import NonFiniteMonitor
from .writing import ShardOutputs

PREFETCH_BYTES = 512 << 20
TRIM_AFTER_BYTES = 64 << 20
"""After a recipe with at least this working memory, freed heap memory goes back to the OS (see
memory_release): peak RSS then follows what is in use, not what fragmented heaps keep..."""
HEAP_KEPT_FREE_BYTES = 128 << 20
"""...once the heap holds more than this free (memory_release: handing back less costs page faults for nothing)."""


@dataclass
class ProgressEvent:
    tensors_done: int
    tensors_total: int
    bytes_written: int
    recipe: TensorRecipe | None


def read_ahead_end(mapped_before: Sequence[int], index: int, prefetched: int, limit: int) -> int:
    """Where the read-ahead should end when recipe `index` is admitted: past the recipes from `index` on whose
    mapped input bytes, counted from `index`, first reach `limit`; never before `prefetched` (what is advised
    already stays advised). `mapped_before[k]` is the mapped input bytes of recipes 0 to k-1 (one entry more
    than there are recipes), so the end is a binary search.

    Counting from `index`, not from the end of the last advice, is what bounds it: counted from there, every
    admission advised another `limit` bytes, and the whole model was queued within a few seconds (7B ties in a
    12.7 GB cgroup read 84 GB for 43.5 GB of inputs, the pages evicted before use; 68 GB bounded, see
    bench/README.md). A search, not a walk from `index`: where the feed reads every input nothing is mapped, a
    walk reached the last recipe at every admission, and a merge of 18,003 tiny tensors took 358 s of it."""
    count = len(mapped_before) - 1
    if index >= count or limit <= 0:
        return max(prefetched, index)
    end = bisect.bisect_left(mapped_before, mapped_before[index] + limit, lo=index + 1)
    return max(prefetched, min(end, count))


def inputs_exceed_room(recipes: Sequence[TensorRecipe], checkpoints: dict[str, Checkpoint], room: int) -> bool:
    """Whether the recipes' inputs (each tensor once) are more than the memory this process may use: then every
    recipe drops its mapped inputs from the page cache once merged (Checkpoint.advise "uncache"), so the pages
    read ahead for the next tensors are not evicted in their place. Otherwise the cache is left as it is: a merge
    run again on the same models (evolve's candidates, a rerun) reads them from memory."""

    def nbytes(ref: InputRef) -> int:
        info = checkpoints[ref.model].tensors.get(ref.tensor)
        return 0 if info is None else info.nbytes

    return distinct_input_bytes(recipes, nbytes) > room


@dataclass(frozen=True)
class ExecutionSettings:
    """How a plan is run, whichever executor runs it (from the merge options): none of it changes output bytes."""

    threads: int = 1
    max_memory: int | None = None  # bytes in flight; None: the automatic budget
    device: str = "cpu"
    strict: bool = False  # NaN/inf in an input or output is an error, not a warning
    ray_address: str | None = None  # the Ray cluster to join (RayExecutor only; None: RAY_ADDRESS or a local Ray)
    max_gpu_memory: int | None = None  # device bytes in flight on CUDA; None: the device's free memory less a margin
    start_first: frozenset[str] = frozenset()  # recipes admitted before the others (time_estimate.long_poles)

    @classmethod
    def of(cls, options: MergeOptions) -> ExecutionSettings:
        """The settings a merge's options give."""
        return cls(
            options.threads,
            options.max_memory,
            options.device,
            options.strict,
            options.ray_address,
            max_gpu_memory=options.max_gpu_memory,
        )


class Executor:
    """What every executor is given: the plan, its opened inputs, the output directory and its journal, the
    settings, and where to report progress and when to stop. Each runs the plan's unfinished shards (`run`)
    and journals the finished ones, so either executor resumes a run the other began (LocalExecutor here,
    RayExecutor in ray_executor.py)."""

    def __init__(
        self,
        plan: Plan,
        checkpoints: dict[str, Checkpoint],
        out_dir: Path,
        journal: Journal,
        settings: ExecutionSettings | None = None,
        *,
        on_progress: Callable[[ProgressEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.plan = plan
        self._total = len(plan.recipes)  # Plan.recipes is a new list on every call: not once per tensor
        self.ckpts = checkpoints
        self.out_dir = out_dir
        self.journal = journal
        self.settings = settings or ExecutionSettings()
        self.threads = max(1, self.settings.threads)
        self.on_progress = on_progress
        self.stop = stop or threading.Event()
        self.resumed_tensors = 0  # set by `run`: tensors earlier runs had made durable, reused rather than redone
        self._prepare()

    def _prepare(self) -> None:
        """Set up what this kind of executor needs beyond what every one is given."""

    def run(self) -> None:
        raise NotImplementedError


class LocalExecutor(Executor):
    """Runs every unfinished shard of a plan into `out_dir` on a thread pool, journaling as it goes."""

    watch_memory = True  # sample the memory this process may use while it runs (see MemoryWatch)

    def _prepare(self) -> None:
        self.budget = MemoryBudget(self.settings.max_memory)
        # `auto` from a caller; checked at plan time
        self.device = torch.device(resolve_device(self.settings.device, check=False))
        # on CUDA, recipes are admitted while their device bytes fit too (read from the device when run starts)
        self.device_limit = None
        self.compute_dtype = to_torch(self.plan.compute_dtype)
        self.explicit_dtype = bool(self.plan.options.get("explicit_dtype"))
        self._lock = threading.Lock()  # the counters below and the first error
        self.outputs = ShardOutputs(self.out_dir, self.journal)
        self._remaining: dict[str, int] = {}
        self._done = 0
        self._bytes = 0
        self._error: BaseException | None = None
        self._feed: InputFeed | None = None
        self._kernel_groups: list[KernelGroup] = []
        self._uncache_inputs = False  # set by run(): see inputs_exceed_room
        self._kept_ids = 0  # set by run(): see _kept_ids_entries
        self.monitor = NonFiniteMonitor(self.settings.strict)  # NaN/inf in inputs and outputs; `warnings()` after run

    def _warm_kernels(self, recipes: list[TensorRecipe]) -> None:
        """Start compiling (or loading) the compiled loops the recipes will use, in the background, while the feed
        probes the disk and reads ahead, not in the first worker to need them (~0.3-0.4 s each from numba's cache,
        2-20 s to compile on a fresh install): DARE's and DELLA's (keyed_kernels), and the task-vector family's
        bf16 steps and TIES' replay. Until a group is ready, the methods take their uncompiled path (the same bytes;
        compiled.KernelGroup), except in a merge with enough work for the group (compiled.LOAD_WAIT_ENTRIES) whose
        loops numba's cache holds: its workers wait for that sub-second load (KernelGroup.wait_for_load)."""
        if self.device.type != "cpu":
            return
        groups = kernel_groups(recipes)
        for group in groups:
            if sum(math.prod(r.shape) for r in recipes_using(recipes, group)) >= LOAD_WAIT_ENTRIES:
                group.wait_for_load()  # a load from numba's cache, not a compile: worth waiting for here
            group.start()
        self._kernel_groups = groups

    def run(self) -> None:
        pending = [s for s in self.plan.shards if s.filename not in self.journal.finished]
        total = self._total
        # A resumed run starts its counters at what earlier runs finished (whole shards and the
        # journaled tensors of partial ones), so the bar and its ETA continue where they stopped.
        finished = [s for s in self.plan.shards if s.filename in self.journal.finished]
        self._done = sum(len(s.recipes) for s in finished)
        self._bytes = sum(s.data_bytes for s in finished)
        work: list[tuple[ShardPlan, TensorRecipe]] = []
        for shard in pending:
            writer = self.outputs.open(shard)
            done = writer.done
            written: list[TensorRecipe] = []
            todo: list[TensorRecipe] = []
            for r in shard.recipes:  # one pass: `r not in written` compared whole recipes, O(n^2) on a resume
                (written if all(name in done for name, _d, _s in r.stored()) else todo).append(r)
            self._done += len(written)
            self._bytes += sum(r.nbytes for r in written)
            self._remaining[shard.filename] = len(todo)
            if not todo:
                self.outputs.finish(shard.filename)
            work.extend((shard, r) for r in todo)
        # the long poles first (stable: the rest keeps plan order), reads and all: a long tensor that came last ran
        # alone at the end while the other workers idled
        work.sort(key=lambda item: item[1].name not in self.settings.start_first)
        self.resumed_tensors = self._done
        self._emit(None)

        cost_of = {r.name: recipe_memory(r, self.plan.compute_dtype) for r in self.plan.recipes}
        self._uncache_inputs = inputs_exceed_room([recipe for _, recipe in work], self.ckpts, memory_room().available)
        # what this process may really use (cgroup limit, available memory), sampled while it runs
        watch = MemoryWatch().start() if self.watch_memory and work else None
        # the feed's read-ahead buffers: a quarter of the budget, or of the room there is when none was given, at
        # most POOL_BYTES or what keeps two-pass recipes' blocks between their passes (input_feed.keeping_pool)
        sizing = self.budget.limit if self.budget.limit is not None or watch is None else watch.capacity()
        feed_bytes = pool_bytes(sizing, keeping_pool([recipe for _, recipe in work], streamed_bytes(self.ckpts)))
        if self.budget.limit is None:
            self.budget.limit = automatic_budget(list(cost_of.values()), self.threads)
            self.budget.automatic = True
        costs = [cost_of[recipe.name] for _, recipe in work]
        device_costs = self._device_costs(work)
        if device_costs is not None:  # the workers' pinned staging buffers are held host memory too
            staging = staging_bytes([r for _, r in work], self.plan.compute_dtype, PINNED_BYTES_PER_THREAD)
            feed_bytes += self.threads * staging
        self.budget.watch, self.budget.held_bytes = watch, feed_bytes
        self._kept_ids = self._kept_ids_entries([recipe for _, recipe in work])
        self.budget.kept_bytes = self.threads * self._kept_bytes_each([recipe for _, recipe in work])
        try:
            self._feed = open_feed([recipe for _, recipe in work], self.ckpts, feed_bytes)
            # after the feed's first reads are queued: loading compiled loops holds the GIL for ~0.3-0.4 s
            self._warm_kernels([recipe for _, recipe in work])
            self.budget.held_unmapped = self._feed.reader.pool.unmapped if self._feed is not None else (lambda: 0)
            self._run_work(work, costs, device_costs)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._feed = None
            if self.budget.watch is not None:
                self.budget.watch.stop()
            try:  # an interrupt or a memory shortage ends the run here too: what is durable gets journaled
                self.outputs.journal_progress()
            finally:
                # and the unfinished shards' files and writer threads close now, not when a traceback
                # that holds this executor (a notebook keeps the last one) is finally dropped
                self.outputs.close()
                # A compile still running goes on after the merge (never waited for: a daemon thread, its work
                # cached function by function). Only under MERGESMITH_KERNELS=wait (the test suite) does the merge
                # wait for it, so that no compile outlives a test: one still running in a caller's process sent
                # that process's later output astray (pytest's capsys lost the next merges' lines).
                if waits():
                    for group in self._kernel_groups:
                        group.wait()
        if self._error is not None:
            raise self._error
        if self.stop.is_set():
            finished = len(self.journal.finished)
            raise MergeInterrupted(
                f"interrupted: {finished} of {len(self.plan.shards)} shards and {self._done} of {total} tensors "
                "are saved; run the same command again to resume"
            )

    def _kept_ids_entries(self, recipes: list[TensorRecipe]) -> int:
        """The ids each worker keeps from one magnitude selection to the next (sort_select.lending: the size of the
        largest selection followed by ids without a loan), on the CPU, where the compiled replay runs. None under a
        user's --max-memory, which bounds the work in flight: what a worker keeps between recipes is outside it (up
        to 64 MiB a worker, introsort_replay.IDS_MAX_ENTRIES ids)."""
        if self.device.type != "cpu" or self.settings.max_memory is not None:
            return 0
        ranked = recipes_using(recipes, introsort_replay.KERNELS)
        return sort_select.kept_ids_entries(recipe.numel() for recipe in ranked)

    def _kept_bytes_each(self, recipes: list[TensorRecipe]) -> int:
        """What each worker keeps from one magnitude selection to the next (see _kept_ids_entries): the ids, and
        for the recipes selected in row blocks (two_pass) magnitude_blocks' magnitudes and task vectors."""
        if not self._kept_ids:
            return 0
        blocked = [r for r in recipes_using(recipes, introsort_replay.KERNELS) if two_pass(r)]
        tasks = max((len(r.inputs) - 1 for r in blocked), default=0)
        selected = max((r.numel() for r in blocked if r.numel() <= self._kept_ids), default=0)
        deltas = max((tasks * block_numel(r) for r in blocked), default=0)
        kept = magnitude_blocks.kept_bytes(selected, deltas, tasks, self.compute_dtype.itemsize)
        return sort_select.ids_bytes(self._kept_ids) + kept

    def _device_costs(self, work: list[tuple[ShardPlan, TensorRecipe]]) -> list[int] | None:
        """On CUDA (with work to do): each recipe's device bytes, and the device budget they are admitted under
        (runtime/device_memory.py); None elsewhere."""
        if self.device.type != "cuda" or not work:
            return None
        self.device_limit = device_limit(str(self.device), self.settings.max_gpu_memory)
        assert self.device_limit is not None
        self.budget.device = DeviceBudget(self.device_limit.limit)
        return [device_recipe_memory(recipe, self.plan.compute_dtype) for _, recipe in work]

    def _run_work(
        self, work: list[tuple[ShardPlan, TensorRecipe]], costs: list[int], device_costs: list[int] | None = None
    ) -> None:
        """Admit the work to the thread pool under the memory budget (and on CUDA the device budget) and wait for
        all of it."""
        slots = threading.Semaphore(self.threads)
        prefetched = 0
        mapped_before = self._mapped_before(work)
        waiting = list(range(len(work)))  # indices into work, in plan order, not yet admitted
        head_passed = 0  # recipes admitted ahead of waiting[0] since it first waited
        with (
            self.outputs.flushing(self._fail),
            intra_op_threads.shared_between(self.threads),
            sort_select.lending(self.budget.lend, self.budget.repay, self._kept_ids),
        ):
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="merge") as pool:
                futures: list[Future[None]] = []
                try:
                    while waiting and not self._stopping():
                        if not slots.acquire(timeout=0.2):
                            continue
                        window = waiting[:ADMISSION_WINDOW]
                        try:
                            on_device = None if device_costs is None else [device_costs[i] for i in window]
                            position = self.budget.acquire_first(
                                [costs[i] for i in window], self.stop, on_device,
                                protect_head=head_passed >= ADMISSION_WINDOW,
                            )
                        except MemoryShortage as exc:
                            raise self._shortage(exc, work[window[0]][1]) from None
                        if position is None:
                            slots.release()
                            break
                        head_passed = head_passed + 1 if position else 0
                        index = waiting.pop(position)
                        shard, recipe = work[index]
                        prefetched = self._prefetch(work, mapped_before, index, prefetched)
                        device_cost = 0 if device_costs is None else device_costs[index]
                        futures.append(pool.submit(self._run_one, shard, recipe, costs[index], slots, device_cost))
                except BaseException:
                    # Ctrl-C in a notebook (KeyboardInterrupt lands in this thread) or a memory shortage:
                    # the tensors in flight finish and are journaled, so a rerun resumes after them.
                    self.stop.set()
                    raise
                finally:
                    for f in futures:
                        f.exception()  # wait for everything in flight

    def _shortage(self, exc: MemoryShortage, recipe: TensorRecipe) -> MemoryShortage:
        """The one-line error: which tensor, how much it needed and had, and what is saved for the rerun."""
        return MemoryShortage(
            f"not enough memory: tensor {recipe.name!r} {exc}; stopped with {self._done} of "
            f"{self._total} tensors saved, rerun with more memory to resume",
            exc.needed,
            exc.available,
        )

    def _fail(self, exc: BaseException) -> None:
        """Keep the first error of a worker or of the journal's writeback; the main thread re-raises it."""
        with self._lock:
            if self._error is None:
                self._error = exc

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._error is not None

    def _run_one(
        self, shard: ShardPlan, recipe: TensorRecipe, cost: int, slots: threading.Semaphore, device_cost: int = 0
    ) -> None:
        try:
            if self._stopping():
                return
            if not self._write_recipe(self.outputs.writer(shard.filename), recipe):
                return
            with self._lock:
                self._done += 1
                self._bytes += recipe.nbytes
                self._remaining[shard.filename] -= 1
                last = self._remaining[shard.filename] == 0
            if last:
                self.outputs.finish(shard.filename)
            self._emit(recipe)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self._fail(exc)
        finally:
            if cost >= TRIM_AFTER_BYTES:
                release_free_heap(keep=self._heap_kept_free())
            self.budget.release(cost, device_cost)
            slots.release()

    def _heap_kept_free(self) -> int:
        """Free heap the process may keep after a large recipe: HEAP_KEPT_FREE_BYTES, or an eighth of the memory the
        watch says is left beside the work in flight where that is less (under a tight cgroup limit, kept free heap
        is memory the next recipe cannot have)."""
        room = self.budget.room()
        if room is None:
            return HEAP_KEPT_FREE_BYTES
        return min(HEAP_KEPT_FREE_BYTES, max(0, room - self.budget.in_flight) // 8)

    def _write_recipe(self, writer: ShardWriter, recipe: TensorRecipe) -> bool:
        """Compute one recipe and write it, in row blocks when it is large and elementwise.

        Returns False when a stop request left the tensor unwritten. Then, or on an error, what the feed holds for
        the recipe goes back at once (a two-pass recipe's blocks kept between its passes among it)."""
        try:
            written = self._write_blocks(writer, recipe)
        except BaseException:
            if self._feed is not None:
                self._feed.forget(recipe)
            raise
        if not written and self._feed is not None:
            self._feed.forget(recipe)
        return written

    def _write_blocks(self, writer: ShardWriter, recipe: TensorRecipe) -> bool:
        """_write_recipe's work."""
        blocks = row_blocks(recipe)
        totals = None
        if len(blocks) > 1 and two_pass(recipe):
            totals = self._gather_totals(recipe, blocks)
            if totals is None:
                return False
            if isinstance(totals, str) and totals == MERGE_WHOLE:  # the method's fallback: no blocks after all
                blocks, totals = [(0, recipe.shape[0])], None
                if self._feed is not None:
                    self._feed.forget(recipe)
        if len(blocks) == 1:

            def put_whole(out: torch.Tensor) -> None:
                parts = quantize_output(recipe.name, out, recipe.quantize) if recipe.quantize else [(recipe.name, out)]
                for name, part in parts:
                    writer.write(name, part)
                try:  # a copy's output may still be a view of its input's map, read by the write itself
                    self._check_mapped(recipe, None)
                except CheckpointError:
                    for name, _part in parts:
                        writer.forget(name)
                    raise

            self._compute_block(recipe, blocks[0], put_whole, whole=True)
        else:
            sink = writer.open_tensor(recipe.name)
            for rows in blocks:
                if self.stop.is_set():
                    return False  # the tensor is not committed; a resume computes it again
                self._compute_block(recipe, rows, sink.write, totals=totals)
                advise_inputs(recipe, self.ckpts, "dontneed", rows, skip=self._streamed(recipe))
            sink.close()
        spent = "uncache" if self._uncache_inputs else "dontneed"  # see inputs_exceed_room
        advise_inputs(recipe, self.ckpts, spent, skip=self._streamed(recipe))
        return True

    def _gather_totals(self, recipe: TensorRecipe, blocks: list[tuple[int, int]]) -> Any:
        """The totals pass of a two-pass recipe over its row blocks, in order, from the blocks the feed read for
        it (input_feed.TOTALS; the others through the memory maps); None when a stop request cut it short."""
        spec = require_method(recipe.method or "")
        assert spec.totals is not None
        gathered = Gathered()
        for rows in blocks:
            if self.stop.is_set():
                return None
            args = (self.ckpts, self.compute_dtype, self.explicit_dtype, self.device)
            with self._fed(recipe, rows, TOTALS) as (loaded, spent):
                compute(recipe, *args, rows=rows, loaded=loaded, spent=spent, gather=gathered)
            advise_inputs(recipe, self.ckpts, "dontneed", rows, skip=self._streamed(recipe))
        return spec.totals.finish(gathered.state)

    def _compute_block(
        self,
        recipe: TensorRecipe,
        rows: tuple[int, int],
        put: Callable[[torch.Tensor], None],
        whole: bool = False,
        totals: Any = None,
    ) -> None:
        """Compute rows [start, end) of a recipe (`whole`: all of it, one block) and `put` the result, from
        the inputs the feed read for them where it did. The feed's buffers go back only after `put`: the
        output of a copy may be a view of them."""
        with self._fed(recipe, rows, MERGE) as (loaded, spent):
            args = (self.ckpts, self.compute_dtype, self.explicit_dtype, self.device)
            out = compute(
                recipe, *args, rows=None if whole else rows, loaded=loaded, spent=spent, totals=totals,
                monitor=self.monitor, lend_output=True,  # `put` copies the bytes out before this thread goes on
            )
            assert out is not None
            self._check_mapped(recipe, loaded)  # no block computed from a shrunken input's pages is kept
            put(out)

    @contextmanager
    def _fed(
        self, recipe: TensorRecipe, rows: tuple[int, int], pass_: str
    ) -> Iterator[tuple[Sequence[torch.Tensor | None] | None, Callable[[int], None] | None]]:
        """The inputs the feed read for one block in one pass (None without a feed or for blocks it does not
        read) and the callback that hands one of them back early; the block's buffers go back on leaving."""
        feed = self._feed
        if feed is None:
            yield None, None
            return
        loaded = feed.take(recipe, rows, pass_)
        try:
            yield loaded, functools.partial(feed.release, recipe, rows, pass_=pass_)
        finally:
            if loaded is not None:
                feed.done(recipe, rows, pass_)

    def _check_mapped(self, recipe: TensorRecipe, loaded: Sequence[torch.Tensor | None] | None) -> None:
        """Refuse the block if an input read through its memory map (not by the feed) shrank meanwhile: its
        pages past the new end read as zeros (io.map_guard) or would have raised SIGBUS."""
        for index, ref in enumerate(recipe.inputs):
            if loaded is None or loaded[index] is None:
                self.ckpts[ref.model].check_intact(ref.tensor)

    def _streamed(self, recipe: TensorRecipe) -> frozenset[int]:
        """Indices of the recipe's inputs the feed reads (nothing of theirs is mapped to release)."""
        return self._feed.streamed(recipe) if self._feed is not None else frozenset()

    def _mapped_before(self, work: list[tuple[ShardPlan, TensorRecipe]]) -> list[int]:
        """The memory-mapped input bytes of work[0:k], for every k (read_ahead_end's `mapped_before`): an input
        the feed reads is not mapped, nor is one the checkpoint lacks."""

        def mapped_bytes(recipe: TensorRecipe) -> int:
            streamed = self._streamed(recipe)
            return sum(
                self.ckpts[ref.model].stored_nbytes(ref.tensor)
                for i, ref in enumerate(recipe.inputs)
                if i not in streamed and ref.tensor in self.ckpts[ref.model].tensors
            )

        return list(itertools.accumulate((mapped_bytes(recipe) for _, recipe in work), initial=0))

    def _prefetch(
        self, work: list[tuple[ShardPlan, TensorRecipe]], mapped_before: list[int], index: int, prefetched: int
    ) -> int:
        """Ask the kernel to read ahead the memory-mapped inputs of the next recipes (up to PREFETCH_BYTES
        of them from the one being admitted), so cold-cache reads overlap the merging of earlier tensors;
        the feed reads the others itself. Returns the end of what is now advised."""
        end = read_ahead_end(mapped_before, index, prefetched, PREFETCH_BYTES)
        for position in range(max(prefetched, index), end):
            recipe = work[position][1]
            if mapped_before[position + 1] > mapped_before[position]:  # nothing to advise for a streamed recipe
                advise_inputs(recipe, self.ckpts, "willneed", skip=self._streamed(recipe))
        return end

    def _emit(self, recipe: TensorRecipe | None) -> None:
        if self.on_progress is not None:
            self.on_progress(ProgressEvent(self._done, self._total, self._bytes, recipe))
