"""Mathematical properties of every merge method, on small random tensors (seconds in all).

Each test states a fact that follows from the method's definition (identities, endpoints, reductions of one
method to another, statistics of the random ones); bit-for-bit agreement with mergekit is checked separately
in test_mergekit_reference.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergesmith.config import parse_config
from mergesmith.errors import ConfigError
from mergesmith.methods import get_method, method_names
from mergesmith.methods.registry import MergeInputs
from mergesmith.methods.task_arithmetic import della_magprune, magnitude, magnitude_outliers, random_drop
from tests.helpers import one_torch_thread

SETTINGS = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def call(
    method: str,
    tensors: list[torch.Tensor],
    base_index: int | None = None,
    model_params: list[dict[str, Any]] | None = None,
    seed: int | None = 0,
    name: str = "model.layers.0.mlp.up_proj.weight",
    **params: Any,
) -> torch.Tensor:
    """Run a registered method as the executor would: defaults filled in, a seeded generator."""
    spec = get_method(method)
    assert spec is not None, method
    full_params = {p.name: p.default for p in spec.params} | params
    per_model = []
    for i in range(len(tensors)):
        given_params = (model_params or [{}] * len(tensors))[i]
        per_model.append({p.name: p.default for p in spec.model_params} | given_params)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return spec.merge(MergeInputs(tensors, base_index, per_model, full_params, generator, name))


def rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def finetunes(n: int, shape: tuple[int, ...] = (12, 10), seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    base = rand(shape, seed)
    return base, [base + rand(shape, seed + 1 + i, 0.05) for i in range(n)]


shapes = st.sampled_from([(7,), (5, 3), (16, 8), (3, 4, 2)])
seeds = st.integers(0, 2**16)

# ----- identities: N identical models give that model ------------------------------------------------------------

# method -> (number of models, base index or None, extra per-model params, global params)
IDENTICAL_CASES: dict[str, tuple[int, int | None, dict, dict]] = {
    "linear": (3, None, {"weight": 0.4}, {}),
    "slerp": (2, 0, {}, {"t": 0.35}),
    "nuslerp": (2, None, {"weight": 0.5}, {}),
    "multislerp": (3, None, {"weight": 0.3}, {}),
    "karcher": (3, None, {}, {}),
    "task_arithmetic": (3, 2, {"weight": 0.7}, {}),
    "ties": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "dare_linear": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "dare_ties": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "della": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "della_linear": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "breadcrumbs": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "breadcrumbs_ties": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "sce": (3, 2, {}, {"select_topk": 0.5}),
    "model_stock": (3, 0, {}, {}),
    "nearswap": (2, 0, {}, {"t": 0.01}),
    "arcee_fusion": (2, 0, {}, {}),
    "passthrough": (1, None, {}, {}),
    "ram": (3, 0, {}, {}),
    "ramplus_tl": (3, 0, {}, {}),
    "lines": (3, 2, {"weight": 0.7}, {"alpha": 0.4, "beta": 0.8}),
    "tsv": (3, 0, {"weight": 0.7}, {"alpha": 1.3}),
    "iso_c": (3, 0, {}, {"scaling_factor": 1.3}),
    "iso_cts": (3, 0, {}, {"scaling_factor": 1.3}),
    "regmean": (3, None, {}, {}),  # without Grams (norms, embeddings): the average (tests/test_regmean.py: the rest)
    "consensus_ta": (3, 2, {"weight": 0.7, "k": 2}, {}),
    "consensus_ties": (3, 2, {"weight": 0.7, "density": 0.5}, {}),
    "magmax": (3, 0, {}, {}),
    "pcb": (3, 0, {}, {}),
    "wudi": (3, 0, {}, {}),
}


def test_identity_cases_cover_every_method():
    assert set(IDENTICAL_CASES) == set(method_names())


@pytest.mark.parametrize("method", sorted(IDENTICAL_CASES))
@SETTINGS
@given(shape=shapes, seed=seeds)
def test_identical_models_give_that_model(method, shape, seed):
    n, base_index, model_params, params = IDENTICAL_CASES[method]
    x = rand(shape, seed)
    out = call(method, [x.clone() for _ in range(n)], base_index, [model_params] * n, **params)
    assert out.shape == x.shape and out.dtype == x.dtype
    # Interpolations compute (1 - t) x + t x or renormalise x, which may round in the last bit; the task-vector
    # family and the entry-wise methods see zero deltas and return the base exactly.
    torch.testing.assert_close(out, x, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    "method",
    [
        "task_arithmetic",
        "ties",
        "dare_linear",
        "dare_ties",
        "della",
        "breadcrumbs",
        "sce",
        "ram",
        "ramplus_tl",
        "nearswap",
        "arcee_fusion",
    ],
)
def test_zero_task_vectors_return_the_base_bit_for_bit(method):
    x = rand((9, 6), 3)
    n = 2 if method in ("nearswap", "arcee_fusion") else 3
    params = {"t": 0.1} if method == "nearswap" else {}
    plain = ("sce", "ram", "ramplus_tl", "nearswap", "arcee_fusion")
    mp = [{"weight": 0.5, "density": 0.6}] * n if method not in plain else None
    out = call(method, [x.clone() for _ in range(n)], 0, mp, **params)
    assert torch.equal(out, x)


# ----- task arithmetic ---------------------------------------------------------------------------------------------


@SETTINGS
@given(shape=shapes, seed=seeds, n=st.integers(1, 4), normalize=st.booleans())
def test_task_arithmetic_with_zero_weights_returns_base(shape, seed, n, normalize):
    base, models = finetunes(n, shape, seed)
    out = call("task_arithmetic", [*models, base], n, [{"weight": 0.0}] * (n + 1), normalize=normalize)
    assert torch.equal(out, base)


@SETTINGS
@given(seed=seeds, weights=st.lists(st.floats(-2, 2), min_size=1, max_size=4), lam=st.floats(0.1, 2))
def test_task_arithmetic_is_base_plus_weighted_sum(seed, weights, lam):
    base, models = finetunes(len(weights), (6, 5), seed)
    out = call("task_arithmetic", [base, *models], 0, [{}] + [{"weight": w} for w in weights], **{"lambda": lam})
    expected = base + lam * sum(w * (m - base) for w, m in zip(weights, models))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_task_arithmetic_normalize_divides_by_weight_sum():
    base, models = finetunes(2)
    out = call("task_arithmetic", [base, *models], 0, [{}, {"weight": 1.0}, {"weight": 3.0}], normalize=True)
    expected = base + (1.0 * (models[0] - base) + 3.0 * (models[1] - base)) / 4.0
    torch.testing.assert_close(out, expected)


def test_base_parameters_are_ignored_by_the_task_vector_family():
    base, models = finetunes(2)
    mp = [{"weight": 0.3}, {"weight": 0.5}]
    plain = call("ties", [*models, base], 2, mp + [{}], **{"lambda": 0.8})
    odd_base = call("ties", [*models, base], 2, mp + [{"weight": 100.0, "density": 0.01}], **{"lambda": 0.8})
    assert torch.equal(plain, odd_base)


@SETTINGS
@given(seed=seeds, weight=st.floats(-2, 2).filter(lambda w: abs(w) > 1e-3), normalize=st.booleans())
def test_ties_density_one_single_model_equals_task_arithmetic(seed, weight, normalize):
    base, (model,) = finetunes(1, (8, 7), seed)
    mp = [{}, {"weight": weight, "density": 1.0}]
    ties = call("ties", [base, model], 0, mp, normalize=normalize)
    ta = call("task_arithmetic", [base, model], 0, mp, normalize=normalize)
    assert torch.equal(ties, ta)


@pytest.mark.parametrize("method", ["dare_ties", "della", "breadcrumbs_ties"])
def test_consensus_variants_at_density_one_equal_ties(method):
    base, models = finetunes(3, seed=4)
    mp = [{}] + [{"weight": w, "density": 1.0} for w in (0.5, 0.3, 0.2)]
    flags = {"normalize": True, "rescale": False}
    assert torch.equal(call(method, [base, *models], 0, mp, **flags), call("ties", [base, *models], 0, mp, **flags))


def test_ties_sign_election_by_sum_and_by_count():
    base = torch.zeros(4)
    # per entry: deltas of three models; sum elects by mass, count by number of signs
    a = torch.tensor([1.0, -0.1, 0.0, 2.0])
    b = torch.tensor([-0.2, -0.1, 0.0, -3.0])
    c = torch.tensor([-0.2, 0.5, 0.0, -1.0])
    mp = [{}] + [{"weight": 1.0, "density": 1.0}] * 3
    by_sum = call("ties", [base, a, b, c], 0, mp)
    by_count = call("ties", [base, a, b, c], 0, mp, consensus_method="count")
    # entry 0: sum +0.6 -> keep a (1.0); count 1+ vs 2- -> keep b, c (mean -0.2)
    # entry 1: sum +0.3 -> keep c (0.5); count 1+ vs 2- -> keep a, b (-0.1)
    # entry 2: nothing to keep -> 0; entry 3: sum -2 -> mean(-3, -1) either way
    torch.testing.assert_close(by_sum, torch.tensor([1.0, 0.5, 0.0, -2.0]))
    torch.testing.assert_close(by_count, torch.tensor([-0.2, -0.1, 0.0, -2.0]))
    with pytest.raises(ValueError, match="consensus_method"):
        call("ties", [base, a, b, c], 0, mp, consensus_method="vote")


def test_int8_mask_changes_nothing():
    base, models = finetunes(3, seed=9)
    mp = [{}] + [{"weight": 0.4, "density": 0.6}] * 3
    for method in ("ties", "breadcrumbs_ties", "sce"):
        assert torch.equal(
            call(method, [base, *models], 0, mp, int8_mask=True), call(method, [base, *models], 0, mp, int8_mask=False)
        )


# ----- sparsification ---------------------------------------------------------------------------------------------


@SETTINGS
@given(seed=seeds, density=st.floats(0.01, 0.99))
def test_magnitude_keeps_the_k_largest(seed, density):
    d = rand((10, 10), seed)
    out = magnitude(d, density)
    k = max(1, int(density * d.numel()))
    kept = out != 0
    assert int(kept.sum()) == k
    assert d[kept].abs().min() >= d[~kept].abs().max() if k < d.numel() else True
    assert torch.equal(out[kept], d[kept])


def test_magnitude_rescale_keeps_l1_norm():
    d = rand((10, 10), 1)
    out = magnitude(d, 0.3, rescale=True)
    torch.testing.assert_close(out.abs().sum(), d.abs().sum())


@SETTINGS
@given(seed=seeds, density=st.floats(0.05, 0.95), gamma=st.floats(0.0, 0.3))
def test_breadcrumbs_drops_outliers_and_smallest(seed, density, gamma):
    d = rand((200,), seed)
    out = magnitude_outliers(d, density, gamma)
    n = d.numel()
    keep, top = int(density * n), int(gamma * n)
    kept = out != 0
    assert int(kept.sum()) == keep
    order = torch.sort(d.abs()).indices
    bottom = max(0, n - keep - top)
    assert set(order[bottom : bottom + keep].tolist()) == set(torch.nonzero(kept).flatten().tolist())


def test_random_drop_fraction_and_expectation():
    d = rand((64, 64), 5)
    g = torch.Generator().manual_seed(11)
    for density in (0.1, 0.5, 0.9):
        kept = (random_drop(d, density, g, rescale=False) != 0).float().mean().item()
        # 4096 Bernoulli draws: standard deviation sqrt(p(1-p)/n) <= 0.008
        assert abs(kept - density) < 0.04
    # With L1 rescaling the survivors are scaled by |d|_1 / |kept|_1 ~ 1 / density: unbiased on average.
    mean = torch.stack([random_drop(d, 0.3, g, rescale=True) for _ in range(400)]).mean(0)
    assert (mean - d).abs().mean() < 0.1 * d.abs().mean()


def test_della_probabilities_follow_magnitude_rank():
    # one row of 1000 distinct magnitudes; smallest kept with p = 0.3, largest with p = 0.7
    row = torch.linspace(0.001, 1.0, 1000)[torch.randperm(1000, generator=torch.Generator().manual_seed(0))]
    d = row.repeat(400, 1)
    g = torch.Generator().manual_seed(3)
    mask = della_magprune(d, 0.5, 0.2, g, rescale=False) != 0
    freq = mask.float().mean(0)
    order = torch.argsort(row)
    assert abs(freq.mean().item() - 0.5) < 0.01
    assert abs(freq[order[:100]].mean().item() - 0.32) < 0.03
    assert abs(freq[order[-100:]].mean().item() - 0.68) < 0.03
    with pytest.raises(ValueError, match="epsilon"):
        della_magprune(d, 0.9, 0.15, g)


def test_della_single_entry_rows_keep_with_density():
    d = torch.ones(4000, 1)
    kept = (della_magprune(d, 0.4, 0.1, torch.Generator().manual_seed(0), rescale=False) != 0).float().mean()
    assert abs(kept.item() - 0.4) < 0.04


RANDOM_METHODS = ["dare_linear", "dare_ties", "della", "della_linear"]


@pytest.mark.parametrize("method", RANDOM_METHODS)
def test_random_methods_are_seeded_only_by_the_generator(method):
    base, models = finetunes(3, (32, 16), seed=2)
    mp = [{}] + [{"weight": 0.5, "density": 0.5}] * 3
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    first = call(method, [base, *models], 0, mp, seed=42)
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG was used"
    torch.manual_seed(999)  # a different global state must not matter
    again = call(method, [base, *models], 0, mp, seed=42)
    assert first.numpy().tobytes() == again.numpy().tobytes()
    other = call(method, [base, *models], 0, mp, seed=43)
    assert not torch.equal(first, other)
    with pytest.raises(ValueError, match="generator"):
        call(method, [base, *models], 0, mp, seed=None)


# distinct models for every method: (number of models, base index, per-model params, global params)
DISTINCT_CASES: dict[str, tuple[int, int | None, dict, dict]] = {
    **IDENTICAL_CASES,
    "multislerp": (3, 0, {"weight": 0.3}, {}),
    "nuslerp": (3, 0, {"weight": 0.5}, {"nuslerp_flatten": True}),
}


LAPACK_METHODS = {"tsv", "iso_c", "iso_cts"}
"""Methods whose matrices go through LAPACK decompositions: every one of MKL's (svd, eigh, qr) rounds differently
with 1 and 2 threads (by ~1e-7 relative in float32), so their bytes are the same only for the same intra-op thread
count, library and device (tests/test_svd_methods.py checks that, and their accuracy against float64)."""


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(256, 200), (40000,)], ids=["matrix", "vector"])
@pytest.mark.parametrize("method", sorted(DISTINCT_CASES))
def test_same_bytes_for_any_thread_count(method, shape):
    """Whole-tensor sums and norms (L1 rescale, slerp angles, Karcher dots...) over more than 32768 entries are
    split among torch's threads; the methods reduce in fixed blocks so the bytes never depend on the count."""
    if method in LAPACK_METHODS and len(shape) == 2:
        pytest.skip("its SVDs are LAPACK's (MKL's gesdd), whose last bits depend on the thread count")
    n, base_index, model_params, params = DISTINCT_CASES[method]
    base, models = finetunes(n, shape, seed=8)
    tensors = [base, *models[1:]] if base_index == 0 else models
    mp = [dict(model_params, density=0.3) if "density" in model_params else model_params] * n

    def run():
        return call(method, tensors, base_index, mp, seed=7, **params).numpy().tobytes()

    results = {threads: _with_threads(threads, run) for threads in (1, 2, 3)}
    assert results[1] == results[2] == results[3]


