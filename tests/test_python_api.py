"""The Python API used the way a notebook or a training loop uses it: `import mergesmith`, call, resume.

Covers: the light import; `merge` from a path, YAML text, dict and MergeConfiguration giving the CLI's
bytes; options with the CLI's names, defaults and errors; silence unless asked; the notebook bar; a
merge interrupted by KeyboardInterrupt from the progress callback and resumed byte-identical; `plan`
with its memory figure; and in-memory merges (`merge_state_dicts`/`merge_tensors`) matching a
file-based merge byte for byte, for several methods (a seeded random one included) and on an
`nn.Module` with tied weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

import mergesmith
from mergesmith.io.journal import STATE_TOP
from tests.helpers import run_cli


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP}


@pytest.fixture(scope="module")
def models(tiny_models: Any) -> dict[str, Path]:
    base = tiny_models("llama", seed=11)
    return {"base": base, "a": tiny_models.derive(base, seed=12), "b": tiny_models.derive(base, seed=13)}


def _linear(models: dict[str, Path]) -> dict[str, Any]:
    return {
        "merge_method": "linear",
        "models": [
            {"model": str(models["a"]), "parameters": {"weight": 0.6}},
            {"model": str(models["b"]), "parameters": {"weight": 0.4}},
        ],
        "dtype": "float32",
    }


def test_import_is_light_and_exports_the_api() -> None:
    code = "import sys, mergesmith; print(sorted(m for m in ('torch', 'click', 'typing') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for name in ("merge", "plan", "merge_state_dicts", "merge_tensors", "moe", "extract_lora", "multi"):
        assert callable(getattr(mergesmith, name)), name
        assert getattr(mergesmith, name).__doc__, name
    import inspect

    # plan, moe and multi are also internal module names: callable modules that document the function
    assert "out_dir" in inspect.signature(mergesmith.plan).parameters
    assert mergesmith.moe.__doc__.startswith("`mergesmith moe` as a function")
    from mergesmith.engine.plan import Plan  # noqa: F401 - the module is still importable as before

    assert callable(mergesmith.plan)
    assert issubclass(mergesmith.ConfigError, mergesmith.MergesmithError)
    assert issubclass(mergesmith.MemoryShortage, mergesmith.MergesmithError)
    with pytest.raises(AttributeError):
        mergesmith.no_such_thing  # noqa: B018


def test_options_are_the_cli_options() -> None:
    from mergesmith.cli import cli
    from mergesmith.python_api import command_options

    flags = {p.name for p in cli.commands["merge"].params if p.name not in ("config_file", "out_dir")}
    options = command_options("merge")
    assert set(options) == flags
    assert options["out_shard_size"] == "5B" and options["device"] == "cpu" and options["overwrite"] is False


def test_merge_accepts_every_config_form_with_the_cli_bytes(
    models: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    data = _linear(models)
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(data))
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "cli", "-q")
    assert code == 0, err
    expected = _files(tmp_path / "cli")
    from mergesmith.config import parse_config

    forms = {"path": path, "text": yaml.safe_dump(data), "dict": data, "parsed": parse_config(data)}
    for label, config in forms.items():
        result = mergesmith.merge(config, tmp_path / label, threads=2)
        assert isinstance(result, mergesmith.MergeResult)
        assert result.out_dir == tmp_path / label and not result.already_complete
        assert _files(tmp_path / label) == expected, label
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "", "the library printed without being asked"
    again = mergesmith.merge(data, tmp_path / "dict", threads=2)
    assert again.already_complete
    # the command's output is the API's: the same fingerprint, so calling `merge` on it has nothing to do
    assert mergesmith.merge(path, tmp_path / "cli").already_complete


def test_errors_are_the_cli_exception_types(models: dict[str, Path], tmp_path: Path) -> None:
    data = _linear(models)
    with pytest.raises(TypeError, match="thread"):
        mergesmith.merge(data, tmp_path / "o", thread=2)
    with pytest.raises(mergesmith.ConfigError, match="threads"):
        mergesmith.merge(data, tmp_path / "o", threads=0)
    with pytest.raises(mergesmith.ConfigError, match="max-memory"):
        mergesmith.merge(data, tmp_path / "o", max_memory="lots")
    with pytest.raises(mergesmith.ConfigError, match="merge_metod"):  # ignored with a warning unless strict
        mergesmith.merge({**data, "merge_metod": "linear"}, tmp_path / "o", strict=True)
    missing = {**data, "models": [{"model": str(tmp_path / "nope")}, data["models"][1]]}
    with pytest.raises(mergesmith.CheckpointError, match="nope"):
        mergesmith.merge(missing, tmp_path / "o")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    with pytest.raises(mergesmith.OutputError, match="not empty"):
        mergesmith.merge(data, tmp_path / "full")
    with pytest.raises(mergesmith.ConfigError, match="not valid YAML"):
        mergesmith.merge("merge_method: [linear\nmodels: x", tmp_path / "o")


def test_keyboard_interrupt_from_the_progress_callback_then_resume(models: dict[str, Path], tmp_path: Path) -> None:
    data = _linear(models)
    mergesmith.merge(data, tmp_path / "ref", out_shard_size="50K", threads=1)
    seen: list[Any] = []

    def stop_midway(event: Any) -> None:
        seen.append(event)
        if event.tensors_done >= event.tensors_total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mergesmith.merge(data, tmp_path / "out", out_shard_size="50K", threads=1, progress=stop_midway)
    total = seen[-1].tensors_total
    assert 0 < seen[-1].tensors_done < total
    assert not (tmp_path / "out" / "config.json").exists(), "an interrupted merge must not look complete"
    events: list[Any] = []
    result = mergesmith.merge(data, tmp_path / "out", out_shard_size="50K", threads=1, progress=events.append)
    assert result.shards_reused >= 1 and not result.already_complete
    assert events[0].tensors_done >= total // 2, "the resumed run starts where the first stopped"
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


_STOP_BUTTON = """
import _thread, sys, threading
import mergesmith

