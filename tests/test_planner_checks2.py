"""Plan-time checks, second batch: vocabulary truncation warnings (and that `plan` and `merge` show plan
warnings), device availability through the API and extract-lora, working-memory estimates of the
task-vector methods, DELLA's density +/- epsilon, method errors as one line, and MoE dtype names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import assert_one_line_error, run_cli, write_config

# ----- 1. vocabulary sizes differ without a tokenizer section ----------------------------------------------------


@pytest.fixture()
def vocab_cfg(tmp_path: Path, tiny_models: Any) -> tuple[Path, Path, Path]:
    """A linear merge whose base (first model, whose tokenizer is copied) has 272 rows, the other 256."""
    big = tiny_models("llama", seed=2, vocab_size=272)
    small = tiny_models("llama", seed=1)
    cfg = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "linear",
            "base_model": str(big),
            "models": [
                {"model": str(big), "parameters": {"weight": 1}},
                {"model": str(small), "parameters": {"weight": 1}},
            ],
            "dtype": "float32",
        },
    )
    return cfg, big, small


def _vocab_warning(lines: list[str], big: Path, small: Path) -> str:
    hits = [line for line in lines if line.startswith("warning: vocabulary sizes differ")]
    assert len(hits) == 1, lines
    line = hits[0]
    for part in (
        f"model {str(big)!r} has 272",
        f"model {str(small)!r} has 256",
        "first 256 rows",
        "tokenizer_source: base",
        "tokenizer_source: union",
        "out of range",
    ):
        assert part in line, f"{part!r} not in {line!r}"
    return line


def test_different_vocabularies_are_refused_without_a_tokenizer_setting_or_the_flag(vocab_cfg, tmp_path, capsys):
    """mergekit 0.1.5 fails on mismatched vocabularies unless `tokenizer_source`/`tokenizer` or
    --unsafe-truncate-embeddings says how; mergesmith refuses the same, from headers, before writing."""
    cfg, big, small = vocab_cfg
    for command, extra in (("plan", ()), ("merge", (tmp_path / "out",))):
        code, _out, err = run_cli(capsys, command, cfg, *extra)
        line = assert_one_line_error(code, err, "vocabulary sizes differ", "--unsafe-truncate-embeddings")
        for part in (f"model {str(big)!r} has 272", f"model {str(small)!r} has 256", "tokenizer_source: base"):
            assert part in line, line
    assert not (tmp_path / "out").exists()
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "--no-unsafe-truncate-embeddings")
    assert_one_line_error(code, err, "--unsafe-truncate-embeddings")


def test_plan_text_and_json_show_the_vocabulary_truncation_warning(vocab_cfg, capsys):
    """With --unsafe-truncate-embeddings the first rows are kept, and a warning says what that risks."""
    cfg, big, small = vocab_cfg
    code, out, err = run_cli(capsys, "plan", cfg, "--unsafe-truncate-embeddings")
    assert code == 0, err
    _vocab_warning(out.splitlines(), big, small)
    code, out, err = run_cli(capsys, "plan", cfg, "--json", "--unsafe-truncate-embeddings")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    _vocab_warning([f"warning: {w}" for w in warnings], big, small)


def test_merge_prints_plan_warnings_once_on_stderr_even_when_quiet(vocab_cfg, tmp_path, capsys):
    """-q hides progress only (mergekit's --quiet hides progress bars): the warning prints either way."""
    cfg, big, small = vocab_cfg
    for out_dir, quiet in (("out", ()), ("out2", ("-q",))):
        code, out, err = run_cli(capsys, "merge", cfg, tmp_path / out_dir, *quiet, "--unsafe-truncate-embeddings")
        assert code == 0, err
        _vocab_warning(err.splitlines(), big, small)


def test_tokenizer_source_base_builds_the_vocabulary_and_does_not_warn(vocab_cfg, tmp_path, capsys):
    cfg, big, small = vocab_cfg
    data = yaml.safe_load(cfg.read_text())
    data["tokenizer_source"] = "base"
    code, out, err = run_cli(capsys, "plan", write_config(tmp_path / "t.yml", data), "--json")
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "vocabulary sizes differ" in w]


