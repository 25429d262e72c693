"""The Ray executor on a local Ray instance: same bytes as the local executor, retries, resume, errors."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mergesmith[ray]')")

from mergesmith.cli import main  # noqa: E402
from mergesmith.engine.execution.ray_executor import KILL_ONCE_ENV  # noqa: E402
from mergesmith.engine.planning.shared import MergeOptions  # noqa: E402
from mergesmith.engine.run import RunControls, build_plan, execute_plan, run_merge  # noqa: E402
from mergesmith.errors import CheckpointError, MergeInterrupted, MergesmithError  # noqa: E402
from mergesmith.io.journal import Journal  # noqa: E402

SHARD_SIZE = 60_000  # cuts the tiny model into a few shards, so several tasks run


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def merge_config(tiny_models, tmp_path_factory) -> Path:
    """A seeded DARE merge: randomised, so identical bytes also prove per-tensor seeding survives Ray."""
    base = tiny_models("llama", seed=1)
    models = [tiny_models.derive(base, seed=s) for s in (2, 3)]
    path = tmp_path_factory.mktemp("ray_cfg") / "dare.yml"
    doc = {
        "merge_method": "dare_ties",
        "base_model": str(base),
        "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.6}} for m in models],
        "dtype": "float32",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def local_output(merge_config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray_local") / "out"
    run_merge(merge_config, out, MergeOptions(out_shard_size=SHARD_SIZE, random_seed=7, threads=2))
    return out


def _files(out: Path) -> dict[str, bytes]:
    """Every output file but the journal, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def _ray_options(**kw) -> MergeOptions:
    return MergeOptions(out_shard_size=SHARD_SIZE, random_seed=7, threads=2, executor="ray", **kw)


def test_ray_output_is_byte_identical_to_the_local_executor(local_ray, merge_config, local_output, tmp_path):
    expected = _files(local_output)
    assert sum(name.startswith("model-") for name in expected) >= 3

    out = tmp_path / "ray"
    result = run_merge(merge_config, out, _ray_options())
    assert not result.already_complete
    assert _files(out) == expected
    journal = Journal.load(out)
    assert journal.complete and set(journal.finished) == {s.filename for s in result.plan.shards}

    # The driver journaled every shard: a rerun (with either executor) finds the merge complete.
    assert run_merge(merge_config, out, _ray_options()).already_complete
    assert run_merge(merge_config, out, MergeOptions(out_shard_size=SHARD_SIZE, random_seed=7)).already_complete


def test_a_killed_worker_is_retried_and_the_output_is_unchanged(
    local_ray, merge_config, local_output, tmp_path, monkeypatch
):
    kills = tmp_path / "kills"
    kills.mkdir()
    monkeypatch.setenv(KILL_ONCE_ENV, str(kills))
    out = tmp_path / "ray"
    result = run_merge(merge_config, out, _ray_options())
    # One shard task SIGKILLed its own worker after writing a tensor; Ray retried it and the merge finished.
    killed = (kills / "killed").read_text()
    assert killed in {s.filename for s in result.plan.shards}
    assert Journal.load(out).finished[killed]["size"] == (out / killed).stat().st_size
    assert _files(out) == _files(local_output)


def test_resume_rewrites_only_the_missing_shard(local_ray, merge_config, local_output, tmp_path):
    out = tmp_path / "ray"
    result = run_merge(merge_config, out, _ray_options())
    shards = [s.filename for s in result.plan.shards]
    lost = out / shards[1]
    lost.unlink()
    kept = {name: (out / name).stat().st_mtime_ns for name in shards if name != lost.name}

    again = run_merge(merge_config, out, _ray_options())
    assert not again.already_complete and again.shards_reused == len(shards) - 1
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert _files(out) == _files(local_output)


def test_a_worker_that_sees_different_inputs_fails_with_one_line(local_ray, tiny_models, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(tiny_models("llama", seed=4), src)
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [{"model": str(src)}, {"model": str(src)}],
                "parameters": {"weight": 1.0},
            }
        )
    )
    options = MergeOptions(executor="ray")
    plan, checkpoints = build_plan(cfg, options)
    weights = src / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # as another node's copy
    with pytest.raises(CheckpointError, match="differ from the ones the driver planned from") as err:
        execute_plan(plan, checkpoints, tmp_path / "out", options)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "config.json").exists()


def test_without_retries_a_killed_worker_fails_the_merge_in_one_line_and_a_rerun_resumes(
    local_ray, merge_config, local_output, tmp_path, monkeypatch
):
    import mergesmith.engine.execution.ray_executor as ray_executor

    kills = tmp_path / "kills"
    kills.mkdir()
    monkeypatch.setenv(KILL_ONCE_ENV, str(kills))
    monkeypatch.setattr(ray_executor, "MAX_RETRIES", 0)
    out = tmp_path / "ray"
    with pytest.raises(MergesmithError, match=r"its Ray task failed after 0 retries .*rerun to resume") as err:
        run_merge(merge_config, out, _ray_options())
    assert "\n" not in str(err.value)
    killed = (kills / "killed").read_text()
    assert killed in str(err.value)
    assert not (out / "config.json").exists() and not (out / killed).exists()

    monkeypatch.delenv(KILL_ONCE_ENV)
    run_merge(merge_config, out, _ray_options())
    assert _files(out) == _files(local_output)


