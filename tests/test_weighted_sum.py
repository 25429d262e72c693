"""Linear's compiled weighted sum (kernels/weighted_sum.py) against the torch path it replaces, byte for byte.

What must hold: for bf16 and float32 inputs, any count of models the loops take, any length (odd ones, shorter
than a step, across steps), signed zeros, values that round at the bf16 boundary, nan and inf, with and without
normalisation and with weights that sum to zero, `linear_average` gives the same bytes with the loops as
without; and the loops are really the ones used (a test that compared torch with torch could not fail)."""

from __future__ import annotations

import math

import pytest
import torch

from mergesmith.kernels import weighted_sum as ws
from mergesmith.methods.linear import linear_average

pytestmark = pytest.mark.skipif(not ws.AVAILABLE, reason="numba is not installed")


def _same(fast: torch.Tensor, slow: torch.Tensor) -> bool:
    """Equal bytes, except that a nan need only be a nan: torch's own conversion to bf16 writes 0xFFFF for a nan
    in its vector loop and 0x7FC0 in its scalar tail, so no loop can match it at every position."""
    nan = torch.isnan(slow)
    if not torch.equal(torch.isnan(fast), nan):
        return False
    return torch.equal(fast[~nan].view(torch.uint8), slow[~nan].view(torch.uint8))


def _torch_path(tensors: list[torch.Tensor], weights: list[float], normalize: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(ws, "ENABLED", False)
    try:
        return linear_average(tensors, weights, normalize)
    finally:
        monkeypatch.setattr(ws, "ENABLED", True)


def _inputs(count: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(n, generator=g) * 10 ** torch.randint(-3, 3, (n,), generator=g)).to(dtype)
               for _ in range(count)]
    for t in tensors:  # the awkward values: signed zeros, infinities, nan, the largest finite, tiny ones
        special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.3e38, -3.3e38, 1e-40])
        t[: min(n, special.numel())] = special[: min(n, special.numel())].to(dtype)
    return tensors


@pytest.fixture(autouse=True)
def compiled_ready() -> None:
    assert ws.KERNELS.wait(), ws.KERNELS.error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("count", [1, 2, 3, 5, ws.MAX_INPUTS])
@pytest.mark.parametrize("n", [1, 7, ws.STEP - 1, ws.STEP + 3, 3 * ws.STEP + 17, 100_003])
def test_the_compiled_sum_gives_the_torch_paths_bytes(dtype, count, n, monkeypatch) -> None:
    tensors = _inputs(count, n, dtype, seed=count * 1000 + n)
    weights = [0.5, 0.3, 0.2, -0.7, 1e-3, 2.5, 0.125, 1 / 3][:count]
    used = []
    real = ws.weighted_total
    monkeypatch.setattr(ws, "weighted_total", lambda *a: (used.append(1), real(*a))[1])
    for normalize in (True, False):
        fast = linear_average(tensors, weights, normalize)
        slow = _torch_path(tensors, weights, normalize, monkeypatch)
        assert fast.dtype == slow.dtype == dtype
        assert _same(fast, slow), (normalize, n, count)
    assert len(used) == 2  # the loops ran (else this compared torch with torch)


def test_torch_is_asked_how_it_rounds_and_both_answers_are_exact(monkeypatch) -> None:
    """The machine's answer is torch's own (here: the probe agrees with an addcmul of random values), and the loop
    of the other answer is exact too (a float64 reference of separate roundings), so a machine whose torch does not
    fuse gets its bytes as well."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4099, generator=g), torch.randn(4099, generator=g)
    total = torch.zeros(4099).addcmul_(x, torch.tensor(0.3)).addcmul_(y, torch.tensor(0.7))
    a, b, w0, w1 = x.numpy(), y.numpy(), np.float32(0.3), np.float32(0.7)
    first = (a * w0).astype(np.float32)
    fma = (first.astype(np.float64) + b.astype(np.float64) * np.float64(w1)).astype(np.float32)
    separate = (first + (b * w1).astype(np.float32)).astype(np.float32)
    assert not np.array_equal(fma, separate)  # the values tell the two apart
    assert np.array_equal(total.numpy(), fma if ws.torch_fuses() else separate)
    for fused, expected in ((True, fma), (False, separate)):
        out = np.empty(4099, dtype=np.float32)
        ws.weighted_total((a, b), np.array([w0, w1]), np.float32(0), fused, out)
        assert np.array_equal(out, expected), fused


def test_weights_summing_to_zero_leave_the_sum_undivided(monkeypatch) -> None:
    tensors = _inputs(2, 4099, torch.bfloat16, seed=5)
    fast = linear_average(tensors, [1.0, -1.0], True)
    slow = _torch_path(tensors, [1.0, -1.0], True, monkeypatch)
    assert _same(fast, slow)


def test_what_the_loops_do_not_take_goes_to_torch(monkeypatch) -> None:
    """Mixed dtypes, float16, strided views, more inputs than compiled for: the torch path, same results."""
    a, b = _inputs(2, 1000, torch.bfloat16, seed=1)
    cases = [
        [a, b.float()],
        [a.half(), b.half()],
        [a.view(10, 100).t(), b.view(10, 100).t()],
        _inputs(ws.MAX_INPUTS + 1, 1000, torch.bfloat16, seed=2),
    ]
    for tensors in cases:
        assert ws.weighted_sum(tensors, [1.0] * len(tensors), 0.0) is None
        weights = [0.25] * len(tensors)
        fast = linear_average(tensors, weights, True)
        slow = _torch_path(tensors, weights, True, monkeypatch)
        assert _same(fast, slow)
