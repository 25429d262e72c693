"""tsv (TSV-M), iso_c and iso_cts against the papers' equations, coded here again in numpy float64.

The references below do not call the methods' helpers: they follow the papers (Gargiulo et al. 2025, TSV-Merge;
Marczak et al. 2025, Iso-C and Iso-CTS) and the reference codes' choices the module docstrings name, and whiten
by B (B^T B)^(-1/2) from an eigendecomposition, where the methods take P Q^T from an SVD (the same matrix, by
another road). Task matrices are built with decaying spectra (singular values 0.02 * 0.95^j: 5% apart, a
condition number near 25), so that truncating an SVD picks a well-separated subspace and float32 against float64
is a matter of rounding, not of which direction wins a near tie.

The inputs are float32 values (the references take the same values in float64). Tolerances: |out - ref| <=
rel * max|ref - base| + two roundings of the output's largest entry, rel = 2e-5 for float32 computation (observed:
every error within the two roundings) and 1e-9 for float64; bf16 inputs, one bf16 rounding step of the output.
test_the_methods_differ_from_task_arithmetic_and_each_other shows the comparisons can fail: the three methods'
outputs differ by over 1e-3 of the change.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from mergesmith.engine import time_estimate
from mergesmith.engine.plan import InputRef, TensorRecipe
from mergesmith.methods import get_method
from mergesmith.methods.isotropic import common_size
from mergesmith.methods.registry import MergeInputs
from tests.helpers import (
    assert_one_line_error,
    finite_logits,
    load_causal_lm,
    one_torch_thread,
    read_state_dict,
    run_cli,
)

METHODS = ("tsv", "iso_c", "iso_cts")
SCALE = {"tsv": "alpha", "iso_c": "scaling_factor", "iso_cts": "scaling_factor"}


_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


# ----- the float64 references ----------------------------------------------------------------------------------


def _svd(a: np.ndarray, drop: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD; with `drop`, without numerically zero singular values (the methods' documented rule)."""
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    if drop:
        n = int((s > 1e-9 * max(s.max(initial=0.0), 1e-300)).sum()) if s.size else 0
        u, s, vt = u[:, :n], s[:n], vt[:n]
    return u, s, vt


def _whiten(b: np.ndarray) -> np.ndarray:
    """The orthonormal-column matrix nearest to b: b (b^T b)^(-1/2), by an eigendecomposition."""
    vals, vecs = np.linalg.eigh(b.T @ b)
    return b @ (vecs * vals**-0.5) @ vecs.T


def _deltas(base: np.ndarray, xs: list[np.ndarray], weights: list[float]) -> list[np.ndarray]:
    return [w * (x - base) for x, w in zip(xs, weights)]


def ref_tsv(base, xs, weights, alpha, k=None):
    """TSV-M (Gargiulo et al. 2025, section 5): top floor(r / T) triplets per task, concatenated, whitened."""
    deltas = _deltas(base, xs, weights)
    if base.ndim != 2 or min(base.shape) // len(xs) == 0:
        return base + alpha * sum(deltas) / len(xs)
    k = min(base.shape) // len(xs) if k is None else k
    us, ss, vs = [], [], []
    for d in deltas:
        u, s, vt = _svd(d, drop=True)
        us.append(u[:, :k])
        ss.append(s[:k])
        vs.append(vt[:k].T)
    if not sum(len(s) for s in ss):
        return base.copy()
    u_perp, v_perp = _whiten(np.concatenate(us, 1)), _whiten(np.concatenate(vs, 1))
    return base + alpha * u_perp @ np.diag(np.concatenate(ss)) @ v_perp.T


def ref_iso_c(base, xs, weights, alpha):
    """Iso-C (Marczak et al. 2025, eq. for Delta_Iso-C): the summed task matrix, every singular value their mean."""
    total = sum(_deltas(base, xs, weights))
    if base.ndim != 2:
        return base + alpha * total / len(xs)
    u, s, vt = _svd(total, drop=True)
    if not s.size:
        return base.copy()
    return base + alpha * s.mean() * u @ vt