def test_blocked_reductions():
    from mergesmith.kernels import reductions as r

    small = rand((1000,), 1)
    assert torch.equal(r.total(small), small.sum())
    assert torch.equal(r.l2(small), torch.linalg.vector_norm(small))
    assert torch.equal(r.dot(small, small.flip(0)), torch.dot(small, small.flip(0)))
    big = rand((3_000_017,), 2)
    exact = big.double()
    for threads in (1, 2, 4):
        torch.testing.assert_close(
            _with_threads(threads, lambda: r.total(big)).double(), exact.sum(), rtol=1e-5, atol=1e-2
        )
        torch.testing.assert_close(_with_threads(threads, lambda: r.l2(big)).double(), exact.norm(), rtol=1e-6, atol=0)
    rows = rand((3, 50000), 3)
    assert torch.equal(r.sum_along(rows, -1), rows.sum(-1))
    assert r.sum_along(rows[:1], -1, keepdim=True).shape == (1, 1)
    assert r.norm_along(rows[0], -1).shape == ()


def test_dare_linear_fraction_kept_and_rescaled_expectation():
    base, (model,) = finetunes(1, (48, 32), seed=6)
    delta = model - base
    mp = [{}, {"weight": 1.0, "density": 0.25}]
    outs = torch.stack([call("dare_linear", [base, model], 0, mp, seed=s) - base for s in range(300)])
    kept = (outs != 0).float().mean().item()
    assert abs(kept - 0.25) < 0.01
    assert (outs.mean(0) - delta).abs().mean() < 0.12 * delta.abs().mean()


