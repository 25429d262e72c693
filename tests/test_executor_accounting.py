"""The local executor's accounting: progress counters on a resumed run, and the memory budget's admission."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import yaml

from mergesmith.api import run_merge
from mergesmith.errors import MergeInterrupted
from mergesmith.executor import ProgressEvent
from mergesmith.planner import MergeOptions


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
        run_merge(cfg, out, options, on_progress=interrupt, stop=stop)
    except MergeInterrupted:
        pass
    else:
        raise AssertionError("the merge was not interrupted")
    saved = first[-1]
    assert saved.tensors_done == stop_after and 0 < saved.bytes_written < plan_probe.total_size

    second: list[ProgressEvent] = []
    result = run_merge(cfg, out, MergeOptions(out_shard_size=60_000, threads=1), on_progress=second.append)
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