def test_same_vocabulary_has_no_truncation_warning(tmp_path, tiny_models, capsys):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=3)
    models = [{"model": str(m), "parameters": {"weight": 1}} for m in (a, b)]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models})
    code, out, err = run_cli(capsys, "plan", cfg, "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []


# ----- 2. device availability: one check for the CLI, the API and extract-lora -------------------------------------


@pytest.fixture()
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def _linear_cfg(tmp_path: Path, tiny_models: Any) -> Path:
    models = [{"model": str(tiny_models("llama", seed=s)), "parameters": {"weight": 1}} for s in (1, 3)]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models, "dtype": "float32"})


@pytest.mark.parametrize("device", ["cuda", "mps", "cuda:0"])
def test_run_merge_on_a_missing_device_is_a_user_error_before_anything_is_written(
    tmp_path, tiny_models, no_gpu, device
):
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge
    from mergesmith.errors import ConfigError

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"{device.split(':')[0]} device is available"):
        run_merge(_linear_cfg(tmp_path, tiny_models), out, MergeOptions(device=device))
    assert not out.exists()


def test_run_merge_device_auto_falls_back_to_cpu(tmp_path, tiny_models, no_gpu):
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import build_plan, run_merge

    cfg = _linear_cfg(tmp_path, tiny_models)
    options = MergeOptions(device="auto")
    build_plan(cfg, options)
    assert options.device == "cpu"
    result = run_merge(cfg, tmp_path / "out", MergeOptions(device="auto"))
    assert (result.out_dir / "config.json").is_file()


def test_device_is_not_checked_for_the_ray_executor(tmp_path, tiny_models, no_gpu):
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import build_plan

    options = MergeOptions(device="cuda", executor="ray")
    build_plan(_linear_cfg(tmp_path, tiny_models), options)  # the workers hold the GPUs
    assert options.device == "cuda"


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_extract_lora_on_a_missing_device_is_one_line_and_writes_nothing(tmp_path, tiny_models, no_gpu, capsys, device):
    base = tiny_models("llama", seed=1)
    out = tmp_path / "adapter"
    code, _out, err = run_cli(
        capsys,
        "extract-lora",
        "--model",
        tiny_models("llama", seed=3),
        "--base",
        base,
        "--out",
        out,
        "--device",
        device,
    )
    assert_one_line_error(code, err, f"--device {device}", "available")
    assert not out.exists()

    from mergesmith.errors import ConfigError
    from mergesmith.lora.extract import extract_lora

    with pytest.raises(ConfigError, match="available"):
        extract_lora(str(tiny_models("llama", seed=3)), str(base), out, 4, device=device)
    assert not out.exists()


# ----- 3. working-memory estimates cover what the methods allocate -------------------------------------------------


def _peak_allocated(fn: Any) -> int:
    """Peak bytes the CPU allocator holds while `fn` runs, above what it held before (torch profiler's
    memory events carry the allocator's running total, temporaries inside an op included), plus the numpy work
    buffers DARE/DELLA's compiled chunks keep (keyed_merge's, which torch's profiler does not see)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from mergesmith.kernels import keyed_kernels, keyed_merge
    keyed_merge._BUFFERS.pool.clear()  # DARE/DELLA's reused work buffers: allocated afresh, as by a new worker
    keyed_merge._BUFFERS.arrays.clear()
    keyed_kernels.warm()  # their compiled loops loaded before, not inside, the measurement (numba's own objects)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    events.sort(key=lambda e: float(e["ts"]))
    assert events, "the profiler recorded no allocations"
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    arrays = sum(a.nbytes for a in keyed_merge._BUFFERS.arrays.values())
    return max(e["args"]["Total Allocated"] for e in events) - start + arrays


def _numpy_peak(fn: Any, into: list[Any]) -> None:
    """Run `fn`, appending to `into` the peak bytes numpy's arrays held meanwhile (numpy reports its data
    buffers to tracemalloc; torch's allocator does not, so the two measures do not overlap)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        into.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