def test_density_one_needs_no_generator():
    base, models = finetunes(2)
    mp = [{}] + [{"weight": 0.5, "density": 1.0}] * 2
    for method in RANDOM_METHODS:
        out = call(method, [base, *models], 0, mp, seed=None)
        assert out.shape == base.shape


# ----- slerp family -----------------------------------------------------------------------------------------------


@SETTINGS
@given(shape=shapes, seed=seeds)
def test_slerp_endpoints(shape, seed):
    base, (other,) = finetunes(1, shape, seed)
    far = rand(shape, seed + 7)  # a far-apart pair takes the spherical branch
    for b in (other, far):
        assert torch.equal(call("slerp", [base, b], 0, t=0.0), base)
        assert torch.equal(call("slerp", [base, b], 0, t=1.0), b)
        # the base may come second in the model list
        assert torch.equal(call("slerp", [b, base], 1, t=0.0), base)


def test_slerp_stays_on_the_arc():
    a = torch.tensor([3.0, 0.0])
    b = torch.tensor([0.0, 3.0])
    out = call("slerp", [a, b], 0, t=1 / 3)
    torch.testing.assert_close(out, 3 * torch.tensor([math.cos(math.pi / 6), math.sin(math.pi / 6)]))


def test_slerp_collinear_falls_back_to_linear():
    a = torch.tensor([1.0, 2.0, 3.0])
    out = call("slerp", [a, 2 * a], 0, t=0.25)
    torch.testing.assert_close(out, 0.75 * a + 0.25 * (2 * a))


