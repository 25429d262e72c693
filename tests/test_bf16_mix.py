"""bf16_mix's compiled loop gives task_vector_mix._mix's torch bytes (mergekit's stepwise bfloat16 rounding).

TIES stays bit-equal to mergekit only if every operation of the mix rounds where torch rounds; the loop must
agree with the torch operations on every consensus, with and without normalize and lambda, for 1-4 task
vectors, weights negative, tiny or summing to zero, task vectors with exact zeros, and strided chunks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mergesmith.kernels import bf16_mix
from mergesmith.kernels import task_vector_mix as task_arithmetic

pytestmark = pytest.mark.skipif(not bf16_mix.AVAILABLE, reason="numba is not installed")


def _inputs(count, n, seed):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.02).bfloat16()
    deltas = (torch.randn(count, n, generator=g) * 0.003).bfloat16()
    deltas[torch.rand(count, n, generator=g) < 0.4] = 0  # sparsified entries
    return base, deltas


def _both(monkeypatch, base, deltas, weights, **options):
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(task_arithmetic, "COMPILED_MIX", compiled)
        results.append(task_arithmetic._mix(base, deltas, weights, int8_mask=False, **options))
    return results


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("consensus", [None, "sum", "count"])
def test_compiled_mix_gives_the_torch_bytes(monkeypatch, count, consensus):
    base, deltas = _inputs(count, 20_000, count)
    weight_sets = [[0.5] * count, [0.3, -0.7, 1.3, 0.01][:count], [1e-9] * count, [1.0, -1.0, 0.5, -0.5][:count]]
    for weights, normalize, lam in itertools.product(weight_sets, (False, True), (1.0, 0.37)):
        compiled, plain = _both(monkeypatch, base, deltas, weights, consensus=consensus, normalize=normalize, lam=lam)
        assert compiled.dtype == torch.bfloat16
        assert torch.equal(compiled.view(torch.int16), plain.view(torch.int16)), (weights, normalize, lam)


def test_strided_chunks_of_a_large_mix(monkeypatch):
    """merge_task_vectors cuts large tensors into column slices of the stacked deltas (not contiguous)."""
    monkeypatch.setattr(task_arithmetic, "MIX_CHUNK", 4096)
    base, deltas = _inputs(2, 10_000, 9)
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(task_arithmetic, "COMPILED_MIX", compiled)
        results.append(task_arithmetic.merge_task_vectors(base, deltas, [0.5, 0.5], consensus="sum", normalize=True))
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


@pytest.mark.parametrize("consensus", [None, "sum", "count"])
def test_infinities_nans_and_negative_zeros_round_as_torch_does(monkeypatch, consensus):
    """The loop's rounding and sign have no branches (so they vectorise): nan must stay nan, inf * 0 must give
    nan where the consensus drops an infinite entry, and -0 must not vote; in the vector loop's lanes, at the ends
    of its vectors and in the scalar tail after the last whole vector."""
    n = 3 * 1024 + 7
    base, deltas = _inputs(3, n, 11)
    for at in (5, 15, 16, 63, 1024, n - 4):
        deltas[0, at], deltas[1, at + 1], deltas[2, at + 2] = float("inf"), float("nan"), -0.0
        deltas[1, at + 3], deltas[2, at + 3] = -float("inf"), float("inf")
    base[9] = float("nan")
    for normalize, lam in itertools.product((False, True), (1.0, 0.37)):
        compiled, plain = _both(monkeypatch, base, deltas, [0.3, -0.7, 1.3], consensus=consensus,
                                normalize=normalize, lam=lam)
        assert torch.equal(compiled.isnan(), plain.isnan()), (normalize, lam)
        assert compiled.isinf().any() or not plain.isinf().any()
        numbers = ~plain.isnan()
        assert torch.equal(compiled[numbers].view(torch.int16), plain[numbers].view(torch.int16)), (normalize, lam)


def _special_values(n, seed):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, generator=g) * 0.02).bfloat16()
    values[:6] = torch.tensor([float("inf"), -float("inf"), -0.0, 0.0, 3e38, -3e38])
    return values


def test_subtract_gives_torch_bytes(monkeypatch):
    """Task vectors: x - base rounded to bfloat16 as torch rounds it (including overflow to inf and -0 - 0)."""
    x, base = _special_values(10_007, 1), _special_values(10_007, 2)
    base[:6] = torch.tensor([1.0, 2.0, 0.0, -0.0, -3e38, 3e38])
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(bf16_mix, "ELEMENTWISE", compiled)
        results.append(bf16_mix.subtract(x, base, torch.empty_like(x)))
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    monkeypatch.setattr(bf16_mix, "ELEMENTWISE", True)  # other dtypes and strided inputs take torch's path
    assert torch.equal(bf16_mix.subtract(x.float(), base.float(), torch.empty(x.shape)), x.float() - base.float())
    strided = torch.stack([x, x], dim=1)[:, 0]
    from_strided = bf16_mix.subtract(strided, base, torch.empty_like(x))
    assert torch.equal(from_strided.view(torch.int16), results[1].view(torch.int16))


def test_keep_masked_gives_torch_bytes(monkeypatch):
    """Dropped entries become delta * 0: -0 for negative ones, nan for infinite ones, as torch's bool product."""
    delta = _special_values(7 * 1429, 3)
    mask = torch.rand(7 * 1429, generator=torch.Generator().manual_seed(4)) < 0.5
    mask[:6] = False
    results = []
    for compiled in (True, False):
        monkeypatch.setattr(bf16_mix, "ELEMENTWISE", compiled)
        results.append(bf16_mix.keep_masked(delta.clone().reshape(7, 1429), mask.reshape(7, 1429)))
    assert torch.equal(results[0].isnan(), results[1].isnan())
    numbers = ~results[1].isnan()
    assert torch.equal(results[0][numbers].view(torch.int16), results[1][numbers].view(torch.int16))
    assert results[1][0, :2].isnan().all() and results[0][0, 2].view(torch.int16) == results[1][0, 2].view(torch.int16)


def test_warm_loads_the_loops_a_ties_merge_uses():
    """The executor warms these on a thread of its own for task-vector merges; the calls must be consistent
    inputs (a table replay given positions that do not hold the followed key would never end)."""
    from mergesmith.kernels import introsort_replay
    from mergesmith.methods import get_method

    bf16_mix.warm()
    introsort_replay.warm()
    for name in ("ties", "task_arithmetic", "breadcrumbs_ties"):  # the methods announce the loops they use
        assert bf16_mix.KERNELS in get_method(name).kernel_groups({}, seeded=False), name
    assert introsort_replay.KERNELS in get_method("ties").kernel_groups({}, seeded=False)