def ref_iso_cts(base, xs, weights, alpha, fraction=0.8):
    """Iso-CTS: top c directions of the sum, each task's top k outside them; orthonormalised; flat spectrum."""
    deltas = _deltas(base, xs, weights)
    if base.ndim != 2:
        return base + alpha * sum(deltas) / len(xs)
    r, t = min(base.shape), len(xs)
    k = round((r - math.floor(r * fraction)) / t)
    if k * t > r:
        k -= 1
    c = r - k * t
    u, s, vt = _svd(sum(deltas), drop=True)
    u_c, s_c, v_c = u[:, :c], s[:c], vt[:c].T
    us, ss, vs = [], [], []
    for d in deltas:
        residual = d - u_c @ (u_c.T @ d)
        ut, st, vtt = np.linalg.svd(residual, full_matrices=False)
        n = int((st[:k] > 1e-9 * max(np.linalg.norm(d), 1e-300)).sum())
        us.append(ut[:, :n])
        ss.append(st[:n])
        vs.append(vtt[:n].T)
    us.append(u_c)
    ss.append(s_c)
    vs.append(v_c)
    values = np.concatenate(ss)
    if not values.size:
        return base.copy()
    return base + alpha * values.mean() * _whiten(np.concatenate(us, 1)) @ _whiten(np.concatenate(vs, 1)).T


REFERENCES = {"tsv": ref_tsv, "iso_c": ref_iso_c, "iso_cts": ref_iso_cts}


# ----- inputs ----------------------------------------------------------------------------------------------------


def _orthonormal(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return q


def task_matrix(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A fine-tune-like change: decaying, well-separated singular values (0.02 * 0.95^j) on random directions."""
    if len(shape) != 2:
        return 0.02 * rng.standard_normal(shape)
    m, n = shape
    r = min(m, n)
    s = 0.02 * 0.95 ** np.arange(r) * np.exp(0.01 * rng.standard_normal(r))
    s = np.sort(s)[::-1]
    return _orthonormal(rng, m, r) @ np.diag(s) @ _orthonormal(rng, n, r).T


def models(shape, tasks, seed) -> tuple[np.ndarray, list[np.ndarray]]:
    """A base and `tasks` fine-tunes, as float32 values (what the methods see in float32; the references take the
    same values in float64)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
    return base, [(base + task_matrix(rng, shape)).astype(np.float32).astype(np.float64) for _ in range(tasks)]


def merge(method: str, base, xs, weights=None, dtype=torch.float32, **params: Any) -> torch.Tensor:
    """The registered method on torch tensors of `dtype` (base first), defaults filled in as the planner does."""
    spec = get_method(method)
    assert spec is not None
    tensors = [torch.from_numpy(np.asarray(a)).to(dtype) for a in (base, *xs)]
    per_model = [{}] + [{"weight": w} for w in (weights or [1.0] * len(xs))]
    full = {p.name: p.default for p in spec.params} | params
    return spec.merge(MergeInputs(tensors, 0, per_model, full, tensor_name="model.layers.0.mlp.up_proj.weight"))


def assert_matches(out: torch.Tensor, ref: np.ndarray, base: np.ndarray, rel: float = 2e-5) -> None:
    """|out - ref| <= rel * (the largest change from the base) + two roundings of the output's largest entry."""
    change = float(np.abs(ref - base).max(initial=0.0))
    rounding = 2 * torch.finfo(out.dtype).eps * float(np.abs(ref).max(initial=0.0))
    err = float(np.abs(out.double().numpy() - ref).max(initial=0.0))
    assert err <= rel * change + rounding, f"max error {err:.3g} against a change of {change:.3g}"


# ----- against the references ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(96, 64), (64, 96), (64,)])
@pytest.mark.parametrize("tasks", [3, 4])
def test_float32_equals_the_float64_reference(method, shape, tasks):
    base, xs = models(shape, tasks, seed=tasks * 7 + len(shape))
    weights = [1.0, 0.5, 1.3, 0.8][:tasks]
    out = merge(method, base, xs, weights, **{SCALE[method]: 1.4})
    assert out.dtype == torch.float32 and out.shape == base.shape
    assert_matches(out, REFERENCES[method](base, xs, weights, 1.4), base)


@pytest.mark.parametrize("method", METHODS)
def test_float64_stays_float64_and_equals_the_reference_closely(method):
    base, xs = models((96, 64), 3, seed=5)
    out = merge(method, base, xs, dtype=torch.float64)
    assert out.dtype == torch.float64
    assert_matches(out, REFERENCES[method](base, xs, [1.0] * 3, 1.0), base, rel=1e-9)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(64, 96), (48,)])
