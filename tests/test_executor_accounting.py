"""The local executor's accounting: progress counters on a resumed run, and the memory budget's admission."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import yaml

from mergesmith.engine.execution.local_executor import ProgressEvent
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import RunControls, run_merge
from mergesmith.errors import MergeInterrupted


def _linear_config(tmp_path: Path, tiny_models: Any) -> Path:
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    path = tmp_path / "c.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": str(a), "parameters": {"weight": 0.4}},
                    {"model": str(b), "parameters": {"weight": 0.6}},
                ],
                "dtype": "float32",
            }
        )
    )
    return path


def test_a_resumed_run_starts_its_counters_at_what_is_already_finished(tmp_path: Path, tiny_models: Any) -> None:
    cfg = _linear_config(tmp_path, tiny_models)
    out = tmp_path / "out"
    stop = threading.Event()
    first: list[ProgressEvent] = []
    stop_after = 0

    def interrupt(event: ProgressEvent) -> None:
        first.append(event)
        if event.recipe is not None and event.tensors_done >= stop_after:
            stop.set()

    # Several shards, and a stop that lands inside one: the resume reuses whole shards and journaled tensors.
    options = MergeOptions(out_shard_size=60_000, threads=1)
    plan_probe = run_merge(cfg, tmp_path / "probe", MergeOptions(out_shard_size=60_000)).plan
    assert len(plan_probe.shards) >= 3
    first_shard = plan_probe.shards[0].recipes
    stop_after = len(first_shard) + 2  # one finished shard and two tensors of the next
    try:
        run_merge(cfg, out, options, controls=RunControls(on_progress=interrupt, stop=stop))
    except MergeInterrupted:
        pass
    else:
        raise AssertionError("the merge was not interrupted")
    saved = first[-1]
    assert saved.tensors_done == stop_after and 0 < saved.bytes_written < plan_probe.total_size

    second: list[ProgressEvent] = []
    options = MergeOptions(out_shard_size=60_000, threads=1)
    result = run_merge(cfg, out, options, controls=RunControls(on_progress=second.append))
    total, total_bytes = len(result.plan.recipes), result.plan.total_size
    start = second[0]
    assert (start.tensors_done, start.bytes_written) == (saved.tensors_done, saved.bytes_written)
    end = second[-1]
    assert (end.tensors_done, end.tensors_total, end.bytes_written) == (total, total, total_bytes)
    # every event in between counts the tensors and bytes of the whole merge, not of this run alone
    done_bytes = {r.name: r.nbytes for r in result.plan.recipes}
    for before, after in zip(second, second[1:]):
        assert after.tensors_done == before.tensors_done + 1
        assert after.recipe is not None and after.bytes_written == before.bytes_written + done_bytes[after.recipe.name]


def _record_budgets(monkeypatch: Any) -> list[Any]:
    """Every MemoryBudget the executor makes, and each recipe slowed a little so that threads overlap."""
    import time

    from mergesmith.engine.execution import local_executor as executor

    budgets: list[Any] = []

    class Recording(executor.MemoryBudget):
        def __init__(self, limit: int | None) -> None:
            super().__init__(limit)
            self.items = self.most_items = 0
            budgets.append(self)

        def acquire_first(self, costs: list[int], stop: Any, device_costs: Any = None, **kw: Any) -> int | None:
            admitted = super().acquire_first(costs, stop, device_costs, **kw)
            with self._cond:
                self.items += admitted is not None
                self.most_items = max(self.most_items, self.items)
            return admitted

        def release(self, cost: int, device_cost: int = 0) -> None:
            with self._cond:
                self.items -= 1
            super().release(cost, device_cost)

    real_compute = executor.compute

    def slow_compute(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        return real_compute(*args, **kwargs)

    monkeypatch.setattr(executor, "MemoryBudget", Recording)
    monkeypatch.setattr(executor, "compute", slow_compute)
    return budgets


def test_the_memory_budget_bounds_the_bytes_in_flight(tmp_path: Path, tiny_models: Any, monkeypatch: Any) -> None:
    from mergesmith.engine.planning.shared import automatic_budget, recipe_memory

    cfg = _linear_config(tmp_path, tiny_models)
    budgets = _record_budgets(monkeypatch)

    # Without --max-memory, the automatic budget (the largest recipe plus a typical one per other thread)
    # still lets four threads hold several recipes at once: more than the largest one alone (so this test
    # would notice a budget that admitted everything).
    plan = run_merge(cfg, tmp_path / "free", MergeOptions(threads=4)).plan
    costs = [recipe_memory(r, plan.compute_dtype) for r in plan.recipes]
    largest = max(costs)
    assert budgets[-1].limit == automatic_budget(costs, 4)
    assert budgets[-1].most_items >= 3 and largest < budgets[-1].peak <= budgets[-1].limit

    # A budget of the largest working set: small recipes still run side by side, never over the budget.
    budget = largest
    run_merge(cfg, tmp_path / "bounded", MergeOptions(threads=4, max_memory=budget))
    recorded = budgets[-1]
    assert recorded.limit == budget and recorded.in_flight == 0
    assert recorded.peak <= max(budget, largest) and recorded.most_items >= 2

    # A budget below the largest working set still completes, an oversized recipe running alone.
    run_merge(cfg, tmp_path / "tiny", MergeOptions(threads=4, max_memory=1))
    assert budgets[-1].peak <= largest and budgets[-1].most_items == 1


def test_automatic_budget_lets_the_giants_take_turns_but_not_alike_tensors() -> None:
    from mergesmith.engine.planning.shared import automatic_budget

    assert automatic_budget([10] * 8, 4) == 40  # tensors all alike: four at a time
    # llama-like: embedding and head of 100, MLP matrices of 18, attention of 6 (size-weighted median: 18)
    costs = [100, 100] + [18] * 66 + [6] * 88
    assert automatic_budget(costs, 2) == 118 < 200
    assert automatic_budget(costs, 1) == 100
    assert automatic_budget([], 4) == 0


def test_the_largest_recipes_take_turns_while_smaller_ones_fill_the_other_thread(
    tmp_path: Path, tiny_models: Any, monkeypatch: Any
) -> None:
    """Without --max-memory, embed_tokens and lm_head (4x any layer tensor here) never run at once, and the
    executor looks past the one that waits, so the other thread keeps merging layer tensors meanwhile."""
    import time

    from mergesmith.engine.execution import local_executor as executor

    lock = threading.Lock()
    active: set[str] = set()
    seen: list[frozenset[str]] = []
    real_compute = executor.compute

    def tracking_compute(recipe: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            active.add(recipe.name)
            seen.append(frozenset(active))
        try:
            time.sleep(0.05)
            return real_compute(recipe, *args, **kwargs)
        finally:
            with lock:
                active.discard(recipe.name)

    monkeypatch.setattr(executor, "compute", tracking_compute)
    plan = run_merge(_linear_config(tmp_path, tiny_models), tmp_path / "out", MergeOptions(threads=2)).plan
    giants = {"model.embed_tokens.weight", "lm_head.weight"}
    assert giants <= {r.name for r in plan.recipes}
    assert not any(giants <= running for running in seen)
    assert any(len(running) == 2 and running & giants for running in seen)


def test_inputs_leave_the_page_cache_only_when_they_exceed_the_memory_room(
    tmp_path: Path, tiny_models: Any, monkeypatch: Any
) -> None:
    """Under a memory limit smaller than the inputs, every merged tensor's mapped input bytes are dropped from the
    page cache (so the kernel does not evict the next tensors' read-ahead in their place); with room to spare
    nothing is dropped (a rerun on the same models reads them from memory). The output bytes are the same."""
    import dataclasses
    import mmap
    import os

    from mergesmith.engine.execution import local_executor as executor
    from mergesmith.io.checkpoint import Checkpoint

    monkeypatch.setenv("MERGESMITH_DIRECT_IO", "0")  # every input read through the maps
    dropped: list[tuple[str, int]] = []
    real_fadvise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((os.readlink(f"/proc/self/fd/{fd}"), length))
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    cfg = _linear_config(tmp_path, tiny_models)
    room = executor.memory_room()
    outputs = {}
    for name, available in (("roomy", room.available), ("tight", 1024)):
        monkeypatch.setattr(executor, "memory_room", lambda a=available: dataclasses.replace(room, available=a))
        dropped.clear()
        plan = run_merge(cfg, tmp_path / name, MergeOptions(threads=2, copy_tokenizer=False)).plan
        outputs[name] = (tmp_path / name / "model.safetensors").read_bytes()
        inputs = {str(Path(f).resolve()) for f, _ in dropped}
        if name == "roomy":
            assert dropped == []
        else:
            models = {str(ref.model) for r in plan.recipes for ref in r.inputs}
            files = {str(p.resolve()) for m in models for p in Path(m).glob("*.safetensors")}
            assert inputs == files  # both models' files, nothing else (not the output)
            # every input tensor's whole pages, once (a tensor inside one page has none: the kernel keeps those)
            page = mmap.PAGESIZE
            expected = 0
            for m in models:
                for info in Checkpoint.open(m).tensors.values():
                    start, end = -(-info.data_offset // page) * page, (info.data_offset + info.nbytes) // page * page
                    expected += max(0, end - start)
            assert expected > 0 and sum(n for _, n in dropped) == expected
    assert outputs["roomy"] == outputs["tight"]


def test_a_recipe_passes_a_protected_one_only_where_it_leaves_it_room() -> None:
    """After ADMISSION_WINDOW recipes passed a waiting one, another still passes it where, once the largest item in
    flight finishes, the waiting one fits beside it; not where it would take that room. (Before, every other
    recipe then waited too, and a thread idled until the item in flight finished.)"""
    from mergesmith.engine.execution.admission import MemoryBudget, leaves_room

    assert leaves_room(118, [100], 18, 100)  # embed in flight, a layer tensor beside it: lm_head fits after embed
    assert not leaves_room(118, [100, 18], 6, 100)  # a second one would keep lm_head out after embed
    assert leaves_room(None, [100, 100], 100, 100)  # no limit: nothing to protect
    assert leaves_room(118, [6], 100, 100)  # a passer larger than what runs: the head waits for the passer alone

    budget = MemoryBudget(118)
    stop = threading.Event()
    assert budget.acquire_first([100], stop) == 0  # embed_tokens
    assert budget.acquire_first([100, 18, 6], stop, protect_head=True) == 1  # lm_head waits, a layer tensor passes
    assert budget.running == [100, 18]
    stop.set()
    assert budget.acquire_first([100, 6], stop, protect_head=True) is None  # 6 fits nowhere now; stopped, not hung
    stop.clear()
    budget.release(18)
    assert budget.acquire_first([100, 6], stop, protect_head=True) == 1  # room again beside embed for one
    budget.release(100)
    assert budget.acquire_first([100, 6], stop, protect_head=True) == 0  # embed done: lm_head goes first
    assert sorted(budget.running) == [6, 100] and budget.in_flight == 106


def test_long_poles_are_started_first_and_the_rest_keeps_plan_order(
    tmp_path: Path, tiny_models: Any, monkeypatch: Any
) -> None:
    """time_estimate.long_poles names the recipes whose own work is a large share of a worker's (TIES over lm_head
    on the 1b bench); the executor starts them before the others, which keep plan order. Plain linear merges of
    alike tensors have none."""
    from mergesmith.engine import time_estimate
    from mergesmith.engine.execution import local_executor as executor
    from mergesmith.engine.plan import InputRef, TensorRecipe

    def recipe(name: str, rows: int, method: str = "ties") -> TensorRecipe:
        inputs = tuple(InputRef(f"m{i}", name) for i in range(3))
        return TensorRecipe(name=name, op="merge", method=method, shape=(rows, 2048), dtype="bfloat16",
                            inputs=inputs, base_index=0)

    layers = [recipe(f"layers.{i}.mlp", 5632) for i in range(22 * 3)]
    giants = [recipe("embed", 32000), recipe("lm_head", 32000)]
    assert time_estimate.long_poles([*giants, *layers], threads=2) == {"embed", "lm_head"}
    assert time_estimate.long_poles([recipe(f"l{i}", 5632, "linear") for i in range(20)], threads=2) == frozenset()

    order: list[str] = []
    real_compute = executor.compute

    def recording(recipe: Any, *args: Any, **kwargs: Any) -> Any:
        order.append(recipe.name)
        return real_compute(recipe, *args, **kwargs)

    monkeypatch.setattr(executor, "compute", recording)
    monkeypatch.setattr(time_estimate, "long_poles", lambda recipes, threads: frozenset({"lm_head.weight"}))
    monkeypatch.setattr("mergesmith.engine.run.long_poles", time_estimate.long_poles)
    plan = run_merge(_linear_config(tmp_path, tiny_models), tmp_path / "out", MergeOptions(threads=1)).plan
    assert order[0] == "lm_head.weight"
    rest = [r.name for r in plan.recipes if r.name != "lm_head.weight"]
    assert [name for name in order[1:] if name in rest] == [name for name in rest if name in order]
