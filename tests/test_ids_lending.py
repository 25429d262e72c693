"""TIES' selection over tensors too large for the ids its plan charged follows its entries by ids where the running
merge lends the memory (sort_select.lending), and by the table where it does not: the same mask either way."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mergesmith.engine.execution import blocks
from mergesmith.kernels import introsort_replay, magnitude_blocks, sort_select
from mergesmith.kernels.selection import Window

pytestmark = pytest.mark.skipif(not introsort_replay.AVAILABLE, reason="numba is not installed")


def _deltas(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, generator=g) * 0.003).bfloat16().abs()


def _spy_on_ids(patch: pytest.MonkeyPatch, buffers: list[int]) -> None:
    """Record the address of each replay's ids buffer in `buffers` (-1 for a replay without ids: the table)."""
    replay = introsort_replay.replay

    def spying(*args: Any) -> bool:
        ids = args[-1]
        buffers.append(-1 if ids is None else ids.ctypes.data)
        return replay(*args)

    patch.setattr(introsort_replay, "replay", spying)


def _select_checked(values: torch.Tensor, hi: int) -> None:
    """Select the top `hi` of `values` and check the window against torch.sort's."""
    expected = torch.zeros(values.numel(), dtype=torch.bool)
    expected[torch.sort(values.float(), descending=True).indices[:hi]] = True
    assert torch.equal(sort_select.sorted_window_mask(values.clone(), 0, hi, True), expected)


@pytest.mark.parametrize("granted", [True, False])
def test_a_lent_selection_follows_by_ids_and_gives_the_sorts_window(granted: bool, monkeypatch: Any) -> None:
    assert introsort_replay.warm()
    monkeypatch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 1000)  # this selection is over it: no ids charged
    ways: list[bool] = []
    replay = introsort_replay.replay

    def spying(*args: Any) -> bool:
        ways.append(args[-1] is not None)  # by ids, else by the table
        return replay(*args)

    monkeypatch.setattr(introsort_replay, "replay", spying)
    asked: list[int] = []
    returned: list[int] = []

    def lend(nbytes: int) -> bool:
        asked.append(nbytes)
        return granted

    values = _deltas(300_000)
    expected = torch.zeros(values.numel(), dtype=torch.bool)
    expected[torch.sort(values.float(), descending=True).indices[:150_000]] = True
    with sort_select.lending(lend, returned.append):
        mask = sort_select.sorted_window_mask(values.clone(), 0, 150_000, True)
    assert torch.equal(mask, expected)
    assert asked == [300_000 * introsort_replay.ID_BYTES]
    assert ways == [granted]
    assert returned == (asked if granted else [])
    assert sort_select._lender.lend is None  # the lender is gone after the block