def test_bf16_inputs_give_bf16_within_one_rounding_of_the_reference(method, shape):
    base, xs = models(shape, 3, seed=9)
    as_bf16 = [torch.from_numpy(a).to(torch.bfloat16).double().numpy() for a in (base, *xs)]
    out = merge(method, as_bf16[0], as_bf16[1:], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = torch.from_numpy(REFERENCES[method](as_bf16[0], as_bf16[1:], [1.0] * 3, 1.0))
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-5)


def test_iso_cts_with_other_common_fractions():
    base, xs = models((64, 96), 3, seed=13)
    for fraction in (0.0, 0.5, 1.0):
        out = merge("iso_cts", base, xs, common_space_fraction=fraction)
        assert_matches(out, ref_iso_cts(base, xs, [1.0] * 3, 1.0, fraction), base)
    # the whole common space is Iso-C
    torch.testing.assert_close(merge("iso_cts", base, xs, common_space_fraction=1.0), merge("iso_c", base, xs))


def test_the_methods_differ_from_task_arithmetic_and_each_other():
    """A check that the comparisons above can fail: the three results are far apart at this tolerance."""
    base, xs = models((96, 64), 3, seed=21)
    outs = {m: merge(m, base, xs).double().numpy() for m in METHODS}
    ta = base + sum(x - base for x in xs)
    scale = np.abs(ta - base).max()
    for a in METHODS:
        assert np.abs(outs[a] - ta).max() > 1e-2 * scale
        for b in METHODS:
            if a < b:
                assert np.abs(outs[a] - outs[b]).max() > 1e-3 * scale


# ----- edge cases ------------------------------------------------------------------------------------------------


def test_tsv_on_a_matrix_of_rank_smaller_than_the_task_count_takes_the_mean():
    base, xs = models((2, 48), 4, seed=3)
    out = merge("tsv", base, xs, alpha=0.7)
    assert_matches(out, base + 0.7 * sum(x - base for x in xs) / 4, base)
    # Iso-CTS has no room for task blocks there (c = r): it is Iso-C
    torch.testing.assert_close(merge("iso_cts", base, xs), merge("iso_c", base, xs))
    assert_matches(merge("iso_c", base, xs), ref_iso_c(base, xs, [1.0] * 4, 1.0), base)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(24, 16), (16,)])
def test_zero_task_vectors_return_the_base_bit_for_bit(method, shape):
    base, _ = models(shape, 1, seed=1)
    out = merge(method, base, [base.copy() for _ in range(3)])
    assert torch.equal(out, torch.from_numpy(base).float())


