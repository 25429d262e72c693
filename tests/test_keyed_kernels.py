"""keyed_kernels' compiled loops give the torch operations' bytes (keyed_merge.FUSED on and off).

The loops replace ~20 torch operations per chunk on the CPU; the torch operations still run on other devices
and where numba is missing, so both must give the same output for the same inputs: every mix (no consensus,
sum, count; normalize or not; lambda 1 or not), DARE and DELLA, with and without the rescale's totals pass,
every input dtype, tensors of any rank and of sizes that cut chunks and bytes of packed flags mid-way, weights
that are negative or sum to zero, task vectors with exact zeros (entries a fine-tune left as they were).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mergesmith.kernels import keyed_kernels, keyed_merge
from mergesmith.kernels.keyed_random import MaskStream

pytestmark = pytest.mark.skipif(not keyed_kernels.AVAILABLE, reason="numba is not installed")


def _models(shape, dtype, n, seed):
    """A base and n-1 fine-tunes: base + noise, with a third of each task vector exactly zero."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g) * 0.02 + 0.01  # nonzero base entries: see _merge_both
    out = [base.to(dtype)]
    for _ in range(n - 1):
        delta = torch.randn(shape, generator=g) * 0.003
        delta[torch.rand(shape, generator=g) < 1 / 3] = 0
        out.append((base + delta).to(dtype))
    return out


def _merge_both(tensors, vectors, mix, offset=0, with_totals=False, monkeypatch=None):
    """The merge by the compiled loops and by torch operations, on the same inputs."""
    results = []
    for fused in (True, False):
        monkeypatch.setattr(keyed_merge, "FUSED", fused)
        totals = None
        if with_totals:
            state = keyed_merge.gather(None, tensors, 0, vectors, MaskStream(11), offset)
            totals = keyed_merge.finish(state)
        results.append((keyed_merge.merge(tensors, 0, vectors, mix, MaskStream(11), offset, totals), totals))
    return results


MIXES = [
    keyed_merge.Mix(consensus, normalize, rescale, lam)
    for consensus, normalize, rescale, lam in itertools.product(
        (None, "sum", "count"), (False, True), (False, True), (1.0, 0.7)
    )
]


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"{m.consensus}-n{int(m.normalize)}-r{int(m.rescale)}-l{m.lam}")
@pytest.mark.parametrize("della", [False, True], ids=["dare", "della"])
def test_compiled_loops_give_the_torch_operations_bytes(mix, della, monkeypatch):
    tensors = _models((37, 1000), torch.bfloat16, n=4, seed=5)
    epsilon = 0.1 if della else None
    vectors = [
        keyed_merge.Vector(1, 0, 0.6, 0.4, epsilon),
        keyed_merge.Vector(2, 1, -0.3, 0.7, epsilon),
        keyed_merge.Vector(3, 2, 0.5, 1.0, None),  # kept whole
    ]
    (fused, fused_totals), (plain, plain_totals) = _merge_both(
        tensors, vectors, mix, with_totals=mix.rescale, monkeypatch=monkeypatch
    )
    assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))
    if mix.rescale:
        assert fused_totals.norms == plain_totals.norms
        assert fused_totals.masks.keys() == plain_totals.masks.keys()
        for key, packed in fused_totals.masks.items():
            assert np.array_equal(packed, plain_totals.masks[key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (5,), (3, 7, 11), (300_001,), (70, 4099)])
def test_any_dtype_rank_and_size(dtype, shape, monkeypatch):
    tensors = _models(shape, dtype, n=3, seed=7)
    vectors = [keyed_merge.Vector(1, 0, 0.5, 0.3), keyed_merge.Vector(2, 1, 0.5, 0.6, 0.2)]
    mix = keyed_merge.Mix("sum", True, True, 1.0)
    for offset in (0, 12_345):
        (fused, _), (plain, _) = _merge_both(tensors, vectors, mix, offset, True, monkeypatch)
        assert fused.dtype == plain.dtype == dtype
        assert torch.equal(fused.view(-1).view(torch.uint8), plain.view(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_inputs_and_strided_ones(dtype, monkeypatch):
    """Inputs with nan and +-inf entries (the compiled rounding hands a chunk with a nan to torch, whose nan bits
    differ between its vector loop and its scalar tail) and a transposed, non-contiguous input (the compiled chunks
    read a contiguous copy) give the torch operations' bytes; float64 inputs are rounded to float32 as torch does."""
    tensors = _models((300, 900), dtype, n=3, seed=13)
    tensors[1].view(-1)[[5, 700, 262_144, 262_150]] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30],
                                                                   dtype=dtype)
    tensors[2] = tensors[2].t().contiguous().t()  # the same values, laid out column-major
    assert not tensors[2].is_contiguous()
    vectors = [keyed_merge.Vector(1, 0, 0.5, 0.3), keyed_merge.Vector(2, 1, 0.7, 0.6)]
    for consensus in (None, "sum"):
        mix = keyed_merge.Mix(consensus, True, False, 1.0)  # no rescale: a nan in the L1 norms would spread
        (fused, _), (plain, _) = _merge_both(tensors, vectors, mix, 0, False, monkeypatch)
        assert 0 < int(fused.isnan().sum()) < 4
        assert torch.equal(fused.view(-1).view(torch.uint8), plain.view(-1).view(torch.uint8)), consensus


