"""No silent garbage in, and errors that stay one clear line (issue 17): parameter values, nesting and alias
bombs in configs and JSON files, a config.json that disagrees with its tensors, tensors only some models have,
non-finite weights streaming through a merge, and an input truncated under a memory map.

Each test fails on the code before these checks: a garbage value merged with exit 0, an internal
RecursionError, a misleading count, a dropped tensor, a silent NaN, a SIGBUS.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mergesmith.config import parse_config, read_yaml
from mergesmith.errors import ConfigError
from tests.helpers import assert_one_line_error, run_cli, write_config


@pytest.fixture(scope="module")
def base(tiny_models: Any) -> Path:
    return tiny_models("llama", seed=1, layers=2)


@pytest.fixture(scope="module")
def tuned(tiny_models: Any, base: Path) -> list[Path]:
    return [tiny_models.derive(base, seed=s) for s in (2, 3)]


def _ties(models: list[str], params: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {
        "merge_method": top.pop("merge_method", "ties"),
        "base_model": "base",
        "models": [{"model": m, "parameters": p} for m, p in zip(models, params)],
        **top,
    }


# ----- parameter values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "key"),
    [
        # non-finite values, in every shape a setting can take (the unused filter and gradient point included)
        (_ties(["a"], [{"weight": math.nan}]), "models[0].parameters.weight"),
        (_ties(["a"], [{"weight": math.inf}]), "models[0].parameters.weight"),
        (_ties(["a"], [{"weight": 1.0}], parameters={"lambda": -math.inf}), "parameters.lambda"),
        (_ties(["a"], [{"weight": 1.0, "density": [0.5, 0.7, math.nan]}]), "models[0].parameters.density[2]"),
        (
            _ties(["a"], [{"weight": [{"filter": "no_such_tensor", "value": math.nan}, {"value": 1.0}]}]),
            "models[0].parameters.weight[0].value",
        ),
        (
            _ties(["a"], [{"weight": [{"filter": "mlp", "value": [1.0, math.inf]}, {"value": 1.0}]}]),
            "models[0].parameters.weight[0].value[1]",
        ),
        (
            {
                "merge_method": "slerp",
                "base_model": "a",
                "models": [{"model": "a"}, {"model": "b"}],
                "parameters": {"t": math.nan},
            },
            "parameters.t",
        ),
        # out of range: what mergekit fails on (DARE) or silently turns into nothing (TIES)
        (_ties(["a"], [{"weight": 1.0, "density": -0.5}]), "models[0].parameters.density"),
        (_ties(["a"], [{"weight": 1.0, "density": -0.5}], merge_method="dare_ties"), "models[0].parameters.density"),
        (_ties(["a"], [{"weight": 1.0, "density": [1.0, -0.1]}]), "models[0].parameters.density[1]"),
        (
            _ties(["a"], [{"weight": 1.0, "density": 0.5, "epsilon": -0.1}], merge_method="della"),
            "models[0].parameters.epsilon",
        ),
        (_ties(["a", "b"], [{}, {}], merge_method="ram", parameters={"epsilon": -1e-5}), "parameters.epsilon"),
    ],
)
def test_bad_parameter_values_are_refused_naming_the_key(config: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config, "c.yml")
    assert f"`{key}`" in str(err.value) and "\n" not in str(err.value)


def test_slice_residual_weight_must_be_finite() -> None:
    config = {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": "a", "layer_range": [0, 1]}], "residual_weight": math.nan}],
    }
    with pytest.raises(ConfigError, match=r"`slices\[0\].residual_weight`"):
        parse_config(config, "c.yml")


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (_ties(["a"], [{"weight": 1.0, "density": 0}]), "models[0].parameters.density"),
        (_ties(["a"], [{"weight": 1.0, "density": 1.5}]), "models[0].parameters.density"),
        (
            {
                "merge_method": "slerp",
                "base_model": "a",
                "models": [{"model": "a"}, {"model": "b"}],
                "parameters": {"t": [0.0, 1.2]},
            },
            "parameters.t[1]",
        ),
    ],
)
def test_values_mergekit_accepts_warn_and_strict_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path], config: dict[str, Any], key: str
) -> None:
    """mergekit 0.1.5 merges these (density 0 drops the task vector, above 1 keeps it whole, slerp extrapolates):
    accepted with a warning naming the key; --strict turns it into the one-line error."""
    real = {"a": str(tuned[0]), "b": str(tuned[1]), "base": str(base)}
    config = json.loads(json.dumps(config))
    config["base_model"] = real[config["base_model"]]
    for m in config["models"]:
        m["model"] = real[m["model"]]
    path = write_config(tmp_path / "c.yml", config)
    code, out, err = run_cli(capsys, "plan", path)
    assert code == 0, err
    assert [line for line in out.splitlines() if f"`{key}`" in line and line.startswith("warning:")], out
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out", "--strict", "-q")
    assert_one_line_error(code, err, f"`{key}`", "--strict")
    assert not (tmp_path / "out").exists()


def test_nan_weight_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    """The reported case: `weight: .nan` merged with exit 0 into an all-NaN model."""
    path = tmp_path / "c.yml"
    path.write_text(
        f"merge_method: linear\nmodels:\n  - model: {tuned[0]}\n    parameters: {{weight: .nan}}\n"
        f"  - model: {tuned[1]}\n    parameters: {{weight: 1.0}}\n"
    )
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out", "-q")
    assert_one_line_error(code, err, "models[0].parameters.weight", "not a finite number")
    assert not (tmp_path / "out").exists()


def test_good_parameters_pass_without_warnings() -> None:
    from mergesmith.config.parameter_values import check_parameter_values

    config = parse_config(
        _ties(
            ["a", "b"],
            [{"weight": [1.0, 0.0], "density": [1.0, 0.1]}, {"weight": -0.5, "density": 1.0}],
            merge_method="della",
            parameters={"epsilon": 0.0, "lambda": 2.0},
        ),
        "c.yml",
    )
    assert check_parameter_values(config, "c.yml") == []


# ----- nesting and alias bombs -----------------------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\nmerge_method: linear\nmodels:\n  - model: m\n    parameters: {weight: 1}\n"


def test_alias_bomb_is_refused_in_well_under_a_second(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yml"
    path.write_text(_alias_bomb())
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="alias") as err:
        read_yaml(path)
    assert time.perf_counter() - started < 0.5
    assert str(path) in str(err.value)


def test_warm_start_thread_does_not_walk_an_alias_bomb(tmp_path: Path) -> None:
    """The merge command's warm-start thread parses the config before anything else: it used to walk the
    expanded bomb (387 million visits, holding the GIL) for 4-34 s before the main thread could refuse it."""
    from mergesmith.runtime.warm_start import _read_ahead

    path = tmp_path / "bomb.yml"
    path.write_text(_alias_bomb())
    done = threading.Event()
    thread = threading.Thread(target=lambda: (_read_ahead(path), done.set()), daemon=True)
    started = time.perf_counter()
    thread.start()
    assert done.wait(5), "the warm-start thread is still walking the config"
    assert time.perf_counter() - started < 1.0


def test_cli_refuses_an_alias_bomb_quickly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bomb.yml"
    path.write_text(_alias_bomb())
    run_cli(capsys, "plan", tmp_path / "missing.yml")  # imports done: time the refusal, not the start-up
    started = time.perf_counter()
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out")
    elapsed = time.perf_counter() - started
    assert_one_line_error(code, err, str(path), "alias")
    assert elapsed < 1.0, f"{elapsed:.1f}s"
    for thread in threading.enumerate():  # nothing is left walking the expanded config behind the refusal
        if thread.name == "warm-start":
            thread.join(timeout=1.0)
            assert not thread.is_alive(), "the warm-start thread is still walking the alias bomb"


def test_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yml"
    path.write_text("merge_method: linear\nloop: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="recursive"):
        read_yaml(path)


def test_moderate_aliases_still_load(tmp_path: Path) -> None:
    """Anchors that reuse a parameter block (what real configs do) are fine."""
    path = tmp_path / "ok.yml"
    path.write_text(
        "merge_method: linear\nmodels:\n  - model: a\n    parameters: &p {weight: [0.1, 0.5, 0.9]}\n"
        "  - model: b\n    parameters: *p\n"
    )
    data, _text = read_yaml(path)
    assert data["models"][1]["parameters"] == {"weight": [0.1, 0.5, 0.9]}


def test_config_5000_levels_deep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deep.yml"
    path.write_text("merge_method: linear\nparameters:\n  weight: " + "[" * 5000 + "]" * 5000 + "\n")
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out")
    assert_one_line_error(code, err, str(path), "nested too deeply")


def _deep_json(levels: int = 100_000) -> str:
    return "[" * levels + "]" * levels


def _linear(tmp_path: Path, *models: Path) -> Path:
    return write_config(
        tmp_path / "merge.yml",
        {"merge_method": "linear", "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in models]},
    )


@pytest.mark.parametrize("where", ["config.json", "index", "header"])
def test_deeply_nested_json_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, where: str
) -> None:
    model = Path(shutil.copytree(base, tmp_path / "model"))
    if where == "config.json":
        target = model / "config.json"
        config = json.loads(target.read_text())
        target.write_text(json.dumps(config)[:-1] + ', "deep": ' + _deep_json() + "}")
    elif where == "index":
        target = model / "model.safetensors.index.json"
        target.write_text('{"metadata": ' + _deep_json() + ', "weight_map": {}}')
    else:
        target = model / "model.safetensors"
        raw = target.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        blob = (json.dumps(header)[:-1] + ', "deep": ' + _deep_json() + "}").encode()
        target.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, model), tmp_path / "out")
    assert_one_line_error(code, err, str(target), "nested too deeply")


# ----- config.json against the tensors --------------------------------------------------------------------


def test_config_claiming_more_layers_names_the_real_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    liar = Path(shutil.copytree(base, tmp_path / "liar"))
    config = json.loads((liar / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (liar / "config.json").write_text(json.dumps(config))
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, liar, tuned[0]), tmp_path / "out")
    line = assert_one_line_error(code, err, "liar", "num_hidden_layers: 5", "2 layers")
    assert "has 0" not in line
    sliced = write_config(
        tmp_path / "slices.yml",
        {"merge_method": "passthrough", "slices": [{"sources": [{"model": str(liar), "layer_range": [0, 2]}]}]},
    )
    code, _out, err = run_cli(capsys, "merge", sliced, tmp_path / "out")
    line = assert_one_line_error(code, err, "liar", "num_hidden_layers: 5", "2 layers")
    assert "past the 0 layers" not in line


# ----- tensors only some models have ---------------------------------------------------------------------


def _edit_weights(model: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    weights = model / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_tensor_the_base_has_and_the_lead_lacks_is_refused_not_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    """TIES with the base listed after a model that lacks one of its layer tensors: the layer tensors used to
    come from the first model alone, so the tensor was silently missing from the output."""
    lacking = Path(shutil.copytree(tuned[0], tmp_path / "lacking"))
    _edit_weights(lacking, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    path = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "ties",
            "base_model": str(base),
            "models": [
                {"model": str(lacking), "parameters": {"weight": 0.5, "density": 0.5}},
                {"model": str(tuned[1]), "parameters": {"weight": 0.5, "density": 0.5}},
            ],
        },
    )
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out")
    assert_one_line_error(code, err, "mlp.down_proj.weight", "not found", str(lacking), str(base), str(tuned[1]))
    assert not (tmp_path / "out").exists()


def test_tensor_missing_from_several_models_names_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    a = Path(shutil.copytree(tuned[0], tmp_path / "a"))
    b = Path(shutil.copytree(tuned[1], tmp_path / "b"))
    for m in (a, b):
        _edit_weights(m, lambda t: t.pop("model.norm.weight"))
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, base, a, b), tmp_path / "out")
    assert_one_line_error(code, err, "model.norm.weight", "not found", str(a), str(b))


def test_tensor_only_other_models_have_is_named_in_a_warning_and_strict_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    """The output follows the first model (as mergekit's follows its architecture), so a tensor only a later
    model has is left out: said in a warning naming the tensor and the model, refused under --strict."""
    import torch

    extra = Path(shutil.copytree(tuned[0], tmp_path / "extra"))

    def add(t: dict[str, Any]) -> None:
        t["model.layers.0.mlp.extra.weight"] = torch.ones(4, 4)
        t["model.extra_norm.weight"] = torch.ones(32)

    _edit_weights(extra, add)
    config = _linear(tmp_path, base, extra)
    code, _out, err = run_cli(capsys, "merge", config, tmp_path / "out")
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("warning:") and "left out" in line]
    assert warning and "model.extra_norm.weight" in warning[0] and "mlp.extra.weight" in warning[0]
    assert str(extra) in warning[0]
    code, _out, err = run_cli(capsys, "merge", config, tmp_path / "out2", "--strict")
    assert_one_line_error(code, err, "model.extra_norm.weight", "--strict")


def test_optional_buffers_some_models_lack_are_copied_from_the_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], base: Path, tuned: list[Path]
) -> None:
    """A rotary inv_freq buffer (older Llama saves) in the base but not in the other model: copied, not refused."""
    import torch
    from safetensors.torch import load_file

    with_buffer = Path(shutil.copytree(base, tmp_path / "with_buffer"))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    _edit_weights(with_buffer, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq}))
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, with_buffer, tuned[0]), tmp_path / "out")
    assert code == 0, err
    assert "left out" not in err
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(merged["model.layers.0.self_attn.rotary_emb.inv_freq"], inv_freq)
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, tuned[0], with_buffer), tmp_path / "out2")
    assert code == 0, err
    assert "left out" not in err  # the output follows the first model, which has no such buffer


# ----- non-finite weights ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory, tuned: list[Path]) -> Path:
    """A model with one NaN in an MLP weight and one inf in an attention weight."""
    path = Path(shutil.copytree(tuned[0], tmp_path_factory.mktemp("poisoned") / "model"))

    def poison(t: dict[str, Any]) -> None:
        t["model.layers.0.mlp.up_proj.weight"][3, 5] = math.nan
        t["model.layers.1.self_attn.q_proj.weight"][0, 0] = math.inf

    _edit_weights(path, poison)
    return path


@pytest.mark.parametrize("direct_io", ["1", "0"])
def test_nan_and_inf_in_an_input_are_warned_once_per_tensor(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    poisoned: Path,
    tuned: list[Path],
    direct_io: str,
) -> None:
    monkeypatch.setenv("MERGESMITH_DIRECT_IO", direct_io)  # read through the feed, and through the memory map
    code, _out, err = run_cli(
        capsys, "merge", _linear(tmp_path, poisoned, tuned[1]), tmp_path / "out", "--threads", "2"
    )
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, err
    assert any(
        "model.layers.0.mlp.up_proj.weight" in w and str(poisoned) in w and "1 non-finite" in w for w in warnings
    )
    assert any("model.layers.1.self_attn.q_proj.weight" in w and str(poisoned) in w for w in warnings)
    assert "where its inputs had none" not in err


def test_strict_refuses_nan_in_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], poisoned: Path, tuned: list[Path]
) -> None:
    out = tmp_path / "out"
    code, _out, err = run_cli(capsys, "merge", _linear(tmp_path, poisoned, tuned[1]), out, "--strict")
    assert_one_line_error(code, err, str(poisoned), "model.layers.0.mlp.up_proj.weight", "--strict")
    assert not (out / "config.json").exists()


def test_output_made_non_finite_by_the_merge_is_reported_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tuned: list[Path]
) -> None:
    """Finite inputs, a float16 output that overflows: said once at the end, naming the tensors."""
    config = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "linear",
            "out_dtype": "float16",
            "parameters": {"normalize": False},
            "models": [
                {"model": str(tuned[0]), "parameters": {"weight": 100000.0}},
                {"model": str(tuned[1]), "parameters": {"weight": 1.0}},
            ],
        },
    )
    code, _out, err = run_cli(capsys, "merge", config, tmp_path / "out")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "where its inputs had none" in line]
    assert len(lines) == 1 and "model.norm.weight" in lines[0], err
    code, _out, err = run_cli(capsys, "merge", config, tmp_path / "out2", "--strict")
    assert_one_line_error(code, err, "non-finite", "--strict")


def test_count_nonfinite_is_exact() -> None:
    import torch

    from mergesmith.engine.execution.nonfinite import count_nonfinite

    x = torch.zeros(1000)
    assert count_nonfinite(x) == 0
    x[[1, 7, 9]] = torch.tensor([math.nan, math.inf, -math.inf])
    assert count_nonfinite(x) == 3
    big = torch.full((1000,), 3.0e38)  # finite values whose sum overflows: counted exactly, as none
    assert count_nonfinite(big) == 0
    assert count_nonfinite(torch.full((10,), 60000.0, dtype=torch.float16)) == 0
    assert count_nonfinite(torch.arange(10)) == 0


# ----- an input truncated under a memory map ---------------------------------------------------------------

_TRUNCATING_MERGE = """
import os, sys
from pathlib import Path
from mergesmith.io import checkpoint

victim, when = Path(sys.argv[1]).resolve(), sys.argv[2]
original = checkpoint.Checkpoint.get
done = []

def cut(info):
    os.truncate(victim, info.data_offset + info.nbytes // 2 if info.data_offset else os.path.getsize(victim) // 2)

def get(self, name):
    info = self.tensors[name]
    hit = not done and info.file.resolve() == victim and info.nbytes >= 16384
    if hit and when == "before":
        done.append(name)
        cut(info)
    tensor = original(self, name)
    if hit and when == "during":  # the view exists: its pages past the new end are read only by the merge
        done.append(name)
        cut(info)
    return tensor

checkpoint.Checkpoint.get = get
from mergesmith.cli import main
main(sys.argv[3:])
"""


def _truncating_merges(tmp_path: Path, cases: dict[str, tuple[Path, str, dict[str, str]]], other: Path) -> None:
    """Run each case's merge in its own interpreter (a SIGBUS kills it) and check the one-line error."""
    import subprocess
    import sys

    procs = {}
    for key, (model, when, env) in cases.items():
        weights = next(p for p in model.iterdir() if p.suffix in (".safetensors", ".bin"))
        config = write_config(
            tmp_path / f"{key}.yml",
            {
                "merge_method": "linear",
                "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in (model, other)],
            },
        )
        argv = [sys.executable, "-c", _TRUNCATING_MERGE, str(weights), when, "merge", str(config)]
        procs[key] = (
            subprocess.Popen(
                [*argv, str(tmp_path / f"out-{key}")],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **env},
            ),
            weights,
        )
    for key, (proc, weights) in procs.items():
        _stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode != -7, f"{key}: killed by SIGBUS"
        assert_one_line_error(proc.returncode, stderr, str(weights), "unexpected end of file")
        assert not (tmp_path / f"out-{key}" / "config.json").exists(), key


def test_input_truncated_during_a_mapped_read_is_one_line_not_sigbus(
    tmp_path: Path, tiny_models: Any, base: Path, tuned: list[Path]
) -> None:
    """An input shrinks while the merge reads it through its memory map (MERGESMITH_DIRECT_IO=0; a `.bin`,
    which torch maps; a model on tmpfs): before the tensor is viewed, and after (its pages past the new end are
    then read by the merge itself: SIGBUS before io.map_guard). Each ends with the direct-read path's one line."""
    mapped = {"MERGESMITH_DIRECT_IO": "0"}
    binary = tiny_models("llama", seed=1, layers=2, fmt="bin")
    cases: dict[str, tuple[Path, str, dict[str, str]]] = {}
    for when in ("before", "during"):
        cases[f"st-{when}"] = (Path(shutil.copytree(tuned[0], tmp_path / f"st-{when}")), when, mapped)
    cases["bin-during"] = (Path(shutil.copytree(binary, tmp_path / "bin-during")), "during", {})
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        on_tmpfs = Path(tempfile.mkdtemp(dir=shm))
        cases["tmpfs-during"] = (Path(shutil.copytree(tuned[0], on_tmpfs / "model")), "during", {})
    try:
        _truncating_merges(tmp_path, cases, tuned[1])
    finally:
        if "tmpfs-during" in cases:
            shutil.rmtree(cases["tmpfs-during"][0].parent, ignore_errors=True)


def test_map_guard_leaves_other_sigbus_alone() -> None:
    """A SIGBUS outside the registered maps is not swallowed: the guard gives the previous handler back."""
    import subprocess
    import sys

    script = (
        "import mmap, os, tempfile\n"
        "from mergesmith.io.map_guard import GUARD\n"
        "fd, path = tempfile.mkstemp(); os.write(fd, b'x' * 65536)\n"
        "m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)\n"
        "GUARD.register(__import__('pathlib').Path('/elsewhere'), 1, 2)\n"
        "os.truncate(path, 0)\n"
        "print(m[60000])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -7, (proc.returncode, proc.stderr)  # SIGBUS, as without the guard


def test_strict_refuses_nan_in_an_input_on_ray(tmp_path: Path, poisoned: Path, tuned: list[Path]) -> None:
    """The Ray executor's workers run the same check; --strict reaches them (their warnings stay there)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'mergesmith[ray]')")
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge
    from mergesmith.errors import CheckpointError

    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight.*--strict"):
        run_merge(_linear(tmp_path, poisoned, tuned[1]), tmp_path / "out", MergeOptions(executor="ray", strict=True))
    assert not (tmp_path / "out" / "config.json").exists()