def test_slerp_large_tensor_blocks_match_single_pass():
    # > 2**20 entries: reduced in blocks; agrees with a plain float64 slerp to float32 precision
    a = rand((1100, 1000), 1)
    b = rand((1100, 1000), 2)
    out = call("slerp", [a, b], 0, t=0.4)
    a64, b64 = a.double().flatten(), b.double().flatten()
    omega = torch.acos(torch.dot(a64, b64) / (a64.norm() * b64.norm()))
    ref = (torch.sin(0.6 * omega) * a64 + torch.sin(0.4 * omega) * b64) / torch.sin(omega)
    torch.testing.assert_close(out.double().flatten(), ref, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(seed=seeds, w1=st.floats(0.1, 3), w2=st.floats(0.1, 3), flatten=st.booleans(), row_wise=st.booleans())
def test_nuslerp_weights_set_t_and_endpoints(seed, w1, w2, flatten, row_wise):
    base, (x, y) = finetunes(2, (6, 5), seed)
    flags = {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
    only_x = call("nuslerp", [x, y], None, [{"weight": w1}, {"weight": 0.0}], **flags)
    torch.testing.assert_close(only_x, x, rtol=1e-5, atol=1e-6)
    only_y = call("nuslerp", [base, x, y], 0, [{}, {"weight": 0.0}, {"weight": w2}], **flags)
    torch.testing.assert_close(only_y, y, rtol=1e-5, atol=1e-6)


def test_nuslerp_equals_slerp_without_base_when_flattened():
    a, b = rand((5, 4), 1), rand((5, 4), 2)
    nu = call("nuslerp", [a, b], None, [{"weight": 0.7}, {"weight": 0.3}])
    torch.testing.assert_close(nu, call("slerp", [a, b], 0, t=0.3), rtol=1e-5, atol=1e-6)


def test_nuslerp_row_wise_interpolates_columns():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    rows = call("nuslerp", [a, b], None, [{"weight": 1.0}, {"weight": 1.0}], nuslerp_flatten=False)
    cols = call("nuslerp", [a.T, b.T], None, [{"weight": 1.0}] * 2, nuslerp_flatten=False, nuslerp_row_wise=True)
    torch.testing.assert_close(cols, rows.T)
    h = math.sqrt(0.5)
    torch.testing.assert_close(rows, torch.tensor([[h, h], [h, h]]))


def test_multislerp_two_models_matches_slerp_midpoint():
    a = torch.tensor([2.0, 0.0, 0.0])
    b = torch.tensor([0.0, 2.0, 0.0])
    out = call("multislerp", [a, b], None, [{"weight": 1.0}, {"weight": 1.0}])
    torch.testing.assert_close(out, torch.tensor([math.sqrt(2), math.sqrt(2), 0.0]), rtol=1e-5, atol=1e-5)


def test_multislerp_single_model_and_antipodes():
    a = torch.tensor([1.0, 2.0])
    assert torch.equal(call("multislerp", [a], None, [{"weight": 1.0}]), a)
    two = call("multislerp", [a, -a], None, [{"weight": 1.0}, {"weight": 1.0}])
    torch.testing.assert_close(two, torch.zeros(2))
    with pytest.raises(ValueError, match="weighted mean"):
        call("multislerp", [a, -a, a, -a], None, [{"weight": 1.0}] * 4, name="x.weight")


def test_karcher_two_vectors_is_geodesic_midpoint_with_mean_norm():
    a = torch.tensor([1.0, 0.0])
    b = torch.tensor([0.0, 3.0])
    out = call("karcher", [a, b], None, max_iter=50, tol=1e-9)
    torch.testing.assert_close(out, 2.0 * torch.tensor([math.sqrt(0.5), math.sqrt(0.5)]), rtol=1e-5, atol=1e-5)


def test_karcher_zero_inputs():
    z = torch.zeros(3)
    assert torch.equal(call("karcher", [z, z.clone()], None), z)
    a = torch.tensor([0.0, 4.0, 0.0])
    # a zero tensor has no direction: the mean direction is a's, the norm still averages
    torch.testing.assert_close(call("karcher", [a, z], None), a / 2)


# ----- model stock, sce, nearswap, arcee fusion ---------------------------------------------------------------------


def test_model_stock_interpolation_factor():
    base = torch.zeros(4)
    same = torch.tensor([1.0, 2.0, 0.0, 0.0])
    # parallel task vectors: cos = 1, t = N / N = 1 -> the average of the models
    torch.testing.assert_close(call("model_stock", [base, same, 2 * same], 0), 1.5 * same)
    # orthogonal task vectors: cos = 0, t = 0 -> the base
    ortho = torch.tensor([0.0, 0.0, 3.0, 1.0])
    torch.testing.assert_close(call("model_stock", [base, same, ortho], 0), base)
    # cos = 0.5 between two: t = 2 * 0.5 / 1.5 = 2/3
    u, v = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.5, math.sqrt(0.75), 0.0, 0.0])
    torch.testing.assert_close(call("model_stock", [base, u, v], 0), (2 / 3) * (u + v) / 2)


