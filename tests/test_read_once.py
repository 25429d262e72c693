"""Two-pass merges (TIES' ranking, DARE's and DELLA's rescale norms over a tensor's row blocks) read each input byte
once: the input feed keeps the totals pass's buffers for the merge pass (engine/execution/input_feed.py).

The merged bytes are those of the merge that reads twice; every block is read once (the reader's submits counted);
the pool gets every buffer back after a normal run, a stop between the passes and an error in the merge pass; a
recipe too large for its share of the pool is still read twice; no totals pass writes into its inputs (with the
compute dtype of the inputs, they are the feed's buffers themselves)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from mergesmith.engine.execution import blocks, input_feed, local_executor
from mergesmith.engine.execution.input_feed import MERGE, TOTALS, InputFeed
from mergesmith.engine.plan import InputRef
from mergesmith.engine.run import MergeOptions, build_plan, run_merge
from mergesmith.errors import MergeInterrupted
from mergesmith.io import direct_write
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.io.direct_read import BufferPool, DirectReader, capacity_for

from .helpers import direct_io_works, ties_recipe, weight_files

METHODS = {
    "ties": {"density": 0.6},
    "dare_ties": {"density": 0.6},
    "della": {"density": 0.6, "epsilon": 0.1},
    "breadcrumbs_ties": {"density": 0.7, "gamma": 0.05},
}


@pytest.fixture(autouse=True)
def direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct_write.ENV, raising=False)
    monkeypatch.setenv(input_feed.SECOND_READ_ENV, "disk")  # tiny files: the probe could not tell
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 256)  # the tiny tensors in several row blocks each


def _direct_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Checkpoint]:
    """_files' checkpoints, their tensor cut in several 50,000-entry row blocks; the test skipped where the feed
    cannot read them around the page cache."""
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 50_000)
    checkpoints = _files(tmp_path)
    if not direct_io_works(checkpoints["a"].byte_range("w")[0]):  # type: ignore[index]
        pytest.skip("this filesystem refuses O_DIRECT")
    return checkpoints


def _config(tmp_path: Path, tiny_models, method: str, dtype: torch.dtype) -> Path:
    base = tiny_models("llama", seed=0, dtype=dtype)
    others = [tiny_models.derive(base, seed=s) for s in (1, 2)]
    if not direct_io_works(weight_files(base)[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    models = [{"model": str(m), "parameters": {"weight": w, **METHODS[method]}} for m, w in zip(others, (0.6, 0.4))]
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"  # compute dtype = input dtype: no copy
    config = {"merge_method": method, "base_model": str(base), "models": models, "dtype": name}
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class Watch:
    """The run's feeds and every read submitted to their readers, by (path, offset, length)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.feeds: list[InputFeed] = []
        self.reads: Counter[tuple[Path, int, int]] = Counter()
        self.changed: list[str] = []  # tensors a totals pass wrote into
        real_open, real_submit = input_feed.open_feed, DirectReader.submit
        real_take, real_done = InputFeed.take, InputFeed.done
        lock = threading.Lock()
        copies: dict[tuple[str, int], list[torch.Tensor | None]] = {}

        def opening(*args, **kwargs):
            feed = real_open(*args, **kwargs)
            if feed is not None:
                self.feeds.append(feed)
            return feed

        def submit(reader, path, offset, length, *args, **kwargs):
            with lock:
                self.reads[(Path(path), offset, length)] += 1
            return real_submit(reader, path, offset, length, *args, **kwargs)

        def take(feed, recipe, rows, pass_=MERGE):
            tensors = real_take(feed, recipe, rows, pass_)
            if pass_ == TOTALS and tensors is not None:
                copies[(recipe.name, rows[0])] = [None if t is None else t.clone() for t in tensors]
            return tensors

        def done(feed, recipe, rows, pass_=MERGE):
            block = feed._blocks.get((recipe.name, rows[0], pass_))
            if pass_ == TOTALS and block is not None and block.tensors is not None:
                before = copies.pop((recipe.name, rows[0]))
                for now, then in zip(block.tensors, before):
                    if now is not None and not torch.equal(_bits(now), _bits(then)):
                        self.changed.append(recipe.name)
            real_done(feed, recipe, rows, pass_)

        monkeypatch.setattr(local_executor, "open_feed", opening)
        monkeypatch.setattr(DirectReader, "submit", submit)
        monkeypatch.setattr(InputFeed, "take", take)
        monkeypatch.setattr(InputFeed, "done", done)

    def in_use(self) -> int:
        """Pool bytes still handed out after the run (the feed closed): 0 unless a buffer leaked."""
        return sum(feed.reader.pool.in_use for feed in self.feeds)