def test_a_merge_lends_its_selections_memory(tmp_path: Any, tiny_models: Any, monkeypatch: Any) -> None:
    """The executor installs its budget as the lender while it runs: a TIES merge over tensors larger than
    IDS_MAX_ENTRIES borrows for them, and its output equals the merge whose selections were refused the memory."""
    from mergesmith.engine.execution.admission import MemoryBudget
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    assert introsort_replay.warm()
    models = [tiny_models("llama", seed=seed) for seed in (1, 2, 3)]
    config = tmp_path / "ties.yml"
    config.write_text(
        f"merge_method: ties\nbase_model: {models[0]}\nmodels:\n"
        + "".join(f"- model: {m}\n  parameters: {{density: 0.5, weight: 0.5}}\n" for m in models[1:])
        + "dtype: bfloat16\n"
    )
    monkeypatch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 0)
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 0)
    outputs = []
    real = MemoryBudget.lend
    for granted in (True, False):
        lent: list[int] = []

        def lend(self: MemoryBudget, nbytes: int, granted: bool = granted, lent: list[int] = lent) -> bool:
            lent.append(nbytes)
            return real(self, nbytes) if granted else False

        monkeypatch.setattr(MemoryBudget, "lend", lend)
        out = tmp_path / f"out-{granted}"
        run_merge(str(config), out, MergeOptions(threads=2))
        assert lent  # every selection asked
        outputs.append((out / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]


def test_a_thread_keeps_its_ids_within_the_merges_bound_and_the_windows_stay_the_sorts() -> None:
    """Inside lending(kept_ids=N) a selection over at most N entries leaves its ids buffer to the thread's next one,
    whose stale ids for entries it does not follow must not matter; a larger one, or any outside lending, is fresh."""
    assert introsort_replay.warm()
    buffers: list[int] = []

    def select(values: torch.Tensor) -> None:
        _select_checked(values, values.numel() // 3)

    first, second, larger = _deltas(300_000), _deltas(200_000).flip(0), _deltas(400_000)
    mp = pytest.MonkeyPatch()
    with mp.context() as patch:
        _spy_on_ids(patch, buffers)
        patch.setattr(sort_select, "_IDS", type(sort_select._IDS)())  # no buffer left by an earlier test
        select(first)
        select(second)  # outside lending: nothing kept
        assert not sort_select._IDS.arrays
        buffers.clear()
        with sort_select.lending(lambda nbytes: False, lambda nbytes: None, kept_ids=300_000):
            assert sort_select._lender.kept_ids == 300_000
            select(first)
            select(second)  # the same buffer, holding the first selection's ids
            select(larger)  # over the bound: fresh, and not kept
            select(first)
        assert sort_select._lender.kept_ids == 0
        assert [a.size for a in sort_select._IDS.arrays.values()] == [300_000]
    assert buffers[0] == buffers[1] == buffers[3] != buffers[2]
    assert sort_select.kept_ids_entries([10, 300_000, introsort_replay.IDS_MAX_ENTRIES + 1]) == 300_000
    assert sort_select.ids_bytes(300_000) == 300_000 * introsort_replay.ID_BYTES


def test_one_tensors_selections_share_a_lent_ids_buffer_while_held() -> None:
    """Inside holding_ids, consecutive selections over more entries than a thread keeps (lent ids) reuse one buffer,
    borrowing its memory again each time; a refused loan drops it at once, and the end of the block drops it too."""
    assert introsort_replay.warm()
    buffers: list[int] = []
    loans: list[int] = []
    granted = [True]

    def lend(nbytes: int) -> bool:
        loans.append(nbytes)
        return granted[0]

    values = [_deltas(400_000), _deltas(400_000).flip(0), _deltas(400_000).roll(7)]
    mp = pytest.MonkeyPatch()
    with mp.context() as patch:
        _spy_on_ids(patch, buffers)
        patch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 100_000)  # these selections borrow their ids
        patch.setattr(sort_select, "_IDS", type(sort_select._IDS)())
        with sort_select.lending(lend, lambda nbytes: None, kept_ids=100_000):
            with sort_select.holding_ids():
                for v in values[:2]:
                    sort_select.sorted_window_mask(v.clone(), 0, 1000, True)
                assert [a.size for a in sort_select._IDS.arrays.values()] == [400_000]
                granted[0] = False
                sort_select.sorted_window_mask(values[2].clone(), 0, 1000, True)  # refused: the table, no buffer
                assert not sort_select._IDS.arrays
                granted[0] = True
                sort_select.sorted_window_mask(values[0].clone(), 0, 1000, True)
            assert not sort_select._IDS.arrays  # dropped at the end of the block
            sort_select.sorted_window_mask(values[1].clone(), 0, 1000, True)  # not held: fresh, not kept
            assert not sort_select._IDS.arrays
    assert buffers[0] == buffers[1] and buffers[2] == -1 and len(loans) == 5
    assert all(n == sort_select.ids_bytes(400_000) for n in loans)


def test_a_dropped_lent_ids_buffer_is_the_next_large_tensors_on_any_thread_until_the_merge_ends() -> None:
    """At the end of holding_ids a lent buffer (over the kept size) is left as the spare, its pages lazily freed; the
    next large tensor's selections take it, on another thread too, and their windows stay the sort's. Under a
    bound that keeps nothing (a user's --max-memory) there is no spare, and none outlives the merge."""
    import threading

    assert introsort_replay.warm()
    buffers: list[int] = []

    def select_held(values: torch.Tensor) -> None:
        with sort_select.holding_ids():
            _select_checked(values, 1000)

    def on_a_thread(values: torch.Tensor) -> None:
        thread = threading.Thread(target=select_held, args=(values,))
        thread.start()
        thread.join()

    mp = pytest.MonkeyPatch()
    with mp.context() as patch:
        _spy_on_ids(patch, buffers)
        patch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 100_000)  # these selections borrow their ids
        patch.setattr(sort_select, "_IDS", type(sort_select._IDS)())
        with sort_select.lending(lambda nbytes: True, lambda nbytes: None, kept_ids=100_000):
            select_held(_deltas(400_000))
            assert not sort_select._IDS.arrays and sort_select._SPARE._buffer is not None
            on_a_thread(_deltas(300_000).flip(0))  # smaller: the spare's memory
            select_held(_deltas(500_000))  # larger than the spare: fresh, and the new spare
        assert sort_select._SPARE._buffer is None  # the merge's end drops it
        with sort_select.lending(lambda nbytes: True, lambda nbytes: None, kept_ids=0):
            select_held(_deltas(400_000))
            assert sort_select._SPARE._buffer is None
    assert buffers[0] == buffers[1] != buffers[2]


