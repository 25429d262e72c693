"""LiNeS (methods/lines.py): the `lines` method against the paper's equation coded here in float64, and the
`lines_alpha`/`lines_beta` option of every task-vector method against the method's own output rescaled by depth.

lambda(l) = alpha + beta * (l - 1) / (L - 1) over the OUTPUT's L layers; tensors outside the layer stack
(embeddings, final norm, lm_head) get alpha, as the authors' reference code does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mergesmith.engine.execution import blocks
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import build_plan, run_merge
from mergesmith.methods import MergeInputs, MethodSpec, get_method
from mergesmith.methods.lines import with_lines_option
from tests.helpers import assert_one_line_error, read_state_dict, run_cli, write_config
from tests.test_planner_checks2 import _peak_allocated, memory_inputs  # noqa: F401 - the fixture too

LAYER = re.compile(r"\.layers\.(\d+)\.")
SEED = 5


def lam64(alpha: float, beta: float, name: str, layers: int) -> float:
    """The paper's lambda(l) in float64 for a tensor name: alpha outside the layer stack."""
    hit = LAYER.search(name)
    if hit is None or layers == 1:
        return alpha
    return alpha + beta * int(hit.group(1)) / (layers - 1)


@pytest.fixture(scope="module")
def family(tiny_models: Any) -> dict[str, Path]:
    """A 4-layer float32 llama base (untied head) and three fine-tunes of it."""
    base = tiny_models("llama", seed=21, layers=4)
    tuned = {k: tiny_models.derive(base, seed=s, scale=0.02) for k, s in (("a", 1), ("b", 2), ("c", 3))}
    return {"base": base, **tuned}


def _merge(tmp: Path, name: str, config: dict[str, Any], **options: Any) -> dict[str, torch.Tensor]:
    path = write_config(tmp / f"{name}.yml", {**config, "dtype": "float32"})
    run_merge(path, tmp / name, MergeOptions(threads=1, random_seed=SEED, copy_tokenizer=False, **options))
    return read_state_dict(tmp / name)


def _models_config(method: str, family: dict[str, Path], per_model: dict[str, dict], **top: Any) -> dict[str, Any]:
    return {
        "merge_method": method,
        "base_model": str(family["base"]),
        "models": [{"model": str(family[k]), "parameters": p} for k, p in per_model.items()],
        **top,
    }


# ----- the method ------------------------------------------------------------------------------------------------


def _lines_reference(states: list[dict[str, torch.Tensor]], weights: list[float], alpha: float, beta: float,
                     layers: int) -> dict[str, torch.Tensor]:
    """base + lambda(l) * sum_i w_i (x_i - base), every tensor, in float64."""
    base, tuned = states[0], states[1:]
    out = {}
    for name, b in base.items():
        b64 = b.double()
        tau = sum(w * (x[name].double() - b64) for w, x in zip(weights, tuned))
        out[name] = b64 + lam64(alpha, beta, name, layers) * tau
    return out


@pytest.mark.parametrize(
    "parameters,weights",
    [
        ({}, [1.0, 1.0, 1.0]),  # the defaults: alpha = 1/T, beta = 0.5, weight 1
        ({"alpha": 0.2, "beta": 0.7}, [0.5, 1.5, 1.0]),
    ],
)
def test_lines_method_equals_the_papers_equation_in_float64(family, tmp_path, parameters, weights):
    per_model = {k: ({"weight": w} if parameters else {}) for k, w in zip("abc", weights)}
    merged = _merge(tmp_path, "lines", _models_config("lines", family, per_model, parameters=parameters))
    states = [read_state_dict(family[k]) for k in ("base", "a", "b", "c")]
    alpha, beta = parameters.get("alpha", 1 / 3), parameters.get("beta", 0.5)
    expected = _lines_reference(states, weights, alpha, beta, layers=4)
    assert set(merged) == set(expected)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(merged)  # alpha's tensors
    for name, want in expected.items():
        got = merged[name]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6, msg=name)
    # the scaling really grows with depth: layer 3 keeps alpha + beta of the task vectors, layer 0 alpha
    name0, name3 = "model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"
    for name, lam in ((name0, alpha), (name3, alpha + beta)):
        tau = sum(w * (s[name].double() - states[0][name].double()) for w, s in zip(weights, states[1:]))
        moved = merged[name].double() - states[0][name].double()
        assert torch.allclose(moved, lam * tau, atol=1e-6) and not torch.allclose(moved, tau, atol=1e-4)