MEMORY_CASES = {  # method: (per-model parameters of the non-base models, global parameters)
    "task_arithmetic": ({"weight": 0.7}, {}),
    "ties": ({"weight": 0.7, "density": 0.5}, {}),
    "dare_ties": ({"weight": 0.7, "density": 0.5}, {}),
    "breadcrumbs_ties": ({"weight": 0.7, "density": 0.5}, {}),
    "della": ({"weight": 0.7, "density": 0.5}, {}),
    "della_linear": ({"weight": 0.7, "density": 0.5}, {}),
    "sce": ({}, {"select_topk": 0.5}),
    "multislerp": ({"weight": 0.3}, {}),
    "ram": ({}, {}),
    "consensus_ta": ({"weight": 0.7, "k": 2}, {}),
    "consensus_ties": ({"weight": 0.7, "density": 0.5, "k": 2}, {}),
    "magmax": ({}, {}),
    "pcb": ({}, {}),
    "wudi": ({}, {"iter_num": 5}),
    "arcee_fusion": ({}, {}),  # the base and one model; its importances are float64 (methods/arcee_fusion.row_kl)
}
TWO_MODEL_METHODS = {"arcee_fusion"}


def _memory_case_recipe(method: str, name: str, shape: tuple[int, ...], compute: str, store: str, n: int) -> Any:
    """A merge recipe of MEMORY_CASES[method] over n inputs `m{i}-{store}` (model 0 the base)."""
    from mergesmith.engine.plan import InputRef, TensorRecipe
    from mergesmith.methods import get_method

    spec = get_method(method)
    model_params, params = MEMORY_CASES[method]
    defaults = {p.name: p.default for p in spec.model_params}
    per_model = tuple(tuple((defaults | (model_params if i else {})).items()) for i in range(n))
    return TensorRecipe(
        name,
        shape,
        compute,
        "merge",
        tuple(InputRef(f"m{i}-{store}", "w") for i in range(n)),
        method,
        0,
        per_model,
        tuple(({p.name: p.default for p in spec.params} | params).items()),
        7 if spec.randomized else None,
    )


@pytest.fixture(scope="module")
def memory_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four related 192x320 tensors (a base and three fine-tunes), stored as float32 and as bfloat16."""
    import torch
    from safetensors.torch import save_file

    from mergesmith.io.checkpoint import Checkpoint

    root = tmp_path_factory.mktemp("memory")
    base = torch.randn(192, 320, generator=torch.Generator().manual_seed(0))
    ckpts = {}
    for store, dtype in (("F32", torch.float32), ("BF16", torch.bfloat16)):
        for i in range(4):
            noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(i + 1))
            path = root / f"m{i}-{store}.safetensors"
            save_file({"w": (base + 0.01 * noise * (i > 0)).to(dtype).contiguous()}, str(path))
            ckpts[f"m{i}-{store}"] = Checkpoint.open(str(path))
    return ckpts


@pytest.mark.parametrize("method", sorted(MEMORY_CASES))
@pytest.mark.parametrize("store,compute", [("F32", "F32"), ("BF16", "BF16"), ("BF16", "F32"), ("F32", "BF16")])
def test_recipe_memory_covers_the_measured_peak(memory_inputs, method, store, compute):
    """What a merge holds for one recipe: the allocations of computing it (converted inputs, the method's
    stacks, sort indices, masks) plus its inputs' pages, counted at the compute width."""
    import torch

    from mergesmith.engine.execution.compute import compute as compute_recipe
    from mergesmith.engine.planning.shared import recipe_memory
    from mergesmith.io.dtypes import dtype_size, to_torch

    n = 2 if method in TWO_MODEL_METHODS else 4
    recipe = _memory_case_recipe(method, "model.layers.0.mlp.up_proj.weight", (192, 320), compute, store, n)
    peak = _peak_allocated(lambda: compute_recipe(recipe, memory_inputs, to_torch(compute), True, torch.device("cpu")))
    held = peak + n * 192 * 320 * dtype_size(compute)
    estimate = recipe_memory(recipe, compute)
    assert estimate >= held, f"{method} {store}->{compute}: estimate {estimate} < measured {held}"
    assert estimate <= 3 * held, f"{method} {store}->{compute}: estimate {estimate} far above measured {held}"