@pytest.mark.parametrize(
    ("method", "max_memory", "blocked"),
    [("ties", None, False), ("linear", None, False), ("ties", 8 << 30, False), ("ties", None, True)],
)
def test_a_merge_counts_the_ids_its_workers_keep(
    method: str, max_memory: int | None, blocked: bool, tmp_path: Any, tiny_models: Any, monkeypatch: Any
) -> None:
    """The executor lets each worker keep the ids of its largest selection (a TIES merge's largest tensor) and holds
    that memory aside in its budget for every worker; a merge that ranks nothing keeps none, nor one under a user's
    --max-memory (what is kept between recipes is outside the bound on the work in flight)."""
    from safetensors import safe_open

    from mergesmith.engine.execution.admission import MemoryBudget
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    models = [tiny_models("llama", seed=seed) for seed in (1, 2, 3)]
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: {method}\nbase_model: {models[0]}\nmodels:\n"
        + "".join(f"- model: {m}\n  parameters: {{density: 0.5, weight: 0.5}}\n" for m in models)
        + "dtype: bfloat16\n"
    )
    kept: list[int] = []
    lending = sort_select.lending

    def spying(lend: Any, repay: Any, kept_ids: int = 0) -> Any:
        kept.append(kept_ids)
        return lending(lend, repay, kept_ids)

    monkeypatch.setattr(sort_select, "lending", spying)
    held: list[int] = []
    release = MemoryBudget.release

    def watching(self: MemoryBudget, *args: Any) -> None:
        held.append(self.kept_bytes)
        release(self, *args)

    monkeypatch.setattr(MemoryBudget, "release", watching)
    if blocked:  # cut the tiny model's tensors in row blocks: TIES selects them by magnitude_blocks' totals pass
        monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 2048)
    run_merge(str(config), tmp_path / "out", MergeOptions(threads=2, max_memory=max_memory))
    with safe_open(str(models[0] / "model.safetensors"), "pt") as f:
        shapes = [torch.Size(f.get_slice(name).get_shape()) for name in f.keys()]
    largest = max(shape.numel() for shape in shapes)
    expected = largest if method == "ties" and max_memory is None and introsort_replay.AVAILABLE else 0
    assert kept == [expected]
    magnitudes = 0
    if blocked and expected:  # the largest tensor cut in blocks, and its largest block's two task vectors
        cut = [shape for shape in shapes if shape.numel() > 2 * 2048 and len(shape) > 1 and shape[0] > 1]
        biggest = max(shape.numel() for shape in cut)
        block = max(max(1, 2048 // (shape.numel() // shape[0])) * (shape.numel() // shape[0]) for shape in cut)
        magnitudes = magnitude_blocks.kept_bytes(biggest, 2 * block, 2, torch.bfloat16.itemsize)
    assert held and set(held) == {2 * (expected * introsort_replay.ID_BYTES + magnitudes)}
    assert magnitude_blocks.kept_bytes(0, 100, 2, 2) == 0
    assert magnitude_blocks.kept_bytes(1000, 100, 2, 2) == (2 * 1000 + 100) * 2 + 1000
    most = magnitude_blocks.KEPT_DELTA_ENTRIES
    assert magnitude_blocks.kept_bytes(1000, 1 << 30, 2, 2) == (2 * 1000 + most) * 2 + 1000


def test_a_worker_keeps_its_magnitudes_and_task_vectors_between_tensors_inside_lending() -> None:
    """magnitude_blocks' whole-tensor magnitudes and a block's task vectors are the worker's buffers from one tensor to
    the next inside lending(kept_ids=N) for tensors of at most N entries (no fresh memory to fault in), fresh outside
    it; the selections and merged blocks are the same either way."""
    from mergesmith.kernels.merge_inputs import MergeInputs

    rule = lambda params, n: Window(0, n // 3, True)  # noqa: E731 - TIES' top third, descending

    def run(rows: int, seed: int) -> tuple[list[int], torch.Tensor, list[Any]]:
        g = torch.Generator().manual_seed(seed)
        tensors = [(torch.randn(rows, 64, generator=g) * s).to(torch.bfloat16) for s in (1.0, 1.1, 0.9)]

        def inputs() -> MergeInputs:
            return MergeInputs(tensors=tensors, model_params=[{}, {}, {}], params={}, base_index=0,
                               whole_numel=rows * 64)

        state = magnitude_blocks.gather(rule, lambda params: False, None, inputs())
        pointers = [k.data_ptr() for k in state.keys]
        selected = magnitude_blocks.finish(rule, state)
        deltas = magnitude_blocks.sparsified(inputs(), selected)
        return pointers + [deltas.data_ptr()], deltas.clone(), selected.kept

    def same(a: tuple[list[int], torch.Tensor, list[Any]], b: tuple[list[int], torch.Tensor, list[Any]]) -> bool:
        return torch.equal(a[1], b[1]) and all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))

    mp = pytest.MonkeyPatch()
    with mp.context() as patch:
        patch.setattr(magnitude_blocks, "_BUFFERS", type(magnitude_blocks._BUFFERS)())
        outside = run(3000, 1)
        assert not magnitude_blocks._BUFFERS.pool
        with sort_select.lending(lambda nbytes: False, lambda nbytes: None, kept_ids=3000 * 64):
            first = run(3000, 1)
            second = run(2000, 2)  # smaller: the same buffers
            third = run(3000, 1)  # the same buffers, holding the second tensor's values
            assert first[0] == second[0] == third[0]
            assert set(magnitude_blocks._BUFFERS.pool) == {("keys0", torch.bfloat16, torch.device("cpu")),
                                                           ("keys1", torch.bfloat16, torch.device("cpu")),
                                                           ("deltas", torch.bfloat16, torch.device("cpu"))}
            assert list(magnitude_blocks._BUFFERS.arrays) == [("mask", np.dtype(np.bool_))]
            larger = run(4000, 3)  # over the bound: fresh, not kept
            assert larger[0][0] != first[0][0] and magnitude_blocks._BUFFERS.pool[
                ("keys0", torch.bfloat16, torch.device("cpu"))].numel() == 3000 * 64
    assert same(first, outside) and same(third, outside) and not same(second, outside)