def test_weights_that_sum_to_zero_and_zero_densities(monkeypatch):
    tensors = _models((64, 513), torch.bfloat16, n=3, seed=9)
    for weights, densities in (((0.5, -0.5), (0.5, 0.5)), ((1.0, 2.0), (0.0, 1.0)), ((0.0, 0.0), (0.2, 0.9))):
        vectors = [keyed_merge.Vector(i + 1, i, w, d) for i, (w, d) in enumerate(zip(weights, densities))]
        for consensus in (None, "sum", "count"):
            mix = keyed_merge.Mix(consensus, True, True, 1.0)
            (fused, _), (plain, _) = _merge_both(tensors, vectors, mix, 0, True, monkeypatch)
            assert torch.equal(fused.view(torch.int16), plain.view(torch.int16)), (weights, densities, consensus)


@pytest.mark.parametrize("n", [1, 7, 2048, 2049, 5003])
def test_the_bf16_mix_equals_the_steps_it_fuses(n):
    """keyed_kernels.mix_bf16 (bits in, packed flags, bits out) against widen_into, unpackbits, mix and narrow_into on
    the same data: the same bits for every consensus, normalize and lambda, masked or not, with nans counted."""
    rng = np.random.default_rng(n)
    count = 3
    base = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02).to(torch.bfloat16)
    xs = torch.stack([base.float() + torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.003)
                      for _ in range(count)]).to(torch.bfloat16)
    if n > 5:
        xs[1, 3] = float("nan")
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    flags = (rng.random((count, n)) < 0.6).astype(np.uint8)
    packed = np.stack([np.packbits(f) for f in flags])
    for masked, consensus, normalize, lam in itertools.product(
        ([True, True, False], [False, False, False]), (0, 1, 2), (False, True), (1.0, 0.7)
    ):
        masked = np.array(masked)
        constants = (np.array([1.3, 0.8, 1.0], np.float32), np.array([0.5, 0.3, -0.2], np.float32), consensus,
                     normalize, np.float32(0.6), np.float32(lam), lam != 1)
        fused = np.empty(n, np.uint16)
        nans = keyed_kernels.mix_bf16(bits(base), bits(xs), packed, masked, *constants, fused)
        base32, xs32, result, stepwise = (np.empty(n, np.float32), np.empty((count, n), np.float32),
                                          np.empty(n, np.float32), np.empty(n, np.uint16))
        keyed_kernels.widen_into(bits(base), base32)
        for k in range(count):
            keyed_kernels.widen_into(bits(xs)[k], xs32[k])
        keyed_kernels.mix(base32, xs32, flags, masked, *constants, result)
        assert nans == keyed_kernels.narrow_into(result, stepwise) == int(np.isnan(result).sum())
        finite = ~np.isnan(result)
        assert np.array_equal(fused[finite], stepwise[finite]), (masked, consensus, normalize, lam)