@pytest.mark.parametrize("method", METHODS)
def test_a_zero_task_vector_among_others_adds_no_direction(method):
    """Its SVD's singular vectors are arbitrary (LAPACK's choice); they are left out, not whitened with the rest."""
    base, xs = models((96, 64), 2, seed=17)
    with_zero = [xs[0], base.copy(), xs[1]]
    out = merge(method, base, with_zero)
    if method == "tsv":  # the two tasks' triplets at T = 3's share of the rank
        ref = ref_tsv(base, [xs[0], xs[1]], [1.0, 1.0], 1.0, k=64 // 3)
    else:
        ref = REFERENCES[method](base, with_zero, [1.0] * 3, 1.0)
    assert_matches(out, ref, base)


@pytest.mark.parametrize("method", METHODS)
def test_low_rank_task_vectors_use_only_their_real_directions(method):
    """Fine-tunes that changed only a few rows (e.g. new tokens' embeddings): task matrices of rank 5 < k = 21,
    exactly (the other rows' differences are exact zeros). Only their numerically nonzero triplets count; the
    reference code would whiten (tsv, iso_cts) or flatten (iso_c) LAPACK's arbitrary basis of the rest too."""
    rng = np.random.default_rng(23)
    base, _ = models((96, 64), 1, seed=23)
    xs = []
    for t in range(3):
        x = base.copy()
        x[5 * t : 5 * t + 5] += 0.02 * rng.standard_normal((5, 64))
        xs.append(x.astype(np.float32).astype(np.float64))
    assert_matches(merge(method, base, xs), REFERENCES[method](base, xs, [1.0] * 3, 1.0), base)


def test_a_single_task_vector():
    base, xs = models((64, 96), 1, seed=4)
    d = xs[0] - base
    # TSV keeps all of its one task's triplets: the task vector itself, scaled
    assert_matches(merge("tsv", base, xs, alpha=0.6), base + 0.6 * d, base)
    # Iso-C flattens its spectrum; Iso-CTS fills the rest of the rank with the same task's directions: the same
    u, s, vt = np.linalg.svd(d, full_matrices=False)
    flat = base + s.mean() * u @ vt
    assert_matches(merge("iso_c", base, xs), flat, base)
    assert_matches(merge("iso_cts", base, xs), flat, base)


@pytest.mark.parametrize("method", METHODS)
def test_only_the_base_gives_the_base(method):
    base, _ = models((8, 6), 1, seed=2)
    spec = get_method(method)
    t = torch.from_numpy(base).float()
    assert torch.equal(spec.merge(MergeInputs([t], 0, [{}], {p.name: p.default for p in spec.params})), t)


@pytest.mark.parametrize("method", METHODS)
def test_other_tensors_take_the_mean_of_the_task_vectors(method):
    base, xs = models((4, 6, 5), 3, seed=8)
    out = merge(method, base, xs, [1.0, 2.0, 0.5], **{SCALE[method]: 0.9})
    assert_matches(out, base + 0.9 * (xs[0] - base + 2 * (xs[1] - base) + 0.5 * (xs[2] - base)) / 3, base)


def test_common_size_follows_the_reference_rounding_and_stays_inside_the_rank():
    assert common_size(64, 3, 0.8) == (52, 4)  # c0 = 51, round(13 / 3) = 4: three blocks of 4
    assert common_size(7, 2, 0.0) == (1, 3)  # round(3.5) = 4 would need 8 > 7 columns: one block fewer
    assert common_size(5, 2, 0.8) == (5, 0)  # round(0.5) = 0, Python's halves to even
    assert common_size(2, 4, 0.8) == (2, 0)


def test_common_space_fraction_outside_zero_one_is_a_plan_time_error(tmp_path, tiny_models, capsys):
    config = _config(tmp_path, tiny_models, "iso_cts", {"common_space_fraction": 1.5})
    code, _, err = run_cli(capsys, "plan", config)
    assert_one_line_error(code, err, "common_space_fraction")
    assert "[0.0, 1.0]" in err


# ----- working memory --------------------------------------------------------------------------------------------


def _peak_allocated(fn, tmp_path) -> int:
    """Peak bytes torch's CPU allocator holds while `fn` runs, above what it held before: the profiler's memory
    events carry the allocator's running total (as tests/test_planner_checks2.py measures the other methods)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    assert events, "the profiler recorded no allocations"
    events.sort(key=lambda e: float(e["ts"]))
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "shape,tasks", [((96, 64), 3), ((64, 96), 4), ((192, 320), 3), ((320, 192), 2), ((256, 256), 8)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_working_memory_covers_the_measured_peak(method, shape, tasks, dtype, tmp_path):
    """The allocations of one call (task vectors, SVDs, LAPACK's work arrays as torch allocates them, the
    concatenations), plus the inputs at the compute width, stay within the spec's WorkingMemory."""
    base, xs = models(shape, tasks, seed=31)
    tensors = [torch.from_numpy(a).to(dtype) for a in (base, *xs)]
    spec = get_method(method)
    params = {p.name: p.default for p in spec.params}
    inputs = MergeInputs(tensors, 0, [{}] + [{"weight": 1.0}] * tasks, params)
    spec.merge(inputs)  # warm
    numel, width = math.prod(shape), torch.finfo(dtype).bits // 8
    peak = _peak_allocated(lambda: spec.merge(inputs), tmp_path)
    assert peak > numel * 4  # at least one task matrix in the work dtype: the measure sees the allocations
    held = peak + (tasks + 1) * numel * width
    estimate = spec.working_memory(tasks + 1, numel, width)
    assert held <= estimate, f"{method} {shape} {dtype}: measured {held} > estimate {estimate}"


# ----- end to end: slices and a gradient; plan's time ------------------------------------------------------------


def _config(tmp_path, tiny_models, method, parameters, slices=False, out_dtype="float32"):
    base = tiny_models("qwen2", seed=11)
    others = [tiny_models.derive(base, seed=s, scale=0.02) for s in (1, 2, 3)]
    config: dict[str, Any] = {
        "merge_method": method,
        "base_model": str(base),
        "dtype": "float32",
        "out_dtype": out_dtype,
        "parameters": parameters,
    }
    if slices:
        config["slices"] = [{"sources": [{"model": str(m), "layer_range": [0, 2]} for m in (base, *others)]}]
    else:
        config["models"] = [{"model": str(m)} for m in others]
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("method", METHODS)
def test_slices_with_a_gradient_scale_merge_each_layer_at_its_value(tmp_path, tiny_models, method):
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    config = _config(tmp_path, tiny_models, method, {SCALE[method]: [0.5, 1.5]}, slices=True)
    run_merge(config, tmp_path / "out", MergeOptions(threads=2))
    finite_logits(load_causal_lm(tmp_path / "out"))
    merged = read_state_dict(tmp_path / "out")
    spec = yaml.safe_load(config.read_text())
    sources = [read_state_dict(s["model"]) for s in spec["slices"][0]["sources"]]
    for layer, scale in ((0, 0.5), (1, 1.5)):
        for part in ("mlp.up_proj.weight", "input_layernorm.weight"):
            name = f"model.layers.{layer}.{part}"
            arrays = [s[name].double().numpy() for s in sources]
            ref = REFERENCES[method](arrays[0], arrays[1:], [1.0] * 3, scale)
            assert_matches(merged[name], ref, arrays[0])


def _plan(tmp_path, tiny_models, capsys, method: str, hidden: int) -> dict[str, float]:
    """`plan --json`'s time estimate parts for `method` over three fine-tunes of a llama of width `hidden`."""
    base = tiny_models("llama", seed=1, hidden_size=hidden, intermediate_size=2 * hidden)
    others = [tiny_models.derive(base, seed=s, scale=0.02) for s in (2, 3, 4)]
    params = {"weight": 1.0} if method == "task_arithmetic" else {}
    config = {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": str(m), "parameters": params} for m in others],
    }
    path = tmp_path / f"{method}-{hidden}.yml"
    path.write_text(yaml.safe_dump(config))
    code, text, _ = run_cli(capsys, "plan", path, "--json", "--threads", "2")
    assert code == 0
    report = json.loads(text)
    return {"total": report["estimated_seconds"], **report["estimated_seconds_parts"]}


def test_plan_prices_the_svds_above_task_arithmetic_and_by_the_matrix_sizes(tmp_path, tiny_models, capsys):
    small = {m: _plan(tmp_path, tiny_models, capsys, m, 64) for m in ("task_arithmetic", *METHODS)}
    large = {m: _plan(tmp_path, tiny_models, capsys, m, 128) for m in ("task_arithmetic", *METHODS)}
    ta_small, ta_large = small["task_arithmetic"]["compute"], large["task_arithmetic"]["compute"]
    for method in METHODS:
        assert small[method]["compute"] > ta_small and large[method]["total"] > large["task_arithmetic"]["total"]
        # beyond the elementwise part task arithmetic has too: the SVDs, 8x for twice the width on the layers'
        # matrices (m n min(m, n)), 4x on the 256-row embedding, whose min(m, n) is the width
        ratio = (large[method]["compute"] - ta_large) / (small[method]["compute"] - ta_small)
        assert 6 < ratio < 8.01, ratio
    assert small["iso_cts"]["compute"] > small["tsv"]["compute"] > small["iso_c"]["compute"]


def _recipe(method: str, shape: tuple[int, ...], tasks: int) -> TensorRecipe:
    inputs = tuple(InputRef(f"m{i}", "w") for i in range(tasks + 1))
    return TensorRecipe("w", shape, "F32", "merge", inputs, method, 0)


@pytest.mark.parametrize("method", METHODS)
def test_svd_time_scales_as_m_n_min_m_n(method):
    small, large = (
        time_estimate.svd_seconds(_recipe(method, (64, 48), 3)),
        time_estimate.svd_seconds(_recipe(method, (128, 96), 3)),
    )
    assert small > 0 and large == pytest.approx(8 * small, rel=0.05)
    wide = time_estimate.svd_seconds(_recipe(method, (64, 4096), 3))  # min(m, n) = 64: linear in the long side
    assert wide == pytest.approx(time_estimate.svd_seconds(_recipe(method, (64, 2048), 3)) * 2, rel=0.05)
    assert time_estimate.svd_seconds(_recipe(method, (4096,), 3)) == 0
    assert time_estimate.svd_seconds(_recipe("task_arithmetic", (128, 96), 3)) == 0
    if method != "iso_c":  # TSV's and Iso-CTS's SVDs grow with the task count
        more = time_estimate.svd_seconds(_recipe(method, (128, 96), 6))
        assert more > large


@pytest.mark.parametrize("method", METHODS)
def test_same_bytes_again_with_the_same_threads_and_close_with_others(method):
    """LAPACK (MKL) rounds differently with another thread count, so bytes are reproducible for the same count
    only; across counts the outputs differ by float32 rounding of the change, never more."""
    base, xs = models((256, 200), 3, seed=12)

    def run(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return merge(method, base, xs)
        finally:
            torch.set_num_threads(before)

    first = run(2)
    assert torch.equal(first, run(2))
    one = run(1)
    change = float((first.double() - torch.from_numpy(base)).abs().max())
    rounding = 2 * torch.finfo(torch.float32).eps * float(first.abs().max())
    assert float((one - first).abs().max()) <= 2e-5 * change + rounding


# ----- when LAPACK's SVD fails to converge ------------------------------------------------------------------------


def _failing_svd(monkeypatch, fail_dtypes: set[torch.dtype]) -> list[torch.dtype]:
    """Make torch.linalg.svd raise LAPACK's no-convergence error for inputs of `fail_dtypes` (as gesdd did on a
    1 B iso_cts merge); returns the dtypes it was called with."""
    real = torch.linalg.svd
    calls: list[torch.dtype] = []

    def svd(a, *args, **kwargs):
        calls.append(a.dtype)
        if a.dtype in fail_dtypes:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge (error code: 1)")
        return real(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", svd)
    return calls


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fail", ["float32", "float32 and float64"])
def test_a_failed_svd_is_retried_and_still_equals_the_reference(method, fail, monkeypatch):
    """A non-converging float32 SVD is redone in float64; if that fails too, from the eigendecomposition of the
    Gram matrix: the merge still equals the float64 reference, tall and wide."""
    failing = {torch.float32} if fail == "float32" else {torch.float32, torch.float64}
    calls = _failing_svd(monkeypatch, failing)
    for shape in [(96, 64), (64, 96)]:
        base, xs = models(shape, 3, seed=5)
        out = merge(method, base, xs, [1.0, 0.5, 1.3], **{SCALE[method]: 1.4})
        assert out.dtype == torch.float32
        assert_matches(out, REFERENCES[method](base, xs, [1.0, 0.5, 1.3], 1.4), base, rel=1e-4)
    assert torch.float64 in calls  # the fallback ran


def test_the_eigh_svd_drops_the_zero_directions_of_a_rank_deficient_matrix(monkeypatch):
    """The last resort on a matrix with a block of exact zero singular values (a projection's, the case gesdd
    fails on): the kept triplets reconstruct it, the rest are zero."""
    from mergesmith.methods.task_singular import thin_svd

    _failing_svd(monkeypatch, {torch.float32, torch.float64})
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.standard_normal((80, 10)) @ rng.standard_normal((10, 60))).float()
    u, s, vh = thin_svd(a)
    assert u.shape == (80, 60) and s.shape == (60,) and vh.shape == (60, 60)
    assert int((s > 0).sum()) == 10
    assert torch.allclose((u * s) @ vh, a, atol=1e-4 * float(a.abs().max()))
    assert torch.allclose(u[:, :10].T @ u[:, :10], torch.eye(10), atol=1e-5)