@pytest.fixture(scope="module")
def large_memory_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four related bfloat16 tensors larger than one mix chunk of the task-vector family."""
    import torch
    from safetensors.torch import save_file

    from mergesmith.io.checkpoint import Checkpoint
    from mergesmith.kernels.task_vector_mix import MIX_CHUNK

    root = tmp_path_factory.mktemp("large-memory")
    shape = (2048, MIX_CHUNK // 2048 + 512)  # one full chunk and part of another
    base = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ckpts = {}
    for i in range(4):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(i + 1))
        path = root / f"m{i}.safetensors"
        save_file({"w": (base + 0.01 * noise * (i > 0)).to(torch.bfloat16).contiguous()}, str(path))
        ckpts[f"m{i}-BF16"] = Checkpoint.open(str(path))
    return ckpts


@pytest.mark.parametrize("method", ["ties", "della"])
@pytest.mark.parametrize("compute", ["BF16", "F32"])
def test_recipe_memory_of_tensors_larger_than_a_mix_chunk(large_memory_inputs, method, compute):
    """Past one chunk the task-vector mix's temporaries stop growing: the estimate must still cover the peak,
    and not overshoot it by the 2.5x a tensor-wide charge gave (the 1 B TIES merge planned 4.2 GB, used 1.4)."""
    import torch

    from mergesmith.engine.execution.blocks import block_numel, row_blocks
    from mergesmith.engine.execution.compute import Gathered
    from mergesmith.engine.execution.compute import compute as compute_recipe
    from mergesmith.engine.planning.shared import recipe_memory
    from mergesmith.io.dtypes import dtype_size, to_torch
    from mergesmith.methods import get_method

    n = 4
    shape = tuple(large_memory_inputs["m0-BF16"].info("w").shape)
    numel = shape[0] * shape[1]
    recipe = _memory_case_recipe(method, "model.embed_tokens.weight", shape, compute, "BF16", n)
    args = (large_memory_inputs, to_torch(compute), True, torch.device("cpu"))
    blocks = row_blocks(recipe)
    totals_held = 0
    if len(blocks) > 1:  # the executor merges it by row blocks (after a totals pass): one block is held
        gathered = Gathered()

        def totals_pass() -> Any:
            for rows in blocks:
                compute_recipe(recipe, *args, rows=rows, gather=gathered)
            return get_method(method).totals.finish(gathered.state)

        # TIES' pass keeps every task vector's magnitudes (torch) and selects with numpy arrays (tracemalloc)
        made: list[Any] = []
        totals_held = _peak_allocated(lambda: _numpy_peak(lambda: made.append(totals_pass()), into=made))
        totals_held += made[1]  # its peak is the selection, after the last block's inputs went
        totals = made[0]
        numel = block_numel(recipe)
        peak = _peak_allocated(lambda: compute_recipe(recipe, *args, rows=blocks[0], totals=totals))
    else:
        peak = _peak_allocated(lambda: compute_recipe(recipe, *args))
    held = max(peak + n * numel * dtype_size(compute), totals_held)
    estimate = recipe_memory(recipe, compute)
    assert held <= estimate <= 2 * held, f"{method} BF16->{compute}: estimate {estimate}, measured {held}"


# ----- 4. DELLA's density +/- epsilon at plan time; method errors as one line ----------------------------------------


def _della_cfg(tmp_path: Path, tiny_models: Any, method: str, **params: Any) -> tuple[Path, Path]:
    base = tiny_models("llama", seed=1)
    tuned = tiny_models.derive(base, seed=5)
    cfg = write_config(
        tmp_path / "della.yml",
        {
            "merge_method": method,
            "base_model": str(base),
            "models": [{"model": str(tuned), "parameters": {"weight": 1.0, **params}}],
            "dtype": "float32",
        },
    )
    return cfg, tuned


@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize("command", ["merge", "plan"])
def test_della_density_epsilon_out_of_range_is_a_plan_time_error(tmp_path, tiny_models, capsys, method, command):
    cfg, tuned = _della_cfg(tmp_path, tiny_models, method, density=0.5, epsilon=0.6)
    out = tmp_path / "out"
    args = [command, cfg, out, "--random-seed", "1"] + (["-q"] if command == "merge" else [])
    code, _out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, str(tuned), method, "density (0.5)", "epsilon (0.6)")
    assert not out.exists()


def test_della_check_resolves_gradients_per_layer(tmp_path, tiny_models, capsys):
    """density 0.2 -> 0.9 over the layers: fine for the first, 0.9 + 0.15 is past 1 for the last."""
    cfg, tuned = _della_cfg(tmp_path, tiny_models, "della", density=[0.2, 0.9])
    code, _out, err = run_cli(capsys, "plan", cfg, "--random-seed", "1")
    line = assert_one_line_error(code, err, str(tuned), "density (0.9)", "epsilon (0.15)")
    assert "layers.3." in line
    cfg, _ = _della_cfg(tmp_path, tiny_models, "della", density=[0.2, 0.8])
    code, _out, err = run_cli(capsys, "plan", cfg, "--random-seed", "1")
    assert code == 0, err


def test_a_method_value_error_while_merging_is_one_line_naming_the_tensor(tmp_path, tiny_models, capsys, monkeypatch):
    import dataclasses

    from mergesmith.methods import registry

    def refuse(inputs: Any) -> Any:
        if inputs.tensor_name.endswith("layers.2.mlp.up_proj.weight"):
            raise ValueError("these inputs cannot be merged")
        return inputs.tensors[0]

    monkeypatch.setitem(registry._REGISTRY, "linear", dataclasses.replace(registry._REGISTRY["linear"], merge=refuse))
    models = [{"model": str(tiny_models("llama", seed=s)), "parameters": {"weight": 1}} for s in (1, 3)]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models, "dtype": "float32"})
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q", "--threads", "2")
    assert_one_line_error(code, err, "model.layers.2.mlp.up_proj.weight", "linear", "these inputs cannot be merged")


# ----- 5. MoE configs validate dtype names as merge configs do -------------------------------------------------------


@pytest.mark.parametrize("command", ["moe", "plan"])
def test_moe_unknown_dtype_fails_before_any_checkpoint_is_opened(tmp_path, capsys, monkeypatch, command):
    from mergesmith.io.checkpoint import Checkpoint

    def never(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a checkpoint was opened before the config was validated")

    monkeypatch.setattr(Checkpoint, "open", never)
    cfg = write_config(
        tmp_path / "moe.yml",
        {
            "base_model": "a",
            "gate_mode": "random",
            "experts": [{"source_model": "b"}, {"source_model": "c"}],
            "dtype": "banana",
        },
    )
    out = tmp_path / "out"
    code, _out, err = run_cli(capsys, command, cfg, out)
    assert_one_line_error(code, err, str(cfg), "`dtype`", "unknown dtype 'banana'", "bfloat16")
    assert not out.exists()


def test_moe_known_dtype_spellings_are_accepted():
    from mergesmith.moe.config import parse_moe_config

    for name in ("bfloat16", "bf16", "float16", "fp16", "float32", "torch.float32", "float64"):
        config = parse_moe_config(
            {"base_model": "a", "gate_mode": "random", "experts": [{"source_model": "b"}] * 2, "dtype": name}
        )
        assert config.dtype == name
