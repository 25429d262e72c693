"""Reading inputs around the page cache (io.direct_read) and ahead of the workers (engine.execution.input_feed).

What must hold: the bytes of any range, at any alignment, are exactly the file's, whether they come
around the cache, from the cache, or through a filesystem that refuses O_DIRECT; the pool never holds
more than its limit and a block taken out of order never waits for it; a merge through the feed writes
the same bytes as one through memory maps; errors name the file."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mergesmith.engine.execution.compute import compute
from mergesmith.engine.execution.input_feed import MERGE, InputFeed, open_feed, part_of
from mergesmith.engine.plan import InputRef, TensorRecipe
from mergesmith.io import direct_read, direct_write
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.io.direct_read import ALIGN, BufferPool, DirectReader, capacity_for

from .helpers import direct_io_works, ties_recipe, weight_files


@pytest.fixture(autouse=True)
def direct_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(direct_write.ENV, raising=False)




def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def _read(reader: DirectReader, path: Path, offset: int, length: int) -> bytes:
    (memory,) = reader.pool.take_all([capacity_for(length)])
    buffer = reader.submit(path, offset, length, memory, True).result()
    try:
        return bytes(memoryview(buffer.memory)[buffer.start : buffer.start + buffer.length])
    finally:
        buffer.release()


RANGES = [(0, 1), (1, 4095), (4095, 2), (4096, 4096), (12345, 100_000), (3, 3 * ALIGN + 5), (0, 300_000)]


def test_capacity_covers_the_aligned_span_at_any_offset() -> None:
    for length in (1, 2, 4095, 4096, 4097, 1 << 20, (2 << 20) + 7, 5_000_001):
        capacity = capacity_for(length)
        for offset in (0, 1, 2048, 4095, 4096, 123_457):
            lo = offset // ALIGN * ALIGN
            hi = -(-(offset + length) // ALIGN) * ALIGN
            assert hi - lo <= capacity, (length, offset)
    assert capacity_for(2 << 20) == (2 << 20) + (1 << 18)  # 256 KB steps from 1 MB up: 2 MB plus the alignment slack
    assert capacity_for(1 << 19) == 1 << 20  # powers of two below
    assert capacity_for(100) == 2 * ALIGN


@pytest.mark.parametrize("cached", [False, True], ids=["around-the-cache", "from-the-cache"])
def test_any_range_reads_the_files_bytes(tmp_path: Path, cached: bool) -> None:
    path = tmp_path / "data.bin"
    data = _random_file(path, 300_000)
    if not direct_io_works(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    reader = DirectReader(BufferPool(4 << 20))
    try:
        for offset, length in RANGES:
            if cached:
                path.read_bytes()
            else:
                _drop_cache(path)
            assert _read(reader, path, offset, length) == data[offset : offset + length], (offset, length)
        assert reader._file(path).direct is not None
    finally:
        reader.close()


def test_residency_is_seen_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    _random_file(path, 64 * ALIGN)
    if direct_read._MINCORE is None:
        pytest.skip("no mincore on this platform")
    file = direct_read._File(path)
    try:
        _drop_cache(path)
        assert not file.resident(0, 64 * ALIGN)
        with open(path, "rb") as f:
            f.seek(8 * ALIGN)
            f.read(4 * ALIGN)
        assert file.resident(8 * ALIGN + 5, 3 * ALIGN)
        assert not file.resident(0, 64 * ALIGN)  # the rest is still on disk: checking read none of it
        _drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: only the page read is cached
            os.pread(fd, ALIGN, 8 * ALIGN)
        finally:
            os.close(fd)
        if file.resident(8 * ALIGN, ALIGN):  # a range whose first page is cached and the rest is not
            assert not file.resident(8 * ALIGN, 40 * ALIGN)
    finally:
        file.close()


def test_a_filesystem_that_refuses_direct_reads_is_read_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.bin"
    data = _random_file(path, 300_000)
    if not direct_io_works(path):
        pytest.skip("this filesystem refuses O_DIRECT at open already")
    reader = DirectReader(BufferPool(4 << 20))
    real_preadv = os.preadv
    refused: list[int] = []

    def preadv(fd: int, buffers: list[memoryview], offset: int, *flags: int) -> int:
        if fd == reader._file(path).direct:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    try:
        for offset, length in RANGES:
            _drop_cache(path)
            assert _read(reader, path, offset, length) == data[offset : offset + length]
        assert len(refused) == 1  # refused once, then never tried again
        assert reader._file(path).refused
    finally:
        reader.close()


def test_a_file_cut_short_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    _random_file(path, 10_000)
    reader = DirectReader(BufferPool(1 << 20))
    try:
        with pytest.raises(direct_read.CheckpointError, match=r"data\.bin: the file ends at 10000 bytes"):
            _read(reader, path, 9_000, 2_000)
        assert reader.pool.in_use == 0
    finally:
        reader.close()


def test_pool_reuses_buffers_and_waits_when_full() -> None:
    pool = BufferPool(8 << 20)
    first = pool.take_all([3 << 20, 3 << 20])
    assert first is not None and pool.in_use == 6 << 20
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take_all([3 << 20])))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # 9 MB would not fit in 8
    kept = first[0]
    pool.give(kept)
    waiter.join(5)
    assert got and got[0] is not None and got[0][0] is kept  # the freed buffer of that size, reused
    assert pool.in_use == 6 << 20

    stop = threading.Event()
    stop.set()
    assert pool.take_all([4 << 20], stop) is None


def test_a_block_larger_than_the_pool_is_let_in_alone() -> None:
    """A whole large tensor's buffers exceed the pool: they wait until nothing else is in use, and nothing
    else gets in beside them (a feed never holds two giants, whatever their size)."""
    pool = BufferPool(8 << 20)
    (small,) = pool.take_all([2 << 20])
    got: list[object] = []
    giant = threading.Thread(target=lambda: got.append(pool.take_all([16 << 20, 16 << 20])))
    giant.start()
    giant.join(0.3)
    assert giant.is_alive()
    pool.give(small)
    assert pool._free_bytes == 2 << 20 or not giant.is_alive()
    giant.join(5)
    assert got and got[0] is not None and pool.in_use == 32 << 20
    assert pool._free_bytes == 0  # the spare small buffer was unmapped when the giant came in
    stop = threading.Event()
    late = threading.Thread(target=lambda: got.append(pool.take_all([1 << 20], stop)))
    late.start()
    late.join(0.3)
    assert late.is_alive()  # nothing beside a giant
    for memory in got[0]:
        pool.give(memory)
    late.join(5)
    assert len(got) == 2 and pool.in_use == 1 << 20 and pool._free_bytes == 0  # giants are not kept


def test_pool_drops_spare_buffers_of_other_sizes_to_make_room() -> None:
    pool = BufferPool(4 << 20)
    a, b = pool.take_all([2 << 20, 2 << 20])
    pool.give(a)
    pool.give(b)
    (c,) = pool.take_all([3 << 20])
    assert len(c) == 3 << 20 and pool.in_use + pool._free_bytes <= pool.limit


def test_buffers_read_outside_the_pools_count_come_back_as_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reads a block itself (ahead of the feed) gets spares where the pool has them, and its buffers
    come back as spares: within the limit where there is room, else up to UNCOUNTED_SPARE_BYTES beyond it; past
    that they are unmapped. Fresh memory costs the kernel a zeroed page per touch; reused, none."""
    monkeypatch.setattr(direct_read, "UNCOUNTED_SPARE_BYTES", 4 << 20)
    mapped: list[int] = []
    real = direct_read.anonymous_buffer
    monkeypatch.setattr(direct_read, "anonymous_buffer", lambda size: mapped.append(size) or real(size))
    pool = BufferPool(16 << 20)
    counted = pool.take_all([8 << 20, 8 << 20])  # the feed fills the pool
    assert counted is not None and len(mapped) == 2
    own = pool.spares([2 << 20, 2 << 20, 2 << 20])  # no spare yet: fresh
    assert len(mapped) == 5 and pool.in_use == 16 << 20
    for memory in own:
        pool.recycle(memory)  # the pool is full: two kept beyond its limit, the third unmapped
    assert pool._uncounted_bytes == 4 << 20 and pool._free_bytes == 0
    again = pool.spares([2 << 20, 2 << 20])
    assert len(mapped) == 5 and {id(m) for m in again} <= {id(m) for m in own}  # reused, nothing mapped
    assert pool._uncounted_bytes == 0
    for memory in counted:
        pool.give(memory)  # 16 MB of spares: the limit
    pool.recycle(again[0])
    assert pool._free_bytes == 16 << 20 and pool._uncounted_bytes == 2 << 20
    pool.close()
    assert pool._free_bytes == 0 and pool._uncounted_bytes == 0 and not pool._free and not pool._uncounted

    small = BufferPool(16 << 20)  # beyond its limit a quarter of it: 4 MB, not UNCOUNTED_SPARE_BYTES
    monkeypatch.setattr(direct_read, "UNCOUNTED_SPARE_BYTES", 32 << 20)
    assert small.take_all([16 << 20]) is not None
    for memory in small.spares([2 << 20] * 3):
        small.recycle(memory)
    assert small._uncounted_bytes == 4 << 20
    small.close()

    roomy = BufferPool(4 << 20)
    (own_one,) = roomy.spares([2 << 20])
    before = len(mapped)
    roomy.recycle(own_one)  # room within the limit: a spare the pool counts, which the feed's next take reuses
    assert roomy._free_bytes == 2 << 20 and roomy._uncounted_bytes == 0
    taken = roomy.take_all([2 << 20])
    assert taken is not None and taken[0] is own_one and len(mapped) == before
    roomy.close()


