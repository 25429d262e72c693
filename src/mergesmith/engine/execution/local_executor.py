"""The local executor: runs a Plan's recipes on a thread pool under a memory budget.

Torch math and file I/O release the GIL, so a few threads overlap reading one tensor, merging
another and writing a third. A recipe is admitted only while the estimated bytes in flight stay
under the budget (one that alone exceeds it runs by itself), so peak memory depends on the largest
tensors in flight, never on shard or model size. Shards finish (fsync + rename) as soon as their
last tensor lands; progress inside a shard is journaled every second, so a kill loses little.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ConfigError, MemoryShortage, MergeInterrupted
from ...io.checkpoint import Checkpoint
from ...io.direct_read import pool_bytes
from ...io.dtypes import to_torch
from ...io.journal import Journal, partial_path
from ...io.safetensors_writer import ShardWriter
from ...kernels.compiled import KernelGroup, waits
from ...kernels.keyed_random import MaskStream
from ...methods import MergeInputs, require_method
from ...methods.registry import MERGE_WHOLE
from ...runtime import intra_op_threads
from ...runtime.devices import resolve_device
from ...runtime.memory_limits import MemoryWatch, memory_room
from ...runtime.memory_release import release_free_heap
from ...sizes import human_size
from ..plan import InputRef, Plan, ShardPlan, TensorRecipe
from ..planning.shared import MergeOptions, automatic_budget, distinct_input_bytes, recipe_memory
from .blocks import row_blocks, two_pass
from .input_feed import MERGE, TOTALS, InputFeed, open_feed
from .kernel_warmup import kernel_groups
from .nonfinite import NonFiniteMonitor

JOURNAL_INTERVAL_S = 1.0
PREFETCH_BYTES = 512 << 20
TRIM_AFTER_BYTES = 64 << 20
"""After a recipe with at least this working memory, freed heap memory goes back to the OS (see
memory_release): peak RSS then follows what is in use, not what fragmented heaps keep."""
ADMISSION_WINDOW = 16
"""How far past a recipe that does not fit the budget the executor looks for one that does (so a thread
is not idle while, say, lm_head waits for embed_tokens to finish); after this many recipes have gone past
it, the waiting one is admitted next, as soon as it fits."""


@dataclass
class ProgressEvent:
    tensors_done: int
    tensors_total: int
    bytes_written: int
    recipe: TensorRecipe | None


class MemoryBudget:
    """Admits work while the bytes in flight fit; an oversized item waits until it is alone.

    With a `watch` (memory_limits.MemoryWatch), the bytes in flight must also fit what this process may
    really use now (its cgroup's limit, the system's available memory) less `held` (the input feed's
    buffers): when another process takes memory, less work is admitted; when even a lone item no
    longer fits, `acquire_first` raises MemoryShortage instead of letting the kernel kill the merge."""

    def __init__(self, limit: int | None, watch: MemoryWatch | None = None, held: int = 0) -> None:
        self.limit = limit
        self.watch = watch
        self.held_bytes = held
        # what of `held` is not yet in the process's memory use (which the watch's samples already count):
        # the input feed's pool tells; None counts all of `held`
        self.held_unmapped: Callable[[], int] | None = None
        self.in_flight = 0
        self.peak = 0  # the most bytes ever admitted at once: a statistic for tests and reports
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes set aside beside the work in flight that are not counted in the watch's samples yet."""
        return self.held_bytes if self.held_unmapped is None else min(self.held_bytes, self.held_unmapped())

    def room(self) -> int | None:
        """Bytes the work in flight may occupy now by the memory watch (None: not watched)."""
        return None if self.watch is None else max(0, self.watch.capacity() - self.held)

    def fits(self, cost: int) -> bool:
        limit, room = self.limit, self.room()
        if room is not None:
            limit = room if limit is None else min(limit, room)
        return limit is None or self.in_flight == 0 or self.in_flight + cost <= limit

    def acquire_first(self, costs: list[int], stop: threading.Event) -> int | None:
        """Admit the first of `costs` that fits, waiting until one does; its position, or None when stopped."""
        with self._cond:
            while True:
                for position, cost in enumerate(costs):
                    if self.fits(cost):
                        if self.in_flight == 0 and self.watch is not None:
                            self._check_alone(cost)
                        self.in_flight += cost
                        self.peak = max(self.peak, self.in_flight)
                        return position
                if stop.is_set():
                    return None
                self._cond.wait(0.2)

    def _check_alone(self, cost: int) -> None:
        """A lone item runs even over `limit` (a budget, not the machine); but not over the memory there is."""
        assert self.watch is not None
        # sampled afresh, not the watch's last figure: memory may have gone since (the one case where a
        # stale figure would admit a tensor into an out-of-memory kill)
        if self.watch.wait_for(cost + self.held):
            return
        room = self.room() or 0
        raise MemoryShortage(
            f"needs {human_size(cost, 2)} of working memory, only {human_size(room, 2)} is free for it "
            f"(this process may use {self.watch.last.describe()})",
            needed=cost,
            available=room,
        )

    def release(self, cost: int) -> None:
        with self._cond:
            self.in_flight -= cost
            self._cond.notify_all()


