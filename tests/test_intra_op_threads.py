"""The executor shares the cores between its workers and torch's intra-op threads, and puts torch back after."""

from __future__ import annotations

import threading

import torch

from mergesmith.runtime import intra_op_threads


def test_each_worker_gets_its_share_of_the_cores_and_the_setting_comes_back(monkeypatch):
    monkeypatch.setattr(intra_op_threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    seen: list[int] = []
    with intra_op_threads.shared_between(2) as each:
        assert each == 2
        worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # a new thread, as a worker
        worker.start()
        worker.join()
    assert seen == [2]
    assert torch.get_num_threads() == before
    with intra_op_threads.shared_between(8) as each:  # more workers than cores: one thread each, never 0
        assert each == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_setting_comes_back_when_the_merge_fails(monkeypatch):
    monkeypatch.setattr(intra_op_threads, "usable_cores", lambda: 3)
    before = torch.get_num_threads()
    try:
        with intra_op_threads.shared_between(3):
            assert torch.get_num_threads() == 1
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert torch.get_num_threads() == before


def test_a_merge_runs_its_workers_with_the_shared_count_and_leaves_torch_as_it_was(tiny_models, tmp_path, monkeypatch):
    from mergesmith.engine.execution import local_executor as executor
    from mergesmith.engine.run import MergeOptions, run_merge

    monkeypatch.setattr(intra_op_threads, "usable_cores", lambda: 2 * torch.get_num_threads() + 2)
    real_compute = executor.compute
    seen: set[int] = set()

    def spy(*args, **kwargs):
        seen.add(torch.get_num_threads())
        return real_compute(*args, **kwargs)

    monkeypatch.setattr(executor, "compute", spy)
    base = tiny_models("llama", seed=0)
    other = tiny_models.derive(base, seed=1)
    config = tmp_path / "c.yml"
    config.write_text(
        f"merge_method: linear\nmodels:\n- model: {base}\n  parameters: {{weight: 0.5}}\n"
        f"- model: {other}\n  parameters: {{weight: 0.5}}\ndtype: bfloat16\n"
    )
    before = torch.get_num_threads()
    run_merge(config, tmp_path / "out", MergeOptions(threads=2))
    assert seen == {before + 1}  # (2 * before + 2) // 2 workers: not torch's own count
    assert torch.get_num_threads() == before