def test_model_stock_filter_wise_is_per_row():
    base = torch.zeros(2, 2)
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # row 0 parallel, row 1 orthogonal
    out = call("model_stock", [base, x, y], 0, filter_wise=True)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_sce_weights_by_energy_and_elects_signs():
    base = torch.zeros(3)
    a = torch.tensor([2.0, -1.0, 1.0])
    b = torch.tensor([1.0, 0.5, -1.0])
    out = call("sce", [base, a, b], 0)
    # energies mean(a^2) = 2, mean(b^2) = 0.75; signs elected by the sum of task vectors: +, -, + (a tie -> +)
    # entry 0: both positive -> (2 * 2 + 0.75 * 1) / 2.75; entries 1 and 2: only a survives -> a
    torch.testing.assert_close(out, torch.tensor([4.75 / 2.75, -1.0, 1.0]))


def test_sce_select_topk_keeps_high_variance_positions():
    base = torch.zeros(4)
    a = torch.tensor([1.0, 1.0, 5.0, 0.0])
    b = torch.tensor([1.0, -1.0, -5.0, 0.0])
    out = call("sce", [base, a, b], 0, select_topk=0.5)
    # nonzero variance at positions 1, 2 -> keep floor(2 * 0.5) = 1: position 2; the others are zeroed
    assert out[0] == 0 and out[1] == 0 and out[3] == 0 and out[2] != 0