def _two_pass_reads(config: Path) -> tuple[int, int]:
    """(reads a run makes that reads every block once, reads of the two-pass recipes' blocks among them)."""
    recipes = build_plan(config, MergeOptions())[0].recipes
    once = sum(len(blocks.row_blocks(r)) * len(r.inputs) for r in recipes)
    twofold = sum(len(blocks.row_blocks(r)) * len(r.inputs) for r in recipes if blocks.two_pass(r))
    return once, twofold


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("method", list(METHODS))
def test_two_pass_merges_read_each_block_once_and_write_the_same_bytes(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch, method: str, dtype: torch.dtype
) -> None:
    config = _config(tmp_path, tiny_models, method, dtype)
    once, twofold = _two_pass_reads(config)
    assert twofold > 0
    kept = Watch(monkeypatch)
    run_merge(config, tmp_path / "kept", MergeOptions(random_seed=7))
    assert kept.in_use() == 0  # every buffer back in the pool
    assert not kept.changed  # no totals pass wrote into its inputs
    assert set(kept.reads.values()) == {1} and sum(kept.reads.values()) == once

    monkeypatch.setattr(input_feed, "keep_limit", lambda pool: 0)  # nothing kept: the merge pass reads again
    twice = Watch(monkeypatch)
    run_merge(config, tmp_path / "twice", MergeOptions(random_seed=7))
    assert twice.in_use() == 0
    assert sum(twice.reads.values()) == once + twofold
    for a, b in zip(weight_files(tmp_path / "kept"), weight_files(tmp_path / "twice"), strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_a_recipe_too_large_for_its_share_of_the_pool_is_read_twice(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, tiny_models, "ties", torch.bfloat16)
    recipes = [r for r in build_plan(config, MergeOptions())[0].recipes if blocks.two_pass(r)]
    sizes = {r.name: r.nbytes for r in recipes}
    small = min(sizes.values())
    assert max(sizes.values()) > small
    # what a recipe's blocks hold: its 3 inputs' blocks' buffers; the smallest two-pass recipes fit, the others not
    limit = sum(3 * capacity_for(2 * r.numel() // len(blocks.row_blocks(r)) + 2 * r.shape[1])
                for r in recipes if r.nbytes == small for _ in blocks.row_blocks(r)) // sum(
        1 for r in recipes if r.nbytes == small)
    monkeypatch.setattr(input_feed, "keep_limit", lambda pool: limit)
    watch = Watch(monkeypatch)
    run_merge(config, tmp_path / "out", MergeOptions())
    assert watch.in_use() == 0
    ckpts = {ref.model: Checkpoint.open(ref.model) for r in recipes for ref in r.inputs}
    for recipe in recipes:
        counts = set()
        for rows in blocks.row_blocks(recipe):
            for ref in recipe.inputs:
                part = input_feed.part_of(ckpts[ref.model], ref, rows)
                assert part is not None
                counts.add(watch.reads[(part.path, part.offset, part.length)])
        assert counts == ({1} if recipe.nbytes == small else {2}), recipe.name


def _kept_keys(feed: InputFeed, name: str) -> list:
    return [key for key, block in feed._blocks.items() if key[0] == name and block.reads is not None]


def test_a_stop_between_the_passes_gives_the_kept_blocks_back(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, tiny_models, "ties", torch.bfloat16)
    watch = Watch(monkeypatch)
    real_gather, real_write = local_executor.LocalExecutor._gather_totals, local_executor.LocalExecutor._write_recipe
    left: list[tuple[str, list]] = []

    def gather_then_stop(self, recipe, rows):
        totals = real_gather(self, recipe, rows)
        self.stop.set()  # the totals pass is done, its blocks are kept: stop before the merge pass
        return totals

    def write(self, writer, recipe):
        try:
            return real_write(self, writer, recipe)
        finally:
            left.append((recipe.name, _kept_keys(self._feed, recipe.name)))

    real_forget = InputFeed.forget
    handed: list[int] = []

    def forget(feed, recipe):
        handed.append(sum(1 for k, b in feed._blocks.items() if k[0] == recipe.name and b.tensors is not None))
        real_forget(feed, recipe)

    monkeypatch.setattr(local_executor.LocalExecutor, "_gather_totals", gather_then_stop)
    monkeypatch.setattr(local_executor.LocalExecutor, "_write_recipe", write)
    monkeypatch.setattr(InputFeed, "forget", forget)
    with pytest.raises(MergeInterrupted):
        run_merge(config, tmp_path / "out", MergeOptions(threads=1))
    name, keys = left[-1]  # one thread: the recipe stopped between its passes is the last one written
    recipes = {r.name: r for r in build_plan(config, MergeOptions())[0].recipes}
    assert handed[-1] == len(blocks.row_blocks(recipes[name])) > 1  # the merge pass's blocks, all kept
    assert keys == []  # none of its blocks is held any more
    assert watch.in_use() == 0


def test_an_error_in_the_merge_pass_gives_the_kept_blocks_back(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, tiny_models, "dare_ties", torch.bfloat16)
    watch = Watch(monkeypatch)
    real_compute, real_write = local_executor.compute, local_executor.LocalExecutor._write_recipe
    left: list[list] = []

    def failing(recipe, *args, rows=None, totals=None, **kwargs):
        if totals is not None and rows is not None and rows[0] > 0:
            raise RuntimeError("boom in the merge pass")
        return real_compute(recipe, *args, rows=rows, totals=totals, **kwargs)

    def write(self, writer, recipe):
        try:
            return real_write(self, writer, recipe)
        finally:
            left.append(_kept_keys(self._feed, recipe.name))

    monkeypatch.setattr(local_executor, "compute", failing)
    monkeypatch.setattr(local_executor.LocalExecutor, "_write_recipe", write)
    with pytest.raises(RuntimeError, match="boom"):
        run_merge(config, tmp_path / "out", MergeOptions(threads=1, random_seed=7))
    assert left and all(keys == [] for keys in left)
    assert watch.in_use() == 0


# ----- the feed itself


def _files(tmp_path: Path) -> dict[str, Checkpoint]:
    g = torch.Generator().manual_seed(0)
    checkpoints = {}
    for name in "abc":
        path = tmp_path / f"{name}.safetensors"
        save_file({"w": torch.randn(300, 700, generator=g).to(torch.bfloat16)}, str(path))
        checkpoints[name] = Checkpoint.open(str(path))
    return checkpoints



def _feed(checkpoints: dict[str, Checkpoint], pool: int, submits: list) -> tuple[InputFeed, list]:
    recipe = ties_recipe()
    cut = blocks.row_blocks(recipe)
    assert len(cut) > 1 and blocks.two_pass(recipe)
    reader = DirectReader(BufferPool(pool))
    real = reader.submit

    def counting(*args, **kwargs):
        submits.append(args[:3])
        return real(*args, **kwargs)

    reader.submit = counting  # type: ignore[method-assign]
    feed = InputFeed([(recipe, rows, p) for p in (TOTALS, MERGE) for rows in cut], checkpoints, reader)
    return feed, cut


def test_the_merge_pass_takes_the_totals_pass_tensors_without_a_read(tmp_path: Path, monkeypatch) -> None:
    checkpoints = _direct_files(tmp_path, monkeypatch)
    submits: list = []
    feed, cut = _feed(checkpoints, 16 << 20, submits)
    recipe, pool = ties_recipe(), feed.reader.pool
    assert len(feed) == len(cut)  # the feed reads the totals pass's blocks only
    feed.start()
    try:
        held = []
        for rows in cut:
            tensors = feed.take(recipe, rows, TOTALS)
            held.append(tensors)
            feed.release(recipe, rows, 1, TOTALS)  # a method done with an input: kept all the same
            feed.done(recipe, rows, TOTALS)
        assert pool.in_use == sum(3 * capacity_for(2 * 700 * (e - s)) for s, e in cut)
        reads = len(submits)
        assert reads == 3 * len(cut)
        for rows, before in zip(cut, held):
            tensors = feed.take(recipe, rows, MERGE)
            assert tensors is not None and all(a is b for a, b in zip(tensors, before))
            expected = [checkpoints[m].get("w")[rows[0] : rows[1]] for m in "abc"]
            assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
            feed.done(recipe, rows, MERGE)
        assert len(submits) == reads and pool.in_use == 0
    finally:
        feed.close()


def test_forgetting_a_recipe_between_its_passes_gives_its_kept_blocks_back(tmp_path: Path, monkeypatch) -> None:
    checkpoints = _direct_files(tmp_path, monkeypatch)
    feed, cut = _feed(checkpoints, 16 << 20, [])
    recipe, pool = ties_recipe(), feed.reader.pool
    feed.start()
    try:
        for rows in cut:
            feed.take(recipe, rows, TOTALS)
            feed.done(recipe, rows, TOTALS)
        assert pool.in_use > 0
        feed.forget(recipe)  # the method merges it whole after all (or the run stops)
        assert pool.in_use == 0
    finally:
        feed.close()


def test_a_block_a_worker_reads_itself_is_kept_only_where_the_pool_has_room(tmp_path: Path, monkeypatch) -> None:
    """The feed not started: the worker reads each block itself. Kept (counted in the pool) while there is room;
    once the pool is full, a block's merge pass reads it again."""
    checkpoints = _direct_files(tmp_path, monkeypatch)
    submits: list = []
    feed, cut = _feed(checkpoints, 8 << 20, submits)
    recipe, pool = ties_recipe(), feed.reader.pool
    each = [3 * capacity_for(2 * 700 * (e - s)) for s, e in cut]
    assert sum(each) <= input_feed.keep_limit(pool.limit)
    hog = pool.take_all([pool.limit - sum(each[:-1])])  # room for all blocks but the last
    assert hog is not None
    try:
        for rows in cut:
            feed.take(recipe, rows, TOTALS)
            feed.done(recipe, rows, TOTALS)
        assert pool.in_use == pool.limit and len(submits) == 3 * len(cut)
        for rows in cut:
            feed.take(recipe, rows, MERGE)
            feed.done(recipe, rows, MERGE)
        assert len(submits) == 3 * (len(cut) + 1)  # the last block, not kept, read again
        for memory in hog:
            pool.give(memory)
        assert pool.in_use == 0
    finally:
        feed.close()


def test_the_pool_grows_to_keep_the_largest_recipe_that_fits_its_bound(tmp_path: Path, monkeypatch) -> None:
    from mergesmith.io.direct_read import POOL_BYTES, pool_bytes

    checkpoints = _direct_files(tmp_path, monkeypatch)
    held = sum(3 * capacity_for(2 * 700 * (e - s)) for s, e in blocks.row_blocks(ties_recipe()))
    pool = input_feed.keeping_pool([ties_recipe()], input_feed.streamed_bytes(checkpoints))
    assert pool == held * input_feed.KEEP_PARTS
    # a pool that may not grow to 3 times the recipe's blocks: nothing to keep, no larger pool for it
    monkeypatch.setattr(input_feed, "KEEP_POOL_BYTES", held * input_feed.KEEP_PARTS - 1)
    assert input_feed.keeping_pool([ties_recipe()], input_feed.streamed_bytes(checkpoints)) == 0
    assert pool_bytes(None, 512 << 20) == 512 << 20 and pool_bytes(None, 0) == POOL_BYTES
    assert pool_bytes(1 << 30, 512 << 20) == 256 << 20  # never over a quarter of a memory budget


def test_plan_estimate_counts_the_pool_grown_to_keep_blocks(monkeypatch) -> None:
    """`plan`'s peak memory counts the feed's pool as the executor sizes it: grown for a 1 B MLP matrix's TIES."""
    from mergesmith.engine.planning.shared import estimate_plan
    from mergesmith.io.direct_read import POOL_BYTES

    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1 << 20)
    recipes = [
        replace(ties_recipe(), name=f"mlp{i}", shape=(5632, 2048), inputs=tuple(InputRef(m, f"mlp{i}") for m in "abc"))
        for i in range(4)
    ]
    size = 5632 * 2048 * 2
    held = sum(3 * capacity_for(size * (e - s) // 5632) for s, e in blocks.row_blocks(recipes[0]))
    assert held * input_feed.KEEP_PARTS > POOL_BYTES
    estimate = estimate_plan(recipes, lambda ref: size, "BF16", 2, None)
    assert estimate.read_ahead == held * input_feed.KEEP_PARTS
    assert estimate_plan(recipes, lambda ref: size, "BF16", 2, 512 << 20).read_ahead == 128 << 20  # a quarter