def _shaped_case(seed: int, shape: tuple[int, ...], n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return [base] + [base + 0.05 * torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("shape", [(64, 48), (48,)])
@pytest.mark.parametrize("depth", [None, (0, 6), (2, 6), (5, 6), (0, 1)])
def test_lines_method_on_matrices_and_norms_per_depth(shape, depth):
    """Four task vectors on a 64x48 matrix and a 1-D norm, at every kind of depth, against float64."""
    tensors = _shaped_case(3, shape, 4)
    weights = [0.3, 1.0, 0.8, 1.2]
    spec = get_method("lines")
    params = {"alpha": 0.15, "beta": 0.6}
    model_params = [{}] + [{"weight": w} for w in weights]
    out = spec.merge(MergeInputs(tensors, 0, model_params, params, None, "t", depth=depth))
    fraction = 0.0 if depth is None or depth[1] == 1 else depth[0] / (depth[1] - 1)
    lam = 0.15 + 0.6 * fraction
    base64 = tensors[0].double()
    want = base64 + lam * sum(w * (t.double() - base64) for w, t in zip(weights, tensors[1:]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)


# ----- the option ------------------------------------------------------------------------------------------------

TIES = {"weight": 0.6, "density": 0.5}


@pytest.mark.parametrize("method", ["ties", "dare_linear"])
def test_option_scales_the_methods_own_task_vector_by_output_depth(family, tmp_path, method):
    """With `lines_alpha`/`lines_beta` every tensor is base + lambda(depth) * (the method's output - base), the
    same seed drawing the same DARE masks; embeddings, final norm and head take alpha."""
    per_model = {"a": TIES, "b": {**TIES, "weight": 0.9}, "c": TIES}
    plain = _merge(tmp_path, "plain", _models_config(method, family, per_model))
    option = {"lines_alpha": 0.25, "lines_beta": 0.6}
    scaled = _merge(tmp_path, "scaled", _models_config(method, family, per_model, parameters=option))
    base = read_state_dict(family["base"])
    assert set(scaled) == set(plain)
    for name, b in base.items():
        lam = lam64(0.25, 0.6, name, layers=4)
        want = b + lam * (plain[name] - b)  # float32, as the option computes it
        assert torch.equal(scaled[name], want), name
    deep = "model.layers.3.self_attn.q_proj.weight"
    assert not torch.equal(scaled[deep], plain[deep])


def test_option_with_one_parameter_takes_the_reference_default_for_the_other(family, tmp_path):
    per_model = {"a": {"weight": 1.0}, "b": {"weight": 1.0}}
    plain = _merge(tmp_path, "plain", _models_config("task_arithmetic", family, per_model))
    only_beta = _merge(tmp_path, "beta", _models_config("task_arithmetic", family, per_model,
                                                         parameters={"lines_beta": 0.9}))
    base = read_state_dict(family["base"])
    for name, b in base.items():
        lam = lam64(0.0, 0.9, name, layers=4)  # a missing lines_alpha is 0
        torch.testing.assert_close(only_beta[name], b + lam * (plain[name] - b), rtol=0, atol=0)
    assert torch.equal(only_beta["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_option_parameters_resolve_per_tensor_like_any_other(family, tmp_path):
    """A `filter` and a gradient: lines_beta is resolved per tensor; where neither parameter resolves to a value
    the method runs untouched."""
    per_model = {"a": {"weight": 1.0}, "b": {"weight": 0.5}}
    plain = _merge(tmp_path, "plain", _models_config("task_arithmetic", family, per_model))
    option = {"lines_alpha": [{"filter": "mlp", "value": 0.5}], "lines_beta": [{"filter": "mlp", "value": [0.0, 1.0]}]}
    scaled = _merge(tmp_path, "scaled", _models_config("task_arithmetic", family, per_model, parameters=option))
    base = read_state_dict(family["base"])
    for name, b in base.items():
        if "mlp" not in name:
            assert torch.equal(scaled[name], plain[name]), name
            continue
        layer = int(LAYER.search(name).group(1))
        beta = layer / 3  # the gradient [0, 1] over 4 layers
        lam = 0.5 + beta * layer / 3
        torch.testing.assert_close(scaled[name], b + lam * (plain[name] - b), rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("method", ["ties", "dare_linear"])
def test_option_gives_the_same_bytes_in_row_blocks(family, tmp_path, monkeypatch, method):
    """The scaling is one number per tensor, so the row-block paths (TIES' and DARE's totals passes) give the
    bytes of the whole-tensor merge."""
    config = _models_config(method, family, {"a": TIES, "b": TIES}, parameters={"lines_alpha": 0.3, "lines_beta": 0.5})
    whole = _merge(tmp_path, "whole", config)
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 256)  # the tiny tensors now take several blocks each
    blocked = _merge(tmp_path, "blocked", config)
    for name, tensor in whole.items():
        assert torch.equal(blocked[name], tensor), name


def test_option_wraps_task_vector_methods_only_and_plugins_alike():
    def _merge_half(inputs: MergeInputs) -> torch.Tensor:  # a third party's task-vector method
        base = inputs.tensors[inputs.base_index]
        return base + 0.5 * sum(inputs.tensors[i] - base for i in inputs.others())

    plugin = MethodSpec(name="half_sum", merge=_merge_half, requires_base=True, task_vector=True)
    wrapped = with_lines_option(plugin)
    assert [p.name for p in wrapped.params] == ["lines_alpha", "lines_beta"]
    other = MethodSpec(name="plain", merge=_merge_half)
    assert with_lines_option(other) is other
    assert "lines_alpha" not in get_method("slerp").param_names()
    assert "lines_alpha" not in get_method("lines").param_names()  # its own alpha and beta
    assert {"lines_alpha", "lines_beta"} <= get_method("ties").param_names()
    tensors = _shaped_case(4, (64, 48), 3)
    mp = [{}] * 4
    off = wrapped.merge(MergeInputs(tensors, 0, mp, {}, None, "t", depth=(2, 5)))
    assert torch.equal(off, _merge_half(MergeInputs(tensors, 0, mp, {}, None, "t")))
    on = wrapped.merge(MergeInputs(tensors, 0, mp, {"lines_alpha": 0.1, "lines_beta": 0.8}, None, "t", depth=(2, 5)))
    base64 = tensors[0].double()
    want = base64 + (0.1 + 0.8 * 2 / 4) * 0.5 * sum(t.double() - base64 for t in tensors[1:])
    torch.testing.assert_close(on.double(), want, rtol=0, atol=2e-6)
    # a method that returns the base itself (nothing to merge) is not written over
    lone = [tensors[0].clone()]
    same = wrapped.merge(
        MergeInputs(lone, 0, [{}], {"lines_alpha": 0.5}, None, "t", depth=(0, 3))
    )
    assert torch.equal(same, tensors[0]) and torch.equal(lone[0], tensors[0])


# ----- depth: slices, modules ------------------------------------------------------------------------------------


def test_frankenmerge_depth_is_the_output_layers(family, tmp_path):
    """Output layers 0-1 come from source layers 2-3 and output layers 2-5 from source layers 0-3: each is scaled
    by its OUTPUT depth over the output's 6 layers."""
    base, a, b = (str(family[k]) for k in ("base", "a", "b"))

    def slice_(start: int, end: int) -> dict[str, Any]:
        return {
            "sources": [
                {"model": base, "layer_range": [start, end]},
                {"model": a, "layer_range": [start, end], "parameters": {"weight": 1.0}},
                {"model": b, "layer_range": [start, end], "parameters": {"weight": 0.5}},
            ]
        }

    config = {
        "merge_method": "lines",
        "base_model": base,
        "slices": [slice_(2, 4), slice_(0, 4)],
        "parameters": {"alpha": 0.1, "beta": 0.9},
    }
    plan, _ = build_plan(write_config(tmp_path / "plan.yml", {**config, "dtype": "float32"}))
    depths = {r.name: r.depth for r in plan.recipes}
    assert depths["model.layers.0.mlp.up_proj.weight"] == (0, 6)
    assert depths["model.layers.5.mlp.up_proj.weight"] == (5, 6)
    assert depths["model.embed_tokens.weight"] is None and depths["lm_head.weight"] is None
    merged = _merge(tmp_path, "franken", config)
    states = [read_state_dict(family[k]) for k in ("base", "a", "b")]
    sources = [2, 3, 0, 1, 2, 3]
    for out_layer, src in enumerate(sources):
        out_name, src_name = (f"model.layers.{i}.self_attn.k_proj.weight" for i in (out_layer, src))
        b64 = states[0][src_name].double()
        tau = 1.0 * (states[1][src_name].double() - b64) + 0.5 * (states[2][src_name].double() - b64)
        want = b64 + (0.1 + 0.9 * out_layer / 5) * tau
        torch.testing.assert_close(merged[out_name].double(), want, rtol=0, atol=1e-6, msg=out_name)


def test_modules_give_each_stack_its_own_depth(tmp_path):
    """A `modules:` merge of a LLaVA: the text decoder's layers and the vision tower's each count their own
    output depth; loose tensors (embeddings, projector) have none."""
    from tests.test_compat_corpus import _tiny_llava

    a, b = str(_tiny_llava(tmp_path / "a", 1)), str(_tiny_llava(tmp_path / "b", 2))
    both = [{"model": a, "parameters": {"weight": 1.0}}, {"model": b, "parameters": {"weight": 1.0}}]
    config = {
        "merge_method": "ties",
        "base_model": a,
        "parameters": {"lines_alpha": 0.2, "lines_beta": 0.8},
        "modules": {
            "text_decoder": {
                "slices": [
                    {"sources": [{"model": a, "layer_range": [0, 2]}, {"model": b, "layer_range": [0, 2],
                                                                        "parameters": {"weight": 1.0}}]},
                    {"sources": [{"model": a, "layer_range": [1, 2]}, {"model": b, "layer_range": [1, 2],
                                                                        "parameters": {"weight": 1.0}}]},
                ]
            },
            "model.vision_tower.encoder.layers": {"models": both},
            "multi_modal_projector": {"models": both},
        },
    }
    plan, _ = build_plan(write_config(tmp_path / "vlm.yml", config), MergeOptions(random_seed=1))
    depths = {r.name: r.depth for r in plan.recipes if r.op == "merge"}
    text = {n: d for n, d in depths.items() if "language_model" in n and ".layers." in n}
    vision = {n: d for n, d in depths.items() if "vision_tower" in n and ".layers." in n}
    assert {d for d in text.values()} == {(0, 3), (1, 3), (2, 3)}
    assert {d for d in vision.values()} == {(0, 3), (1, 3), (2, 3)}  # the tower keeps its 3 layers
    assert all(depths[n] is None for n in depths if "multi_modal_projector" in n or "embed" in n)


# ----- resume, refusals ------------------------------------------------------------------------------------------


def test_option_resumes_after_kills_to_the_same_bytes(tmp_path, tiny_models):
    """Killed at write points (each rerun resuming the last's directory), a TIES merge with the option ends
    byte-identical to an uninterrupted one: the depth is part of the plan, hence of its fingerprint."""
    from tests.test_resume import (
        _fine_tune,
        _kill_in_sequence_then_finish,
        _models_config,
        _reference,
        _sequence_points,
    )

    base = tiny_models("llama", seed=1)
    tuned = [_fine_tune(base, tmp_path / f"tuned{s}", seed=s) for s in (11, 12)]
    config = _models_config(
        tmp_path / "lines.yml",
        "ties",
        [(t, {"weight": 0.5, "density": 0.5}) for t in tuned],
        base_model=str(base),
        parameters={"lines_alpha": 0.3, "lines_beta": 0.6},
    )
    ref = _reference(config, tmp_path / "reference")
    _kill_in_sequence_then_finish(tmp_path / "points", config, ref, ["--threads", "2"], _sequence_points(ref, 2))


@pytest.mark.parametrize(
    "method,parameters,key",
    [
        ("ties", {"lines_beta": "high"}, "lines_beta"),
        ("dare_linear", {"lines_alpha": [0.1, "x"]}, "lines_alpha"),
        ("lines", {"beta": "steep"}, "beta"),
        ("lines", {"alpha": True}, "alpha"),
    ],
)
def test_a_bad_value_is_refused_at_plan_time_in_one_line(family, tmp_path, capsys, method, parameters, key):
    per_model = {"a": TIES, "b": TIES} if method != "lines" else {"a": {}, "b": {}}
    path = write_config(tmp_path / "bad.yml", _models_config(method, family, per_model, parameters=parameters))
    code, _out, err = run_cli(capsys, "merge", path, tmp_path / "out", "--random-seed", "1")
    assert_one_line_error(code, err, key)
    assert not (tmp_path / "out").exists()


def test_ray_executor_gives_the_local_bytes(family, tmp_path):
    """Recipes travel to Ray workers with their depth: the option's output is the local executor's, byte for byte."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mergesmith[ray]')")
    import logging

    config = _models_config("dare_linear", family, {"a": TIES, "b": TIES},
                            parameters={"lines_alpha": 0.3, "lines_beta": 0.6})
    path = write_config(tmp_path / "ray.yml", {**config, "dtype": "float32"})
    options = {"out_shard_size": 60_000, "random_seed": SEED, "threads": 2}
    run_merge(path, tmp_path / "local", MergeOptions(**options))
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        run_merge(path, tmp_path / "ray", MergeOptions(**options, executor="ray"))
    finally:
        ray.shutdown()
    local = {p.name: p.read_bytes() for p in sorted((tmp_path / "local").iterdir()) if p.is_file()}
    remote = {p.name: p.read_bytes() for p in sorted((tmp_path / "ray").iterdir()) if p.is_file()}
    assert sum(name.startswith("model-") for name in local) >= 3 and remote == local


# ----- memory ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["lines", "ties", "dare_linear"])
@pytest.mark.parametrize("store,compute", [("F32", "F32"), ("BF16", "BF16"), ("BF16", "F32")])
def test_recipe_memory_covers_the_option_and_the_method(memory_inputs, method, store, compute):  # noqa: F811
    """The planner's estimate (the method's WorkingMemory) still covers the measured peak with LiNeS on: the
    scaling works in chunks over the method's output, so it adds no tensor-sized buffer."""
    from mergesmith.engine.execution.compute import compute as compute_recipe
    from mergesmith.engine.plan import InputRef, TensorRecipe
    from mergesmith.engine.planning.shared import recipe_memory
    from mergesmith.io.dtypes import dtype_size, to_torch

    spec = get_method(method)
    n = 4
    given = {"weight": 0.7, "density": 0.5}
    defaults = {p.name: p.default for p in spec.model_params}
    per_model = tuple(tuple((defaults | ({k: given[k] for k in defaults} if i else {})).items()) for i in range(n))
    option = {"alpha": 0.2, "beta": 0.6} if method == "lines" else {"lines_alpha": 0.2, "lines_beta": 0.6}
    recipe = TensorRecipe(
        "model.layers.1.mlp.up_proj.weight", (192, 320), compute, "merge",
        tuple(InputRef(f"m{i}-{store}", "w") for i in range(n)), method, 0, per_model,
        tuple(({p.name: p.default for p in spec.params} | option).items()), 7 if spec.randomized else None,
        depth=(1, 4),
    )
    peak = _peak_allocated(lambda: compute_recipe(recipe, memory_inputs, to_torch(compute), True, torch.device("cpu")))
    held = peak + n * 192 * 320 * dtype_size(compute)
    estimate = recipe_memory(recipe, compute)
    assert estimate >= held, f"{method} {store}->{compute}: estimate {estimate} < measured {held}"