def test_merged_bits_equal_the_steps_with_nans_and_infinities(monkeypatch):
    """keyed_merge's merge pass with MERGE_BITS on and off, after a totals pass, on bf16 inputs with nan and infinite
    entries: the same bytes (a chunk with a nan result is redone by the steps, whose nans are torch's)."""
    tensors = _models((300, 900), torch.bfloat16, n=3, seed=17)
    tensors[1].view(-1)[[5, 700, 262_144, 262_150]] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30],
                                                                   dtype=torch.bfloat16)
    vectors = [keyed_merge.Vector(1, 0, 0.5, 0.3), keyed_merge.Vector(2, 1, 0.7, 1.0)]
    mix = keyed_merge.Mix("sum", True, True, 1.0)
    state = keyed_merge.gather(None, tensors, 0, vectors, MaskStream(11), 0)
    totals = keyed_merge.finish(state)
    results = []
    for bits in (True, False):
        monkeypatch.setattr(keyed_merge, "MERGE_BITS", bits)
        results.append(keyed_merge.merge(tensors, 0, vectors, mix, MaskStream(11), 0, totals))
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    clean = [t.clone() for t in tensors]
    clean[1] = tensors[2].clone()
    state = keyed_merge.gather(None, clean, 0, vectors, MaskStream(11), 0)
    calls = []
    real = keyed_kernels.mix_bf16
    monkeypatch.setattr(keyed_kernels, "mix_bf16", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(keyed_merge, "MERGE_BITS", True)
    keyed_merge.merge(clean, 0, vectors, mix, MaskStream(11), 0, keyed_merge.finish(state))
    assert calls  # the bits path ran


def test_the_loops_run_without_the_gil():
    """Two threads each computing chunks finish in about one thread's time on a 2-core machine only if the
    loop releases the GIL; checked directly: numba marks the dispatcher nogil."""
    assert keyed_kernels.mix.real().targetoptions.get("nogil") is True
    assert keyed_kernels.magnitudes.real().targetoptions.get("nogil") is True
    assert keyed_kernels.mix_bf16.real().targetoptions.get("nogil") is True


def test_compiled_philox_gives_numpys_draws(monkeypatch):
    """keyed_kernels.philox_draws against numpy's Philox generator, at starts and lengths that cut its blocks of
    eight draws and the keyed chunks anywhere, for several seeds (one above 2**63) and streams."""
    from mergesmith.kernels import keyed_random

    rng = np.random.default_rng(0)
    cases = [(0, 0), (0, 1), (1, 1), (3, 4), (7, 9), (keyed_random.CHUNK - 3, 10), (5, 3 * keyed_random.CHUNK + 11)]
    cases += [(int(rng.integers(0, 1 << 40)), int(rng.integers(1, 5000))) for _ in range(20)]
    for seed in (0, 4, (1 << 64) - 5):
        for stream in (0, 1, 7):
            for start, count in cases:
                monkeypatch.setattr(keyed_random, "COMPILED", True)
                compiled = keyed_random.MaskStream(seed).draws(stream, start, count)
                monkeypatch.setattr(keyed_random, "COMPILED", False)
                reference = keyed_random.MaskStream(seed).draws(stream, start, count)
                assert np.array_equal(compiled, reference), (seed, stream, start, count)


@pytest.mark.parametrize("density", [0.0, 0.3, 0.5, 0.999])
@pytest.mark.parametrize("n", [1, 7, 8, 2047, 2049, 300_001])
def test_bfloat16_totals_in_one_compiled_loop_give_the_separate_steps_bytes(n, density, monkeypatch):
    """keyed_kernels.dare_totals (a bf16 DARE vector's totals chunk in one call: draws, flags, magnitudes, packed
    flags) against the steps it replaces (numpy's draws and comparison, widen_into, magnitudes, np.packbits), at
    lengths that end mid-byte and mid-step and from starts that cut Philox blocks and keyed chunks; and a totals
    pass over bf16 inputs takes it (so the comparisons of the passes above cover it)."""
    from mergesmith.kernels import keyed_random

    assert keyed_kernels.warm()
    g = torch.Generator().manual_seed(n)
    base = (torch.randn(n, generator=g) * 0.02).bfloat16()
    x = (base.float() + torch.randn(n, generator=g) * 0.003).bfloat16()
    base32 = base.float().numpy()
    bits = x.view(torch.int16).numpy().view(np.uint16)
    vec = keyed_merge.Vector(1, 3, 0.5, density)
    threshold = keyed_merge._dare_threshold(vec)
    assert threshold is not None
    for start in (0, 5, keyed_random.CHUNK - 9):
        stream = MaskStream(17)
        mags, kept = np.empty(n, np.float32), np.empty(n, np.float32)
        packed = np.full(-(-n // 8), 0xAA, np.uint8)  # every byte must be written
        scratch = np.empty(keyed_kernels.STEP, np.uint32), np.empty(keyed_kernels.STEP, np.uint8)
        block = 2 * keyed_kernels.STEP  # the block sums of every whole block, as BlockedTotal adds them
        sums, tree = np.full((2, n // block), np.nan, np.float32), np.empty(block // 2, np.float32)
        keyed_kernels.dare_totals(base32, bits, *stream.key, vec.stream, start, keyed_random.CHUNK, threshold,
                                  *scratch, mags, kept, packed, sums, block, tree)
        monkeypatch.setattr(keyed_random, "COMPILED", False)
        flags = keyed_merge.keep_array(MaskStream(17), vec, start, torch.from_numpy(base32))
        monkeypatch.setattr(keyed_random, "COMPILED", True)
        ref_mags, ref_kept = np.empty(n, np.float32), np.empty(n, np.float32)
        keyed_kernels.magnitudes(base32, x.float().numpy(), flags.view(np.uint8), ref_mags, ref_kept)
        assert np.array_equal(packed, np.packbits(flags)), start
        assert np.array_equal(mags.view(np.uint32), ref_mags.view(np.uint32))
        assert np.array_equal(kept.view(np.uint32), ref_kept.view(np.uint32))
        for row, values in enumerate((ref_mags, ref_kept)):
            expected = np.empty(n // block, np.float32)
            keyed_kernels.tree_block_sums(values[: n // block * block], block, tree, expected)
            assert np.array_equal(sums[row].view(np.uint32), expected.view(np.uint32))

    calls = []
    real = keyed_kernels.dare_totals
    monkeypatch.setattr(keyed_kernels, "dare_totals", lambda *a: calls.append(1) or real(*a))
    tensors = [base.reshape(1, n), x.reshape(1, n)]
    keyed_merge.gather(None, tensors, 0, [vec], MaskStream(3), 0)
    assert calls