def test_nearswap_swaps_near_entries_and_nudges_far_ones():
    a = torch.tensor([0.0, 0.0, 1.0])
    b = torch.tensor([0.05, -0.5, 1.0])
    out = call("nearswap", [a, b], 0, t=0.1)
    torch.testing.assert_close(out, torch.tensor([0.05, -0.1, 1.0]))


def test_arcee_fusion_takes_only_important_changes():
    base = rand((8, 16), 0)
    other = base + rand((8, 16), 1, 0.01)
    other[3, 5] += 4.0  # one big change: large |diff| and a large KL for its row
    out = call("arcee_fusion", [base, other], 0)
    taken = out != base
    assert taken[3, 5]
    assert torch.equal(out[taken], other[taken])  # entries are either taken whole or left as the base's
    # above the upper Tukey fence of the importances: a small minority of the entries
    assert 1 <= int(taken.sum()) < base.numel() // 4


def _summed_backwards(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """A row sum in another order (last entry first, one at a time): what a device's reduction may do."""
    acc = torch.zeros_like(x.select(dim, 0))
    for i in reversed(range(x.shape[dim])):
        acc = acc + x.select(dim, i)
    return acc.unsqueeze(dim) if keepdim else acc


def test_arcee_fusion_kl_does_not_depend_on_the_summation_order(monkeypatch):
    """The cause of the CUDA mismatch (issue 33: 2 of 60,000 entries differed from the CPU by a whole change):
    summed as p log(p / q), the KL of a fine-tune's row against its base cancels (terms of size |b - a|, a sum of
    size |b - a|^2), so its float32 digits follow the order of the sum and entries near the threshold flip.
    row_kl sums nonnegative terms in float64 and rounds once: another order gives the same bits, and so the same
    selection; the old formula, summed backwards, does not give the same bits (the check can fail)."""
    import torch.nn.functional as F

    from mergesmith.methods import arcee_fusion as af

    base = rand((200, 300), 11, 0.02)
    other = base + rand((200, 300), 12, 0.002)
    p, q = F.softmax(other, -1) + 1e-8, F.softmax(base, -1) + 1e-8
    old_terms = p * torch.log(p / q)
    assert not torch.equal(old_terms.sum(-1), _summed_backwards(old_terms))  # the old formula follows the order

    kl = af.row_kl(base, other)
    out = call("arcee_fusion", [base, other], 0)
    monkeypatch.setattr(af, "sum_along", _summed_backwards)
    assert torch.equal(af.row_kl(base, other), kl)
    assert torch.equal(call("arcee_fusion", [base, other], 0), out)

    # and it is the KL: against sum p log(p / q) of the same distributions in float64
    p64, q64 = F.softmax(other.double(), -1) + 1e-8, F.softmax(base.double(), -1) + 1e-8
    direct = (p64 * torch.log(p64 / q64)).sum(-1, keepdim=True)
    torch.testing.assert_close(kl.double(), direct, rtol=1e-6, atol=0.0)


def test_arcee_fusion_large_tensor_samples_with_the_generator():
    base, (other,) = finetunes(1, (1100, 1000), seed=3)
    one = call("arcee_fusion", [base, other], 0, seed=5)
    assert torch.equal(one, call("arcee_fusion", [base, other], 0, seed=5))
    with pytest.raises(ValueError, match="generator"):
        call("arcee_fusion", [base, other], 0, seed=None)


# ----- shapes, counts, specs ---------------------------------------------------------------------------------------

# linear is the lead's module (the planner rejects mismatched shapes before any method runs)
SHAPE_CASES = {m: c for m, c in IDENTICAL_CASES.items() if c[0] >= 2 and m != "linear"}


@pytest.mark.parametrize("method", sorted(SHAPE_CASES))
def test_shape_mismatch_names_the_tensor(method):
    n, base_index, model_params, params = SHAPE_CASES[method]
    tensors = [torch.ones(4, 3) for _ in range(n)]
    tensors[-1] = torch.ones(4, 2)
    with pytest.raises(ValueError, match="model.layers.7.self_attn.q_proj.weight"):
        call(method, tensors, base_index, [model_params] * n, name="model.layers.7.self_attn.q_proj.weight", **params)


# mergekit 0.1.5 contracts: (requires base, (min, max) inputs incl. base, (min, max) non-base)
CONTRACTS = {
    "slerp": (True, (2, 2), (None, None)),
    "nuslerp": (False, (2, 3), (2, 2)),
    "multislerp": (False, (1, None), (1, None)),
    "karcher": (False, (1, None), (None, None)),
    "model_stock": (True, (3, None), (None, None)),
    "nearswap": (True, (2, 2), (None, None)),
    "arcee_fusion": (True, (2, 2), (None, None)),
    "sce": (True, (1, None), (None, None)),
    "ram": (True, (1, None), (None, None)),
    "ramplus_tl": (True, (1, None), (None, None)),
    **{
        m: (True, (1, None), (None, None))
        for m in (
            "task_arithmetic",
            "ties",
            "dare_linear",
            "dare_ties",
            "della",
            "della_linear",
            "breadcrumbs",
            "breadcrumbs_ties",
        )
    },
}


@pytest.mark.parametrize("method", sorted(CONTRACTS))
def test_model_count_contracts(method):
    spec = get_method(method)
    requires_base, (lo, hi), (nb_lo, nb_hi) = CONTRACTS[method]
    assert spec.requires_base == requires_base
    assert (spec.min_models, spec.max_models) == (lo, hi)
    assert (spec.min_non_base, spec.max_non_base) == (nb_lo, nb_hi)
    assert spec.uses_base_in_models  # mergekit adds an unlisted base_model to every method's inputs
    if requires_base:
        assert "requires a base model" in spec.count_problem(3, has_base=False)
    if hi is not None:
        assert spec.count_problem(hi + 1, has_base=True) is not None
    assert spec.count_problem(max(lo, 1) - 1 if lo > 1 else 0, has_base=False) is not None or lo <= 1


def test_nuslerp_counts_models_besides_the_base():
    spec = get_method("nuslerp")
    assert spec.count_problem(2, has_base=False) is None
    assert spec.count_problem(3, has_base=True) is None
    assert "besides the base" in spec.count_problem(3, has_base=False)
    assert spec.count_problem(2, has_base=True) is not None


@pytest.mark.parametrize(
    ("method", "models", "base", "message"),
    [
        ("slerp", ["a", "b"], None, "requires a base model"),
        ("slerp", ["a", "b", "c"], "a", "at most 2"),
        ("ties", ["a", "b"], None, "requires a base model"),
        ("model_stock", ["a"], "b", "at least 3"),
        ("nearswap", ["a", "b"], "c", "at most 2"),
        ("arcee_fusion", ["a"], None, "requires a base model"),
    ],
)
def test_config_validation_rejects_bad_model_counts(method, models, base, message):
    data: dict[str, Any] = {"merge_method": method, "models": [{"model": m} for m in models]}
    if base:
        data["base_model"] = base
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


# defaults as mergekit 0.1.5 documents and implements them
DEFAULTS = {
    "slerp": ({"t": None}, {}),
    "nuslerp": ({"nuslerp_flatten": True, "nuslerp_row_wise": False}, {"weight": None}),
    "multislerp": ({"normalize_weights": True, "eps": 1e-8}, {"weight": None}),
    "karcher": ({"max_iter": 10, "tol": 1e-5}, {}),
    "task_arithmetic": ({"normalize": False, "rescale": False, "lambda": 1.0, "int8_mask": False}, {}),
    "ties": ({"normalize": True, "rescale": False, "consensus_method": "sum"}, {"density": 1.0}),
    "dare_linear": ({"normalize": False, "rescale": True}, {"density": 1.0}),
    "dare_ties": ({"normalize": False, "rescale": True, "consensus_method": "sum"}, {}),
    "della": ({"normalize": True, "rescale": True}, {"epsilon": 0.15}),
    "della_linear": ({"normalize": False, "rescale": True}, {"epsilon": 0.15}),
    "breadcrumbs": ({"normalize": False, "rescale": False}, {"gamma": 0.01}),
    "breadcrumbs_ties": ({"normalize": False, "rescale": False}, {"gamma": 0.01}),
    "sce": ({"select_topk": 1.0, "int8_mask": False}, {}),
    "model_stock": ({"filter_wise": False}, {}),
    "ram": ({"epsilon": 1e-5}, {}),
    "ramplus_tl": ({"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}, {}),
    "nearswap": ({"t": None}, {}),
}


@pytest.mark.parametrize("method", sorted(DEFAULTS))
def test_parameter_defaults(method):
    spec = get_method(method)
    params = {p.name: (None if p.required else p.default) for p in spec.params}
    model_params = {p.name: (None if p.required else p.default) for p in spec.model_params}
    expected_params, expected_model = DEFAULTS[method]
    for name, value in expected_params.items():
        assert params[name] == value, name
    for name, value in expected_model.items():
        assert model_params[name] == value, name
    for p in spec.model_params:
        if method not in ("linear", "passthrough"):
            assert p.non_base, f"{method}.{p.name} belongs to the non-base models"
    assert [p for p in spec.params if p.required] == [p for p in spec.params if p.name == "t"]


def test_ram_keeps_unique_changes_and_averages_shared_ones():
    base = torch.zeros(4)
    a = torch.tensor([1.0, 2.0, 0.0, 1e-7])
    b = torch.tensor([0.0, 4.0, -3.0, 0.0])
    # entry 0: only a changed -> 1; entry 1: both -> mean 3; entry 2: only b -> -3; entry 3: below epsilon -> 0
    torch.testing.assert_close(call("ram", [base, a, b], 0), torch.tensor([1.0, 3.0, -3.0, 0.0]))


def test_ramplus_boosts_unique_changes_by_overlap_ratio():
    base = torch.zeros(4)
    a = torch.tensor([1.0, 2.0, 5.0, 0.0])  # unique: entries 0, 2; shared: entry 1 -> rho_a = 1/2
    b = torch.tensor([0.0, 4.0, 0.0, -3.0])  # unique: entry 3; shared: entry 1 -> rho_b = 1
    out = call("ramplus_tl", [base, a, b], 0, r=0.5, alpha=0.8)
    boost_a, boost_b = 1 + 0.5 * 0.5, 1 + 0.5 * 0.8
    torch.testing.assert_close(out, torch.tensor([boost_a * 1.0, 3.0, boost_a * 5.0, boost_b * -3.0]))


@pytest.mark.parametrize("method", sorted(m for m in DISTINCT_CASES if get_method(m).elementwise))
def test_elementwise_methods_give_the_same_bytes_in_row_blocks(method):
    """`elementwise` lets the executor merge a huge tensor in row blocks: the blocks must concatenate to the whole."""
    n, base_index, model_params, params = DISTINCT_CASES[method]
    base, models = finetunes(n, (10, 6), seed=5)
    tensors = [base, *models[1:]] if base_index == 0 else models
    mp = [model_params] * n
    whole = call(method, tensors, base_index, mp, **params)
    blocks = [call(method, [t[a:b] for t in tensors], base_index, mp, **params) for a, b in ((0, 3), (3, 7), (7, 10))]
    assert torch.equal(torch.cat(blocks), whole)


def test_elementwise_flags():
    flagged = {m for m in method_names() if get_method(m).elementwise}
    assert flagged >= {"task_arithmetic", "nearswap", "ram"}
    assert not flagged & {"slerp", "ties", "dare_linear", "della", "breadcrumbs", "sce", "model_stock", "arcee_fusion"}


def test_switch_parameters_read_strings_as_yaml_does():
    base, models = finetunes(2, seed=1)
    mp = [{}] + [{"weight": 1.0}] * 2
    plain = call("task_arithmetic", [base, *models], 0, mp, normalize=False)
    assert torch.equal(call("task_arithmetic", [base, *models], 0, mp, normalize="false"), plain)
    assert not torch.equal(call("task_arithmetic", [base, *models], 0, mp, normalize="True"), plain)
    with pytest.raises(ValueError, match="normalize"):
        call("task_arithmetic", [base, *models], 0, mp, normalize="maybe")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", sorted(DISTINCT_CASES))
def test_methods_run_on_cuda(method):
    """Every method runs on the accelerator with the executor's CPU generator; results agree with the CPU's to float
    rounding (GPU reductions add in another order), random ones too since masks are drawn on the CPU."""
    n, base_index, model_params, params = DISTINCT_CASES[method]
    base, models = finetunes(n, (300, 200), seed=4)
    tensors = [base, *models[1:]] if base_index == 0 else models
    mp = [model_params] * n
    spec = get_method(method)

    def on(device: str, seed: int) -> torch.Tensor:
        full = {p.name: p.default for p in spec.params} | params
        per_model = [{p.name: p.default for p in spec.model_params} | m for m in mp]
        generator = torch.Generator().manual_seed(seed)  # always on the CPU, as the executor makes it
        moved = [t.to(device) for t in tensors]
        return spec.merge(MergeInputs(moved, base_index, per_model, full, generator, "x.weight"))

    gpu = on("cuda", 3)
    assert gpu.device.type == "cuda" and gpu.shape == base.shape
    assert torch.equal(gpu, on("cuda", 3))
    rtol, atol = DEVICE_TOLERANCE.get(method, (1e-4, 1e-5))
    torch.testing.assert_close(gpu.cpu(), on("cpu", 3), rtol=rtol, atol=atol)


DEVICE_TOLERANCE = {"iso_cts": (1e-4, 2e-4), "tsv": (1e-4, 2e-4)}
"""The methods whose CPU and GPU results differ by more than float rounding of one reduction: their SVDs (LAPACK on
the CPU, cuSOLVER on the GPU) return singular vectors that differ in the last digits, which the projections
spread. Measured on an H200 (torch 2.11, bench/gpu_check.sh, issue 33): largest differences 3.8e-5 (iso_cts) and
5.5e-5 (tsv) on entries of ~1."""


@pytest.mark.parametrize("consensus", [None, "sum", "count"])
def test_task_vector_mix_in_chunks_is_bit_equal_to_one_pass(monkeypatch, consensus):
    """Large tensors are mixed in chunks to cap the temporaries; the mix is elementwise across models, so
    every entry must come out with the same bits as from one pass."""
    from mergesmith.kernels import task_vector_mix as task_arithmetic

    generator = torch.Generator().manual_seed(5)
    base = torch.randn(37, 53, generator=generator).bfloat16()
    deltas = (torch.randn(3, 37, 53, generator=generator) * 0.1).bfloat16()
    deltas[0, :5] = 0  # zeros never vote
    options = dict(consensus=consensus, normalize=consensus is not None, lam=0.7)
    whole = task_arithmetic.merge_task_vectors(base, deltas, [0.5, 1.0, -0.3], **options)
    monkeypatch.setattr(task_arithmetic, "MIX_CHUNK", 100)
    chunked = task_arithmetic.merge_task_vectors(base, deltas, [0.5, 1.0, -0.3], **options)
    assert chunked.shape == whole.shape and chunked.dtype == whole.dtype
    assert torch.equal(chunked.view(torch.int16), whole.view(torch.int16))