config, out = sys.argv[1], sys.argv[2]
fired = threading.Event()

def press_stop(event):
    if event.tensors_done >= event.tensors_total // 3 and not fired.is_set():
        fired.set()
        _thread.interrupt_main()  # what Jupyter's interrupt does to the kernel's main thread

try:
    mergesmith.merge(config, out, out_shard_size="50K", threads=2, progress=press_stop)
except KeyboardInterrupt:
    pass
else:
    sys.exit("the merge was not interrupted")
left = [t.name for t in threading.enumerate() if t.name.startswith(("merge", "mergesmith"))]
if left:
    sys.exit(f"threads left running: {left}")
result = mergesmith.merge(config, out, out_shard_size="50K", threads=2)
if result.already_complete:
    sys.exit("the interrupted merge had finished")
"""


def test_a_stop_button_interrupt_in_the_main_thread_then_resume(models: dict[str, Path], tmp_path: Path) -> None:
    """A notebook's stop button raises KeyboardInterrupt in the main thread wherever it is waiting; the
    merge lets the tensors in flight finish, journals them, stops its threads, and resumes later. Run in a
    fresh interpreter whose main thread is the caller's, as a kernel's is (a pytest-xdist worker's main
    thread belongs to its own loop, where the interrupt would kill the worker)."""
    data = _linear(models)
    mergesmith.merge(data, tmp_path / "ref", out_shard_size="50K", threads=2)
    config = tmp_path / "linear.yml"
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-c", _STOP_BUTTON, str(config), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_progress_true_in_a_notebook_shows_a_bar_and_where_the_model_is(
    models: dict[str, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mergesmith.display import notebook as notebook_progress

    monkeypatch.setattr(notebook_progress, "in_notebook", lambda: True)
    mergesmith.merge(_linear(models), tmp_path / "nb", progress=True, out_shard_size="50K", threads=1)
    captured = capsys.readouterr()
    assert "merging" in captured.err and "tensors" in captured.err and "RSS" in captured.err, captured.err
    assert " of " in captured.err  # RSS against what this process may use
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("model written to ") and str((tmp_path / "nb").resolve()) in last


def test_progress_true_off_a_terminal_keeps_the_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from mergesmith.display import notebook as notebook_progress
    from mergesmith.display.plain import PlainProgress

    monkeypatch.setattr(notebook_progress, "in_notebook", lambda: False)
    assert isinstance(notebook_progress.choose_display(True).inner, PlainProgress)  # pytest's stderr is no terminal
    assert isinstance(notebook_progress.choose_display(None), notebook_progress.Silent)


def test_plan_shows_the_memory_this_process_may_use(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    report = mergesmith.plan(_linear(models), threads=2)
    assert report.plan.recipes and report.memory is not None
    assert "memory this process may use now" in str(report)
    assert report.memory["fits"] and report.memory["available_bytes"] > 0

    from mergesmith.runtime import memory_limits

    tight = memory_limits.MemoryRoom(1000, 1000, 10**10, None)
    monkeypatch.setattr(memory_limits, "memory_room", lambda: tight)
    report = mergesmith.plan(_linear(models), threads=2)
    assert not report.memory["runs"] and "will stop at that tensor" in str(report)


# ----- in memory ---------------------------------------------------------------------------------------

METHODS: dict[str, tuple[dict[str, Any], list[dict[str, Any]], bool | str]] = {
    # method: (parameters, per-model parameters, base: True a separate base model, "first" the first model)
    "linear": ({}, [{"weight": 0.7}, {"weight": 0.3}], False),
    "slerp": ({"t": 0.3}, [{}, {}], "first"),
    "task_arithmetic": ({}, [{"weight": 0.5}, {"weight": 0.8}], True),
    "ties": ({"normalize": True}, [{"weight": 0.6, "density": 0.5}, {"weight": 0.4, "density": 0.7}], True),
    "dare_ties": ({}, [{"weight": 0.6, "density": 0.5}, {"weight": 0.4, "density": 0.7}], True),
    "breadcrumbs": ({}, [{"weight": 0.5, "density": 0.8, "gamma": 0.05}] * 2, True),
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_in_memory_merge_gives_the_bytes_of_a_file_merge(
    method: str, models: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    params, per_model, needs_base = METHODS[method]
    config: dict[str, Any] = {
        "merge_method": method,
        "models": [{"model": str(models[k]), "parameters": p} for k, p in zip(("a", "b"), per_model)],
        "dtype": "float32",
    }
    if params:
        config["parameters"] = params
    if needs_base:
        config["base_model"] = str(models["a"] if needs_base == "first" else models["base"])
    path = tmp_path / "m.yml"
    path.write_text(yaml.safe_dump(config))
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out", "-q", "--random-seed", "7")
    assert code == 0, err
    on_disk = load_file(tmp_path / "out" / "model.safetensors")

    states = [load_file(models[k] / "model.safetensors") for k in ("a", "b")]
    base: Any = load_file(models["base"] / "model.safetensors") if needs_base is True else None
    if needs_base == "first":
        base = 0  # the index of the base among the state dicts
    merged = mergesmith.merge_state_dicts(
        method, states, base, parameters=params, model_parameters=per_model, dtype="float32", random_seed=7
    )
    assert set(merged) == set(on_disk)
    for name, tensor in on_disk.items():
        assert merged[name].dtype == tensor.dtype, name
        assert merged[name].numpy().tobytes() == tensor.numpy().tobytes(), f"{method}: {name} differs"

    name = "model.layers.1.mlp.down_proj.weight"
    one = mergesmith.merge_tensors(
        method,
        [s[name] for s in states],
        base[name] if isinstance(base, dict) else base,
        params,
        per_model,
        name=name,
        dtype="float32",
        random_seed=7,
    )
    assert one.numpy().tobytes() == on_disk[name].numpy().tobytes()


def test_in_memory_checks_parameters_like_a_config() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(mergesmith.ConfigError, match="base"):
        mergesmith.merge_tensors("ties", [a, b], model_parameters=[{"weight": 1, "density": 0.5}] * 2)
    with pytest.raises(mergesmith.ConfigError, match="density.*must be a number"):
        bad = [{"weight": 1, "density": "half"}] * 2
        mergesmith.merge_tensors("ties", [a, b], torch.zeros(4, 4), model_parameters=bad)
    with pytest.raises(mergesmith.ConfigError, match="no_such_method"):
        mergesmith.merge_tensors("no_such_method", [a, b])
    with pytest.raises(mergesmith.CheckpointError, match="shapes differ"):
        mergesmith.merge_tensors("linear", [a, torch.randn(4, 5)], model_parameters=[{"weight": 1}] * 2)
    # a seeded random method is reproducible; another seed draws other masks
    params = [{"weight": 1.0, "density": 0.5}] * 2
    one = mergesmith.merge_tensors("dare_linear", [a, b], torch.zeros(4, 4), None, params, random_seed=1)
    same = mergesmith.merge_tensors("dare_linear", [a, b], torch.zeros(4, 4), None, params, random_seed=1)
    assert torch.equal(one, same)
    assert not torch.equal(
        one, mergesmith.merge_tensors("dare_linear", [a, b], torch.zeros(4, 4), None, params, random_seed=2)
    )


def test_merge_state_dicts_on_modules_with_tied_weights(tiny_models: Any, tmp_path: Path, capsys: Any) -> None:
    from transformers import AutoModelForCausalLM

    base = tiny_models("qwen2", seed=21, tie_word_embeddings=True)
    paths = [tiny_models.derive(base, seed=22), tiny_models.derive(base, seed=23)]
    modules = [AutoModelForCausalLM.from_pretrained(str(p)) for p in paths]
    states = [m.state_dict() for m in modules]
    assert states[0]["lm_head.weight"].data_ptr() == states[0]["model.embed_tokens.weight"].data_ptr()

    merged = mergesmith.merge_state_dicts("linear", states, model_parameters=[{"weight": 0.5}, {"weight": 0.5}])
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"], "the tie is kept"
    target = AutoModelForCausalLM.from_pretrained(str(paths[0]))
    target.load_state_dict(merged)
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = target(torch.tensor([[1, 5, 9, 2]])).logits
    assert torch.isfinite(logits).all()

    config = {
        "merge_method": "linear",
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in paths],
    }
    path = tmp_path / "m.yml"
    path.write_text(yaml.safe_dump(config))
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out", "-q")
    assert code == 0, err
    on_disk = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in on_disk.items():
        assert merged[name].numpy().tobytes() == tensor.numpy().tobytes(), name


def test_warnings_go_to_the_logger_not_the_screen(capsys: Any, caplog: pytest.LogCaptureFixture) -> None:
    a = {"model.embed_tokens.weight": torch.randn(10, 4)}
    b = {"model.embed_tokens.weight": torch.randn(12, 4)}
    with caplog.at_level("WARNING", logger="mergesmith"):
        params = [{"weight": 1.0}] * 2
        merged = mergesmith.merge_state_dicts(
            "linear", [a, b], model_parameters=params, allow_crimes=True, unsafe_truncate_embeddings=True
        )
    assert merged["model.embed_tokens.weight"].shape == (10, 4)
    assert any("vocabulary sizes differ" in r.getMessage() for r in caplog.records)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_in_memory_on_the_gpu_gives_the_cpu_bytes() -> None:
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    params = [{"weight": 0.3}, {"weight": 0.7}]
    cpu = mergesmith.merge_tensors("linear", [a, b], model_parameters=params)
    gpu = mergesmith.merge_tensors("linear", [a.cuda(), b.cuda()], model_parameters=params)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu)


def test_moe_and_multi_mirror_their_commands(models: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    moe_config = {
        "base_model": str(models["base"]),
        "gate_mode": "random",
        "experts": [{"source_model": str(models["a"])}, {"source_model": str(models["b"])}],
    }
    path = tmp_path / "moe.yml"
    path.write_text(yaml.safe_dump(moe_config))
    code, _out, err = run_cli(capsys, "moe", path, tmp_path / "moe-cli", "--random-seed", "3", "-q")
    assert code == 0, err
    result = mergesmith.moe(moe_config, tmp_path / "moe-api", random_seed=3)
    assert result.plan.options["moe"]["experts"] == 2
    assert _files(tmp_path / "moe-api") == _files(tmp_path / "moe-cli")
    with pytest.raises(mergesmith.ConfigError, match="mergesmith.moe"):
        mergesmith.merge(moe_config, tmp_path / "wrong")

    stages = [
        {"name": "first", **_linear(models)},
        {
            "name": "second",
            "merge_method": "slerp",
            "base_model": "first",
            "models": [{"model": "first"}, {"model": str(models["base"])}],
            "parameters": {"t": 0.25},
        },
    ]
    text = yaml.safe_dump_all(stages, sort_keys=False)
    (tmp_path / "multi.yml").write_text(text)
    code, _out, err = run_cli(capsys, "multi", tmp_path / "multi.yml", "--out-dir", tmp_path / "multi-cli", "-q")
    assert code == 0, err
    results = mergesmith.multi(text, tmp_path / "multi-api")
    assert [r.name for r in results] == ["first", "second"]
    for stage in ("first", "second"):  # the weights; the recorded configs name each run's own stage paths
        api, cli = (_files(tmp_path / run / stage) for run in ("multi-api", "multi-cli"))
        assert api["model.safetensors"] == cli["model.safetensors"], stage
    assert capsys.readouterr().out == ""