def test_a_workers_own_reads_reuse_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks taken before the feed reaches them, one after another, are read into the same buffers again."""
    checkpoints, values = _checkpoints(tmp_path)
    if not direct_io_works(checkpoints["a"].files[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    mapped: list[int] = []
    real = direct_read.anonymous_buffer
    monkeypatch.setattr(direct_read, "anonymous_buffer", lambda size: mapped.append(size) or real(size))
    recipe = _recipe("w", (300, 700), "BF16")
    blocks = [(recipe, (r, min(r + 50, 300)), MERGE) for r in range(0, 300, 50)]
    reader = DirectReader(BufferPool(3 * capacity_for(50 * 700 * 2)))  # one block's three inputs
    feed = InputFeed(blocks, checkpoints, reader)  # not started: every block is read by its taker
    try:
        for _, rows, _ in reversed(blocks):
            loaded = feed.take(recipe, rows)
            assert loaded is not None
            for model, tensor in zip("abc", loaded):
                assert torch.equal(tensor, values[model]["w"][rows[0] : rows[1]]), (model, rows)
            feed.done(recipe, rows)
    finally:
        feed.close()
    assert len(mapped) == 3  # the first block's three buffers, then the same ones for every later block


# ----- the feed ------------------------------------------------------------------------------------


def _checkpoints(tmp_path: Path) -> tuple[dict[str, Checkpoint], dict[str, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    values: dict[str, dict[str, torch.Tensor]] = {}
    checkpoints = {}
    for name, vocab in (("a", 1000), ("b", 1003), ("c", 997)):
        tensors = {
            "embed": torch.randn(vocab, 96, generator=g).to(torch.bfloat16),
            "w": torch.randn(300, 700, generator=g).to(torch.bfloat16),
            "norm": torch.randn(96, generator=g),
            "scale": torch.tensor(1.5),
            "empty": torch.zeros(0, 4),
        }
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        values[name] = tensors
        checkpoints[name] = Checkpoint.open(str(path))
    return checkpoints, values


def _recipe(name: str, shape: tuple[int, ...], dtype: str, rows: int | None = None) -> TensorRecipe:
    return TensorRecipe(
        name=name,
        shape=shape,
        dtype=dtype,
        op="merge",
        inputs=tuple(InputRef(m, name, rows) for m in "abc"),
        method="linear",
        model_params=tuple((("weight", w),) for w in (0.5, 0.3, 0.2)),
        params=(("normalize", True),),
    )


def test_block_parts_cut_and_pad_rows_like_the_memory_map(tmp_path: Path) -> None:
    checkpoints, values = _checkpoints(tmp_path)
    if not direct_io_works(checkpoints["a"].files[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    reader = DirectReader(BufferPool(16 << 20))
    blocks = [((0, 400), 1001), ((400, 1001), 1001), ((990, 1001), 1001), ((0, 1001), 1001)]
    recipe = _recipe("embed", (1001, 96), "BF16", 1001)
    feed = InputFeed([(recipe, rows, MERGE) for rows, _ in blocks[:3]], checkpoints, reader)
    try:
        for rows, out_rows in blocks[:3]:
            loaded = feed.take(recipe, rows)
            assert loaded is not None
            for model, tensor in zip("abc", loaded):
                source = values[model]["embed"][:out_rows]
                expected = torch.zeros(out_rows, 96, dtype=torch.bfloat16)
                expected[: source.shape[0]] = source
                assert tensor is not None and torch.equal(tensor, expected[rows[0] : rows[1]]), (model, rows)
            feed.done(recipe, rows)
        part = part_of(checkpoints["c"], InputRef("c", "embed", 1001), (990, 1001))
        assert part is not None and part.shape == (7, 96) and part.pad_rows == 4
    finally:
        feed.close()
    assert reader.pool.in_use == 0


def test_a_block_taken_before_the_feed_reaches_it_is_read_at_once(tmp_path: Path) -> None:
    """The pool holds one block; the feed waits for it with blocks queued. A worker that takes the last block
    first (admitted out of order) must get it without waiting, and the feed must skip it later."""
    checkpoints, values = _checkpoints(tmp_path)
    if not direct_io_works(checkpoints["a"].files[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    recipe = _recipe("w", (300, 700), "BF16")
    blocks = [(recipe, (r, min(r + 50, 300)), MERGE) for r in range(0, 300, 50)]
    reader = DirectReader(BufferPool(3 * capacity_for(50 * 700 * 2)))
    feed = InputFeed(blocks, checkpoints, reader)
    feed.start()
    failures: list[BaseException] = []

    def consume() -> None:
        try:
            for _, rows, _ in [blocks[-1], *blocks[:-1]]:  # the last first, while the feed holds the first
                loaded = feed.take(recipe, rows)
                assert loaded is not None
                for model, tensor in zip("abc", loaded):
                    assert torch.equal(tensor, values[model]["w"][rows[0] : rows[1]]), (model, rows)
                feed.done(recipe, rows)
                assert reader.pool.in_use <= reader.pool.limit
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failures.append(exc)

    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    worker.join(30)
    try:
        assert not worker.is_alive(), "a worker waited for buffers the feed held for later blocks"
        assert not failures, failures
    finally:
        feed.close()
    assert reader.pool.in_use == 0


def test_closing_a_feed_mid_way_gives_every_buffer_back(tmp_path: Path) -> None:
    checkpoints, _ = _checkpoints(tmp_path)
    recipe = _recipe("w", (300, 700), "BF16")
    feed = open_feed([recipe], checkpoints, 4 << 20)
    if feed is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    pool = feed.reader.pool
    loaded = feed.take(recipe, (0, 300))
    assert loaded is not None
    feed.close()  # taken but never done: an interrupted merge
    assert pool.in_use == 0


def test_nothing_is_fed_where_direct_reads_are_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints, _ = _checkpoints(tmp_path)
    monkeypatch.setenv(direct_write.ENV, "0")
    assert open_feed([_recipe("w", (300, 700), "BF16")], checkpoints, 4 << 20) is None


def test_compute_from_fed_blocks_equals_compute_from_the_map(tmp_path: Path) -> None:
    checkpoints, _ = _checkpoints(tmp_path)
    recipes = [
        _recipe("embed", (997, 96), "BF16", 997),
        _recipe("w", (300, 700), "BF16"),
        _recipe("norm", (96,), "F32"),
        _recipe("scale", (), "F32"),
        _recipe("empty", (0, 4), "F32"),
    ]
    feed = open_feed(recipes, checkpoints, 4 << 20)
    if feed is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    args = (checkpoints, torch.float32, False, torch.device("cpu"))
    try:
        for recipe in recipes:
            rows = (0, recipe.shape[0] if recipe.shape else 1)
            loaded = feed.take(recipe, rows)
            if recipe.name == "empty":
                assert loaded is None or all(t is None or t.numel() == 0 for t in loaded)
            fed = compute(recipe, *args, loaded=loaded)
            mapped = compute(recipe, *args)
            assert fed.dtype == mapped.dtype and torch.equal(fed, mapped), recipe.name
            feed.done(recipe, rows)
    finally:
        feed.close()


@pytest.mark.parametrize("method", ["linear", "ties", "dare_ties", "della", "passthrough"])
def test_a_merge_through_the_feed_writes_the_same_bytes_as_through_maps(
    tmp_path: Path, tiny_models, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    from mergesmith.engine.execution import blocks
    from mergesmith.engine.execution import input_feed as input_stream
    from mergesmith.engine.run import MergeOptions, build_plan, run_merge

    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 64)  # tiny tensors in many row blocks
    base = tiny_models("llama", seed=0)
    others = [tiny_models.derive(base, seed=s) for s in (1, 2)]
    if not direct_io_works(weight_files(base)[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    if method == "passthrough":
        config = {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(base), "layer_range": [0, 2]}]},
                {"sources": [{"model": str(others[0]), "layer_range": [1, 2]}]},
            ],
            "dtype": "bfloat16",
        }
    else:
        extra = {"density": 0.6} if method in ("ties", "dare_ties", "della") else {}
        models = [{"model": str(m), "parameters": {"weight": w, **extra}} for m, w in zip(others, (0.6, 0.4))]
        config = {"merge_method": method, "base_model": str(base), "models": models, "dtype": "bfloat16"}
        if method == "linear":
            config["models"].append({"model": str(base), "parameters": {"weight": 0.2}})
    import yaml

    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config))
    fed_blocks: list[int] = []
    real_open = input_stream.open_feed

    def counting(*args, **kwargs):
        feed = real_open(*args, **kwargs)
        fed_blocks.append(len(feed) if feed is not None else 0)
        return feed

    monkeypatch.setattr("mergesmith.engine.execution.local_executor.open_feed", counting)
    monkeypatch.setenv(input_stream.SECOND_READ_ENV, "disk")  # tiny files: the probe could not tell
    run_merge(path, tmp_path / "fed", MergeOptions(random_seed=7))  # DARE and DELLA: the same masks both times
    recipes = build_plan(path, MergeOptions())[0].recipes
    tensors = len(recipes)
    # every tensor fed; those of elementwise methods and copies in many row blocks, the others whole; TIES' large
    # tensors take a totals pass over their blocks first, and the merge pass takes the blocks that pass read (tiny
    # tensors: all fit the pool's share, input_feed.KEEP_PARTS), so each block is fed once (tests/test_read_once.py)
    if method in ("ties", "dare_ties", "della"):  # the rescale of DARE and DELLA needs L1 norms first
        two_pass = [r for r in recipes if blocks.two_pass(r)]
        assert two_pass and fed_blocks
        assert fed_blocks[0] == sum(len(blocks.row_blocks(r)) for r in recipes)
    else:
        assert fed_blocks and fed_blocks[0] > tensors
    if method in ("ties", "dare_ties", "della"):  # the second read through the page cache instead: the same bytes
        monkeypatch.setattr(input_stream, "keep_limit", lambda pool: 0)  # none kept: the second pass reads again
        monkeypatch.setenv(input_stream.SECOND_READ_ENV, "cache")
        run_merge(path, tmp_path / "cached", MergeOptions(random_seed=7))
        assert fed_blocks[-1] == sum(len(blocks.row_blocks(r)) for r in recipes if not blocks.two_pass(r))
        for fed, cached in zip(weight_files(tmp_path / "fed"), weight_files(tmp_path / "cached"), strict=True):
            assert fed.read_bytes() == cached.read_bytes(), fed.name
    monkeypatch.delenv(input_stream.SECOND_READ_ENV)
    monkeypatch.setenv(direct_write.ENV, "0")
    run_merge(path, tmp_path / "mapped", MergeOptions(random_seed=7))
    assert fed_blocks[-1] == 0
    for fed, mapped in zip(weight_files(tmp_path / "fed"), weight_files(tmp_path / "mapped"), strict=True):
        assert fed.read_bytes() == mapped.read_bytes(), fed.name


def test_a_view_of_a_pooled_buffer_does_not_block_dropping_it() -> None:
    """A spare buffer still viewed by a tensor (a copy's output, written moments ago) is unmapped later."""
    memory = mmap.mmap(-1, 1 << 20)
    view = torch.frombuffer(memory, dtype=torch.uint8, count=16)
    direct_read._unmap(memory)  # must not raise BufferError
    assert view.numel() == 16


def test_bytes_read_by_several_blocks_go_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer a frankenmerge uses twice: both reads go through the cache (the second finds it there);
    bytes read once go around it."""
    checkpoints, values = _checkpoints(tmp_path)
    if not direct_io_works(checkpoints["a"].files[0]):
        pytest.skip("this filesystem refuses O_DIRECT")
    calls: list[tuple[int, bool]] = []
    real_submit = DirectReader.submit

    def spy(self, path, offset, length, memory, pooled, through_cache=False):  # type: ignore[no-untyped-def]
        calls.append((offset, through_cache))
        return real_submit(self, path, offset, length, memory, pooled, through_cache)

    monkeypatch.setattr(DirectReader, "submit", spy)

    def copy(name: str, source: str) -> TensorRecipe:
        return TensorRecipe(name=name, shape=(300, 700), dtype="BF16", op="copy", inputs=(InputRef("a", source),))

    once = TensorRecipe(name="norm", shape=(96,), dtype="F32", op="copy", inputs=(InputRef("b", "norm"),))
    recipes = [copy("first", "w"), once, copy("again", "w")]
    feed = open_feed(recipes, checkpoints, 16 << 20)
    assert feed is not None
    try:
        for recipe in recipes:
            rows = (0, recipe.shape[0])
            (tensor,) = feed.take(recipe, rows) or [None]
            source = "b" if recipe.name == "norm" else "a"
            assert tensor is not None and torch.equal(tensor, values[source][recipe.inputs[0].tensor])
            feed.done(recipe, rows)
    finally:
        feed.close()
    w_offset = checkpoints["a"].byte_range("w")[1]  # type: ignore[index]
    assert sorted(calls) == sorted(
        [(w_offset, True), (w_offset, True), (checkpoints["b"].byte_range("norm")[1], False)]
    )  # type: ignore[index]


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_fed_inputs_go_back_as_soon_as_they_are_spent(tmp_path: Path, compute_dtype: torch.dtype) -> None:
    """As mapped pages are dropped: an input converted to the compute dtype is spent at once, and TIES is done
    with each model once its difference is taken; their buffers go back before the block is written (hundreds
    of MB at the peak of an embedding-sized TIES recipe). The base stays until the end."""
    checkpoints, _ = _checkpoints(tmp_path)
    recipe = ties_recipe()
    feed = open_feed([recipe], checkpoints, 16 << 20)
    if feed is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    pool = feed.reader.pool
    each = capacity_for(300 * 700 * 2)
    spent: list[tuple[int, int]] = []

    def release(index: int) -> None:
        feed.release(recipe, (0, 300), index)
        spent.append((index, pool.in_use))

    try:
        loaded = feed.take(recipe, (0, 300))
        assert pool.in_use == 3 * each
        fed = compute(recipe, checkpoints, compute_dtype, True, torch.device("cpu"), loaded=loaded, spent=release)
        if compute_dtype == torch.float32:  # every input converted: all spent before the method runs
            assert spent == [(0, 2 * each), (1, each), (2, 0)]
        else:  # bf16 compute: the method's own done_with, the base kept
            assert spent == [(1, 2 * each), (2, each)]
        feed.done(recipe, (0, 300))
        assert pool.in_use == 0
        assert torch.equal(fed, compute(recipe, checkpoints, compute_dtype, True, torch.device("cpu")))
    finally:
        feed.close()


def test_the_second_read_follows_the_environment_or_else_the_disks_measured_rate(monkeypatch: pytest.MonkeyPatch):
    from mergesmith.engine.execution import input_feed

    monkeypatch.delenv(input_feed.SECOND_READ_ENV, raising=False)
    fast, slow = (lambda: 2 * input_feed.REREAD_MIN_RATE), (lambda: input_feed.REREAD_MIN_RATE / 4)
    assert input_feed.second_read(fast) == "disk"
    assert input_feed.second_read(slow) == "cache"
    assert input_feed.second_read(lambda: None) == "cache"  # not measurable: the disk reads each byte once
    monkeypatch.setenv(input_feed.SECOND_READ_ENV, "cache")
    assert input_feed.second_read(fast) == "cache"
    monkeypatch.setenv(input_feed.SECOND_READ_ENV, " Disk ")
    assert input_feed.second_read(slow) == "disk"


def test_the_read_rate_probe_measures_a_large_file_and_declines_a_small_one(tmp_path: Path) -> None:
    from mergesmith.io.read_rate import direct_read_rate

    large = tmp_path / "large.bin"
    large.write_bytes(os.urandom(10 << 20))
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 100_000)
    if not direct_io_works(large):
        pytest.skip("this filesystem refuses O_DIRECT")
    rate = direct_read_rate(large, 1 << 20)
    assert rate is not None and rate > 0
    assert direct_read_rate(small) is None
    assert direct_read_rate(tmp_path / "missing.bin") is None