def test_a_stop_request_drains_the_tasks_and_a_rerun_finishes_the_same_bytes(local_ray, merge_config, tmp_path):
    import threading

    # Many small shards, so that plenty are still queued when the first one lands and the stop comes.
    small = {"out_shard_size": SHARD_SIZE // 4, "random_seed": 7, "threads": 2}
    local = run_merge(merge_config, tmp_path / "local", MergeOptions(**small))
    assert len(local.plan.shards) >= 10
    stop = threading.Event()
    out = tmp_path / "ray"

    def stop_after_first_shard(event) -> None:
        if event.tensors_done:
            stop.set()

    with pytest.raises(MergeInterrupted, match="run the same command again to resume"):
        run_merge(
            merge_config,
            out,
            MergeOptions(executor="ray", **small),
            controls=RunControls(on_progress=stop_after_first_shard, stop=stop),
        )
    journal = Journal.load(out)
    assert 1 <= len(journal.finished) < len(local.plan.shards)
    assert not (out / "config.json").exists()

    again = run_merge(merge_config, out, MergeOptions(executor="ray", **small))
    assert again.shards_reused == len(journal.finished)
    assert _files(out) == _files(tmp_path / "local")


def test_cli_merge_with_the_ray_executor_and_an_unreachable_head(
    local_ray, merge_config, local_output, tmp_path, capsys
):
    args = ["merge", str(merge_config), "--out-shard-size", str(SHARD_SIZE), "--random-seed", "7", "-q"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args[:2], str(tmp_path / "out"), *args[2:], "--executor", "ray"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert _files(tmp_path / "out") == _files(local_output)

    with pytest.raises(SystemExit) as exit_info:
        main([*args[:2], str(tmp_path / "bad"), *args[2:], "--executor", "ray", "--ray-address", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: cannot reach the Ray head at 127.0.0.1:1") and err.count("\n") == 1


def test_relative_and_model_plus_lora_inputs_reach_the_workers(local_ray, tiny_models, tmp_path, monkeypatch):
    """Workers run elsewhere (here: another cwd), so they get the driver's absolute paths, both parts of a
    `model+lora` reference included."""
    from mergesmith.lora.extract import extract_lora

    base = tiny_models("llama", seed=1)
    shutil.copytree(base, tmp_path / "base")
    shutil.copytree(tiny_models.derive(base, seed=5), tmp_path / "tuned")
    extract_lora(str(tmp_path / "tuned"), str(tmp_path / "base"), tmp_path / "adapter", 4)
    monkeypatch.chdir(tmp_path)  # the Ray workers keep the cwd they were started in
    cfg = Path("cfg.yml")
    doc = {
        "merge_method": "linear",
        "models": [{"model": "base+adapter"}, {"model": "base"}],
        "parameters": {"weight": 1.0},
    }
    cfg.write_text(yaml.safe_dump(doc))
    run_merge(cfg, "local", MergeOptions(out_shard_size=SHARD_SIZE))
    run_merge(cfg, "ray", MergeOptions(out_shard_size=SHARD_SIZE, executor="ray"))
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")


# ----- the methods of issue 32 through Ray ---------------------------------------------------------------------
NEW_METHODS: dict[str, tuple[dict, dict]] = {  # method -> (global parameters, each fine-tune's parameters)
    "tsv": ({"alpha": 1.0}, {}),
    "iso_cts": ({"scaling_factor": 1.2}, {}),
    "consensus_ties": ({}, {"weight": 1.0, "density": 0.5, "k": 2, "lambda": 0.5}),
    "pcb": ({"pcb_ratio": 0.3}, {}),
    "magmax": ({}, {}),
    "wudi": ({"iter_num": 10, "lr": 1e-4}, {}),
    "lines": ({"beta": 0.5}, {}),
    "ties": ({"lines_alpha": 0.4, "lines_beta": 0.6}, {"weight": 1.0, "density": 0.5}),
    "regmean": ({"num_regmean_examples": 8, "max_length": 16}, {}),
}


# LAPACK's SVD rounds differently with another intra-op thread count (a Ray worker's is not the local executor's):
# the SVD methods' last bits follow the thread count, library and device (README, Methods), so through Ray they are
# compared within 1e-4 of each tensor's largest entry (measured 2e-5 on lm_head: these random task vectors have flat
# spectra, so rounding moves the truncated subspaces by more than float32's epsilon); every other method gives the
# same bytes.
THREAD_SENSITIVE = {"tsv", "iso_cts"}


@pytest.mark.parametrize("method", sorted(NEW_METHODS))
def test_new_methods_give_the_local_bytes_through_ray(method, local_ray, tiny_models, tmp_path):
    """Every new method (and the LiNeS option, and regmean's Gram inputs read by workers) merges to the same bytes
    with the Ray executor as with the local one."""
    from tests.test_methods_e2e import CALIBRATION

    base = tiny_models("llama", seed=1)
    tunes = [tiny_models.derive(base, seed=s) for s in (2, 3, 4)]
    global_params, model_params = NEW_METHODS[method]
    doc: dict = {"merge_method": method, "dtype": "float32", "parameters": dict(global_params)}
    if method == "regmean":
        doc["parameters"]["calibration"] = str(CALIBRATION)
        doc["models"] = [{"model": str(t)} for t in tunes]
    else:
        doc["base_model"] = str(base)
        doc["models"] = [{"model": str(t), "parameters": dict(model_params)} for t in tunes]
    config = tmp_path / f"{method}.yml"
    config.write_text(yaml.safe_dump(doc))
    run_merge(config, tmp_path / "local", MergeOptions(out_shard_size=SHARD_SIZE, threads=2))
    run_merge(config, tmp_path / "ray", _ray_options())
    if method not in THREAD_SENSITIVE:
        assert _files(tmp_path / "ray") == _files(tmp_path / "local")
        return
    from tests.helpers import read_state_dict

    local, remote = read_state_dict(tmp_path / "local"), read_state_dict(tmp_path / "ray")
    assert local.keys() == remote.keys()
    for name, tensor in local.items():
        scale = float(tensor.abs().max()) or 1.0
        assert float((remote[name] - tensor).abs().max()) <= 1e-4 * scale, name