def load_input(ckpt: Checkpoint, ref: InputRef) -> torch.Tensor:
    """An input tensor, its rows truncated or zero-padded to `ref.rows` when vocabularies differ."""
    tensor = ckpt.get(ref.tensor)
    if ref.rows is None or tensor.shape[0] == ref.rows:
        return tensor
    if tensor.shape[0] > ref.rows:
        return tensor[: ref.rows]
    padded = torch.zeros((ref.rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


class MethodError(ConfigError):
    """A merge method raised ValueError for one tensor: one line naming the tensor and method (a plain
    message, so the exception pickles: Ray hands a worker's error back to the driver)."""

    @classmethod
    def of(cls, recipe: TensorRecipe, exc: ValueError) -> MethodError:
        text = " ".join(str(exc).split()) or exc.__class__.__name__
        where = "" if recipe.name in text else f"tensor {recipe.name!r}: "
        return cls(f"{where}method {recipe.method!r} failed: {text}")


def _check_shape(recipe: TensorRecipe, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise RuntimeError(
            f"recipe {recipe.op}:{recipe.method} returned shape {list(tensor.shape)} for {recipe.name!r}, "
            f"planned {list(shape)}"
        )


def compute(
    recipe: TensorRecipe,
    checkpoints: dict[str, Checkpoint],
    compute_dtype: torch.dtype,
    explicit_dtype: bool,
    device: torch.device,
    rows: tuple[int, int] | None = None,
    loaded: Sequence[torch.Tensor | None] | None = None,
    spent: Callable[[int], None] | None = None,
    totals: Any = None,
    gather: Gathered | None = None,
    monitor: NonFiniteMonitor | None = None,
) -> torch.Tensor | None:
    """The output tensor of one recipe (or of its rows [start, end)), in its output dtype, on the CPU.

    `loaded`: inputs of these rows already read (by the executor's input feed), per input in recipe order;
    the others (None) are read from their checkpoint's memory map. `spent(index)` is called once a loaded
    input will not be read again (converted to the compute dtype, or done with by the method), so that
    its memory can go back early, as a mapped input's pages are dropped. `monitor` counts the non-finite values
    of every input as it is loaded and of the output before it is returned (engine/execution/nonfinite.py).

    Two-pass methods (blocks.two_pass): with `gather` the rows are folded into `gather.state` by the method's
    totals pass and nothing is returned; `totals` hands the finished totals to the second pass."""
    out_dtype = to_torch(recipe.dtype)
    shape = recipe.shape if rows is None else (rows[1] - rows[0], *recipe.shape[1:])

    def streamed(index: int) -> bool:
        return loaded is not None and loaded[index] is not None

    def load(ref: InputRef, index: int | None = None) -> torch.Tensor:
        if index is not None and streamed(index):
            tensor = loaded[index]  # type: ignore[index]
        else:
            tensor = load_input(checkpoints[ref.model], ref)
            tensor = tensor if rows is None else tensor[rows[0] : rows[1]]
        if monitor is not None:
            monitor.check_input(ref.model, ref.tensor, tensor, None if rows is None else rows[0])
        return tensor

    def checked(out: torch.Tensor) -> torch.Tensor:
        if monitor is not None:
            monitor.check_output(recipe.name, [(ref.model, ref.tensor) for ref in recipe.inputs], out)
        return out

    if recipe.op == "copy":
        tensor = load(recipe.inputs[0], 0)
        same = tensor.dtype == out_dtype and not explicit_dtype
        if explicit_dtype and tensor.is_floating_point():
            tensor = tensor.to(compute_dtype)  # mergekit loads in `dtype` first; the rounding must match
        return tensor.to(out_dtype) if same else checked(tensor.to(out_dtype))  # a conversion may overflow
    if recipe.op != "merge":
        from .ops import get_op

        out = get_op(recipe.op)(recipe, load).to(out_dtype).cpu().contiguous()
        _check_shape(recipe, out, shape)
        return checked(out)
    spec = require_method(recipe.method or "")

    def release_input(index: int, ref: InputRef) -> None:
        if streamed(index):
            if spent is not None:
                spent(index)
        else:
            advise_inputs(recipe, checkpoints, "dontneed", rows, only=ref)

    tensors: list[torch.Tensor] = []
    mapped_refs: dict[int, InputRef] = {}  # inputs the method reads straight from a mapping or a feed buffer
    for index, ref in enumerate(recipe.inputs):
        mapped = load(ref, index)
        tensor = mapped.to(device=device, dtype=compute_dtype)
        if tensor.data_ptr() == mapped.data_ptr():
            mapped_refs[index] = ref
        else:  # converted or moved: the mapped pages (or the feed's buffer) are spent already
            release_input(index, ref)
        tensors.append(tensor)

    def release(index: int) -> None:
        if index in mapped_refs:
            release_input(index, mapped_refs[index])

    generator = None
    if recipe.seed is not None:
        # Always a CPU generator, whatever the compute device: methods draw their random masks on the
        # CPU and move them over, so the output bytes of a seed do not depend on the device (which is
        # not in the plan's fingerprint, so a resume on another device must draw the same masks).
        generator = torch.Generator(device="cpu")
        generator.manual_seed(recipe.seed)
    # Methods that draw by entry position get the seed's keyed stream, and where these rows start.
    stream = MaskStream(recipe.seed) if recipe.seed is not None and spec.keyed_random else None
    offset = 0 if rows is None else rows[0] * (recipe.numel() // max(recipe.shape[0], 1))
    inputs = MergeInputs(
        tensors=tensors,
        base_index=recipe.base_index,
        model_params=[dict(p) for p in recipe.model_params],
        params=dict(recipe.params),
        generator=generator,
        tensor_name=recipe.name,
        release=release,
        stream=stream,
        offset=offset,
        totals=totals,
        whole_numel=recipe.numel(),
    )
    try:
        if gather is not None:
            assert spec.totals is not None
            gather.state = spec.totals.gather(gather.state, inputs)
            return None
        merged = spec.merge(inputs)
    except ValueError as exc:
        # A method refuses its inputs or parameters (the plan-time checks catch what they can): the user's
        # merge, not a bug; one line naming the tensor. Finished shards stay journaled for a rerun.
        raise MethodError.of(recipe, exc) from exc
    _check_shape(recipe, merged, shape)
    return checked(merged.to(dtype=out_dtype).cpu())


@dataclass
class Gathered:
    """The state of a method's totals pass between row blocks (see registry.TotalsPass)."""

    state: Any = None


def advise_inputs(
    recipe: TensorRecipe,
    checkpoints: dict[str, Checkpoint],
    advice: str,
    rows: tuple[int, int] | None = None,
    only: InputRef | None = None,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Read-ahead ("willneed") or release ("dontneed", "uncache": see Checkpoint.advise) the input bytes a recipe
    (or row block) uses
    (`only`: those of one of its inputs; `skip`: not those of these input indices, which are read
    around the memory map)."""
    for index, ref in enumerate(recipe.inputs if only is None else (only,)):
        if only is None and index in skip:
            continue
        ckpt = checkpoints[ref.model]
        info = ckpt.tensors.get(ref.tensor)
        if info is None:
            continue
        if rows is None or not info.shape:
            ckpt.advise(ref.tensor, advice)
            continue
        row_bytes = info.nbytes // max(info.shape[0], 1)
        start, end = min(rows[0], info.shape[0]), min(rows[1], info.shape[0])
        if end > start:
            ckpt.advise(ref.tensor, advice, start * row_bytes, end * row_bytes)


def read_ahead_end(mapped_bytes: Callable[[int], int], count: int, index: int, prefetched: int, limit: int) -> int:
    """Where the read-ahead should end when recipe `index` (of `count`) is admitted: past the recipes from
    `index` on whose mapped input bytes, counted from `index`, first reach `limit`; never before `prefetched`
    (what is advised already stays advised).

    Counting from `index`, not from the end of the last advice, is what bounds it: counted from there, every
    admission advised another `limit` bytes, and the whole model was queued within a few seconds (7B ties in a
    12.7 GB cgroup read 84 GB for 43.5 GB of inputs, the pages evicted before use; 68 GB bounded, see
    bench/README.md)."""
    ahead, position = 0, index
    while position < count and ahead < limit:
        ahead += mapped_bytes(position)
        position += 1
    return max(prefetched, position)


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

    @classmethod
    def of(cls, options: MergeOptions) -> ExecutionSettings:
        """The settings a merge's options give."""
        return cls(options.threads, options.max_memory, options.device, options.strict, options.ray_address)


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
        self.compute_dtype = to_torch(self.plan.compute_dtype)
        self.explicit_dtype = bool(self.plan.options.get("explicit_dtype"))
        self._lock = threading.Lock()
        self._writers: dict[str, ShardWriter] = {}
        self._remaining: dict[str, int] = {}
        self._done = 0
        self._bytes = 0
        self._error: BaseException | None = None
        self._feed: InputFeed | None = None
        self._kernel_groups: list[KernelGroup] = []
        self._uncache_inputs = False  # set by run(): see inputs_exceed_room
        self.monitor = NonFiniteMonitor(self.settings.strict)  # NaN/inf in inputs and outputs; `warnings()` after run

    def _open_writer(self, shard: ShardPlan) -> ShardWriter:
        writer = ShardWriter(
            self.out_dir / shard.filename,
            partial_path(self.out_dir, shard.filename),
            [(r.name, r.dtype, r.shape) for r in shard.recipes],
            resume=self.journal.partial.get(shard.filename),
            root=self.out_dir,
        )
        self._writers[shard.filename] = writer
        return writer

    def _warm_kernels(self, recipes: list[TensorRecipe]) -> None:
        """Start compiling (or loading) the compiled loops the recipes will use, in the background, while the feed
        probes the disk and reads ahead, not in the first worker to need them (~0.3-0.4 s each from numba's cache,
        2-20 s to compile on a fresh install): DARE's and DELLA's (keyed_kernels), and the task-vector family's
        bf16 steps and TIES' replay. No worker waits for them: until a group is ready, the methods take their
        uncompiled path (the same bytes; compiled.KernelGroup)."""
        if self.device.type != "cpu":
            return
        groups = kernel_groups(recipes)
        for group in groups:
            group.start()
        self._kernel_groups = groups

    def run(self) -> None:
        pending = [s for s in self.plan.shards if s.filename not in self.journal.finished]
        total = len(self.plan.recipes)
        # A resumed run starts its counters at what earlier runs finished (whole shards and the
        # journaled tensors of partial ones), so the bar and its ETA continue where they stopped.
        finished = [s for s in self.plan.shards if s.filename in self.journal.finished]
        self._done = sum(len(s.recipes) for s in finished)
        self._bytes = sum(s.data_bytes for s in finished)
        work: list[tuple[ShardPlan, TensorRecipe]] = []
        for shard in pending:
            writer = self._open_writer(shard)
            done = writer.done
            self._done += len(done)
            self._bytes += sum(r.nbytes for r in shard.recipes if r.name in done)
            todo = [r for r in shard.recipes if r.name not in done]
            self._remaining[shard.filename] = len(todo)
            if not todo:
                self._finish_shard(shard.filename)
            work.extend((shard, r) for r in todo)
        self.resumed_tensors = self._done
        self._emit(None)
        self._warm_kernels([recipe for _, recipe in work])

        cost_of = {r.name: recipe_memory(r, self.plan.compute_dtype) for r in self.plan.recipes}
        self._uncache_inputs = inputs_exceed_room([recipe for _, recipe in work], self.ckpts, memory_room().available)
        # what this process may really use (cgroup limit, available memory), sampled while it runs
        watch = MemoryWatch().start() if self.watch_memory and work else None
        # the feed's read-ahead buffers: a quarter of the budget, or of the room there is when none was given
        sizing = self.budget.limit if self.budget.limit is not None or watch is None else watch.capacity()
        feed_bytes = pool_bytes(sizing)
        if self.budget.limit is None:
            self.budget.limit = automatic_budget(list(cost_of.values()), self.threads)
        costs = [cost_of[recipe.name] for _, recipe in work]
        self.budget.watch, self.budget.held_bytes = watch, feed_bytes
        try:
            self._feed = open_feed([recipe for _, recipe in work], self.ckpts, feed_bytes)
            self.budget.held_unmapped = self._feed.reader.pool.unmapped if self._feed is not None else (lambda: 0)
            self._run_work(work, costs)
        finally:
            if self._feed is not None:
                self._feed.close()
                self._feed = None
            if self.budget.watch is not None:
                self.budget.watch.stop()
            try:  # an interrupt or a memory shortage ends the run here too: what is durable gets journaled
                self._journal_progress()
            finally:
                # and the unfinished shards' files and writer threads close now, not when a traceback
                # that holds this executor (a notebook keeps the last one) is finally dropped
                for writer in list(self._writers.values()):
                    writer.close()
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

    def _run_work(self, work: list[tuple[ShardPlan, TensorRecipe]], costs: list[int]) -> None:
        """Admit the work to the thread pool under the memory budget and wait for all of it."""
        slots = threading.Semaphore(self.threads)
        flusher_done = threading.Event()
        flusher = threading.Thread(target=self._flush_loop, args=(flusher_done,), name="merge-flush", daemon=True)
        flusher.start()
        prefetched = 0
        waiting = list(range(len(work)))  # indices into work, in plan order, not yet admitted
        head_passed = 0  # recipes admitted ahead of waiting[0] since it first waited
        try:
            with intra_op_threads.shared_between(self.threads), ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix="merge"
            ) as pool:
                futures: list[Future[None]] = []
                try:
                    while waiting and not self._stopping():
                        if not slots.acquire(timeout=0.2):
                            continue
                        window = waiting[: ADMISSION_WINDOW if head_passed < ADMISSION_WINDOW else 1]
                        try:
                            position = self.budget.acquire_first([costs[i] for i in window], self.stop)
                        except MemoryShortage as exc:
                            raise self._shortage(exc, work[window[0]][1]) from None
                        if position is None:
                            slots.release()
                            break
                        head_passed = head_passed + 1 if position else 0
                        index = waiting.pop(position)
                        shard, recipe = work[index]
                        prefetched = self._prefetch(work, index, prefetched)
                        futures.append(pool.submit(self._run_one, shard, recipe, costs[index], slots))
                except BaseException:
                    # Ctrl-C in a notebook (KeyboardInterrupt lands in this thread) or a memory shortage:
                    # the tensors in flight finish and are journaled, so a rerun resumes after them.
                    self.stop.set()
                    raise
                finally:
                    for f in futures:
                        f.exception()  # wait for everything in flight
        finally:
            flusher_done.set()
            flusher.join()

    def _shortage(self, exc: MemoryShortage, recipe: TensorRecipe) -> MemoryShortage:
        """The one-line error: which tensor, how much it needed and had, and what is saved for the rerun."""
        return MemoryShortage(
            f"not enough memory: tensor {recipe.name!r} {exc}; stopped with {self._done} of "
            f"{len(self.plan.recipes)} tensors saved, rerun with more memory to resume",
            exc.needed,
            exc.available,
        )

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._error is not None

    def _run_one(self, shard: ShardPlan, recipe: TensorRecipe, cost: int, slots: threading.Semaphore) -> None:
        try:
            if self._stopping():
                return
            if not self._write_recipe(self._writers[shard.filename], recipe):
                return
            with self._lock:
                self._done += 1
                self._bytes += recipe.nbytes
                self._remaining[shard.filename] -= 1
                last = self._remaining[shard.filename] == 0
            if last:
                self._finish_shard(shard.filename)
            self._emit(recipe)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            if cost >= TRIM_AFTER_BYTES:
                release_free_heap()
            self.budget.release(cost)
            slots.release()

    def _write_recipe(self, writer: ShardWriter, recipe: TensorRecipe) -> bool:
        """Compute one recipe and write it, in row blocks when it is large and elementwise.

        Returns False when a stop request left the tensor unwritten."""
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
                writer.write(recipe.name, out)
                try:  # a copy's output may still be a view of its input's map, read by the write itself
                    self._check_mapped(recipe, None)
                except CheckpointError:
                    writer.forget(recipe.name)
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
                monitor=self.monitor,
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

    def _finish_shard(self, filename: str) -> None:
        with self._lock:
            writer = self._writers.pop(filename)
        checksum = writer.finish()
        with self._lock:
            self.journal.finished[filename] = {"size": writer.size, "checksum": checksum}
            self.journal.partial.pop(filename, None)
            self.journal.save()

    def _flush_loop(self, done: threading.Event) -> None:
        """Background writeback: every interval, make written tensors durable and journal them.

        Doing this off the worker threads overlaps the disk's writeback with reading and merging
        (instead of one long fsync per shard at the end) and never stalls a worker on the disk."""
        while not done.wait(JOURNAL_INTERVAL_S):
            try:
                self._journal_progress()
            except OSError as exc:  # e.g. ENOSPC at writeback: hand it to the main thread
                with self._lock:
                    if self._error is None:
                        self._error = exc
                return

    def _journal_progress(self) -> None:
        """Record the durable tensors of shards in progress (fdatasync outside the executor's lock)."""
        with self._lock:
            writers = list(self._writers.items())
        synced = {name: writer.sync() for name, writer in writers}
        with self._lock:
            for name, crcs in synced.items():
                if name not in self.journal.finished:
                    self.journal.partial[name] = crcs
            self.journal.save()

    def _prefetch(self, work: list[tuple[ShardPlan, TensorRecipe]], index: int, prefetched: int) -> int:
        """Ask the kernel to read ahead the memory-mapped inputs of the next recipes (up to PREFETCH_BYTES
        of them from the one being admitted), so cold-cache reads overlap the merging of earlier tensors;
        the feed reads the others itself. Returns the end of what is now advised."""

        def mapped_bytes(position: int) -> int:
            recipe = work[position][1]
            streamed = self._streamed(recipe)
            return sum(
                self.ckpts[ref.model].info(ref.tensor).nbytes
                for i, ref in enumerate(recipe.inputs)
                if i not in streamed and ref.tensor in self.ckpts[ref.model].tensors
            )

        end = read_ahead_end(mapped_bytes, len(work), index, prefetched, PREFETCH_BYTES)
        for position in range(max(prefetched, index), end):
            recipe = work[position][1]
            advise_inputs(recipe, self.ckpts, "willneed", skip=self._streamed(recipe))
        return end

    def _emit(self, recipe: TensorRecipe | None) -> None:
        if self.on_progress is not None:
            self.on_progress(ProgressEvent(self._done, len(self.plan.recipes), self._bytes, recipe))
