"""`plan` tells the truth (issue 29, item 5): the seed it prints is the seed the merge uses, or it says the merge
draws its own; its time estimate counts start-up and the method's compute, not only the bytes over the disk rate.

The estimate's accuracy against measured wall time is a measurement, not a test: `python bench/plan_accuracy.py`.
"""

from __future__ import annotations

import json

import pytest
import yaml

from mergesmith.engine import time_estimate
from mergesmith.engine.report import SEED_DRAWN_TEXT
from mergesmith.io.journal import Journal
from tests.helpers import run_cli


def _dare_config(tmp_path, tiny_models):
    base = tiny_models("llama", seed=1)
    path = tmp_path / "dare.yml"
    path.write_text(yaml.safe_dump({
        "merge_method": "dare_ties",
        "base_model": str(base),
        "models": [
            {"model": str(tiny_models.derive(base, seed=s, scale=0.01)), "parameters": {"density": 0.5, "weight": 0.5}}
            for s in (2, 3)
        ],
    }))
    return path


def test_the_seed_plan_prints_is_the_seed_the_merge_records(tmp_path, tiny_models, capsys):
    config, out = _dare_config(tmp_path, tiny_models), tmp_path / "out"
    code, text, _ = run_cli(capsys, "plan", config, out, "--random-seed", "1056894219")
    assert code == 0 and "random seed: 1056894219" in text.splitlines()
    code, _, _ = run_cli(capsys, "merge", config, out, "--random-seed", "1056894219")
    assert code == 0
    journal = Journal.load(out)
    assert journal is not None and journal.random_seed == 1056894219


def test_without_a_seed_plan_says_the_merge_draws_its_own(tmp_path, tiny_models, capsys):
    config, out = _dare_config(tmp_path, tiny_models), tmp_path / "out"
    code, text, _ = run_cli(capsys, "plan", config, out)
    assert code == 0
    assert f"random seed: {SEED_DRAWN_TEXT}" in text.splitlines()
    assert not any(line.startswith("random seed: ") and line[13:].isdigit() for line in text.splitlines())
    code, text, _ = run_cli(capsys, "plan", config, out, "--json")
    report = json.loads(text)
    assert report["random_seed"] is None and report["random_seed_drawn_at_merge"] is True


def test_a_resumable_output_s_seed_is_the_one_plan_prints(tmp_path, tiny_models, capsys):
    """A merge given no seed reuses the seed an interrupted run in OUT_DIR recorded: plan prints that one."""
    config, out = _dare_config(tmp_path, tiny_models), tmp_path / "out"
    assert run_cli(capsys, "merge", config, out)[0] == 0
    recorded = Journal.load(out).random_seed
    assert isinstance(recorded, int)
    code, text, _ = run_cli(capsys, "plan", config, out, "--json")
    assert code == 0 and json.loads(text)["random_seed"] == recorded


def test_a_method_without_randomness_prints_no_seed(tmp_path, tiny_models, capsys):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    config = tmp_path / "linear.yml"
    config.write_text(yaml.safe_dump({"merge_method": "linear", "models": [{"model": str(a), "parameters": {
        "weight": 1.0}}, {"model": str(b), "parameters": {"weight": 1.0}}]}))
    code, text, _ = run_cli(capsys, "plan", config)
    assert code == 0 and "random seed" not in text


def test_the_estimate_counts_start_up_and_the_method_s_compute(tmp_path, tiny_models, capsys):
    config = _dare_config(tmp_path, tiny_models)
    code, text, _ = run_cli(capsys, "plan", config, "--json", "--threads", "1")
    report = json.loads(text)
    parts = report["estimated_seconds_parts"]
    assert parts["startup"] == time_estimate.STARTUP_S > 0
    expected = parts["startup"] + max(parts["io"], parts["compute"]) + parts["first_compile"]
    assert report["estimated_seconds"] == pytest.approx(expected)
    # dare_ties' measured rate, three inputs a merged tensor, one worker against the bench's two
    merged = [t for t in report["tensors"] if t["op"] == "merge"]
    entries = sum(len(t["inputs"]) * _numel(t["shape"]) for t in merged)
    rate = time_estimate.SECONDS_PER_INPUT_ENTRY["dare_ties"]
    assert parts["compute"] == pytest.approx(entries * rate * time_estimate.BENCH_WORKERS)
    code, text, _ = run_cli(capsys, "plan", config)
    assert f"estimated time: {report['estimated_seconds']:.1f} s (start-up" in text


def test_slower_methods_are_estimated_slower():
    rate = time_estimate.seconds_per_input_entry
    assert rate("linear") < rate("dare_ties") < rate("ties")
    assert rate("breadcrumbs_ties") == rate("ties") and rate("nuslerp") == rate("linear")
    assert all(r > 0 for r in time_estimate.SECONDS_PER_INPUT_ENTRY.values())


def test_ties_selection_by_table_on_large_tensors_is_estimated_slower():
    """Over IDS_MAX_ENTRIES TIES' replay follows its cut keys through a table (slower by bench/README.md's runs)."""
    from mergesmith.kernels.introsort_replay import IDS_MAX_ENTRIES

    small, large = IDS_MAX_ENTRIES, IDS_MAX_ENTRIES + 1
    per_entry = time_estimate._recipe_seconds
    assert per_entry("ties", large, 3) / large > per_entry("ties", small, 3) / small
    assert per_entry("dare_ties", large, 3) / large == pytest.approx(per_entry("dare_ties", small, 3) / small)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_a_first_compile_is_estimated_only_where_the_merge_starts_one_and_numba_s_cache_lacks_it(
    tmp_path, tiny_models, capsys, monkeypatch
):
    from mergesmith.engine.execution import kernel_warmup
    from mergesmith.kernels import keyed_kernels

    config = _dare_config(tmp_path, tiny_models)
    monkeypatch.setattr(keyed_kernels.KERNELS, "cached", lambda: False)
    report = json.loads(run_cli(capsys, "plan", config, "--json")[1])
    assert report["estimated_seconds_parts"]["first_compile"] == 0  # tensors too small to start a compile
    monkeypatch.setattr(kernel_warmup, "START_ENTRIES", 256)
    report = json.loads(run_cli(capsys, "plan", config, "--json")[1])
    parts = report["estimated_seconds_parts"]
    assert parts["first_compile"] == time_estimate.FIRST_COMPILE_S["keyed_kernels"]
    assert report["estimated_seconds"] == pytest.approx(parts["startup"] + max(parts["io"], parts["compute"])
                                                        + parts["first_compile"])
    assert "first compile of its kernels" in run_cli(capsys, "plan", config)[1]
    monkeypatch.setattr(keyed_kernels.KERNELS, "cached", lambda: True)
    assert json.loads(run_cli(capsys, "plan", config, "--json")[1])["estimated_seconds_parts"]["first_compile"] == 0
