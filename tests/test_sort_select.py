"""sort_select must pick exactly the entries torch's CPU sort puts in a window, ties included: TIES and
Breadcrumbs stay bit-equal to mergekit only if equal magnitudes are broken as `torch.sort` breaks them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergesmith.kernels import sort_select
from mergesmith.methods.task_arithmetic import magnitude, magnitude_outliers


def sorted_window_reference(values: torch.Tensor, lo: int, hi: int, descending: bool) -> torch.Tensor:
    mask = torch.zeros(values.numel(), dtype=torch.bool)
    mask[torch.sort(values.float(), descending=descending).indices[lo:hi]] = True
    return mask


def magnitudes(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """Inputs with few, many or no repeated values, in orders that stress the partition."""
    if kind == "bf16_deltas":  # a bf16 task vector's magnitudes: many ties at every value
        a = (torch.randn(n, generator=generator) * 0.01).bfloat16()
        b = (torch.randn(n, generator=generator) * 0.01).bfloat16()
        return (a - b).abs()
    if kind == "few_values":
        return torch.randint(0, 5, (n,), generator=generator).float()
    if kind == "distinct":
        return torch.randn(n, generator=generator).abs()
    if kind == "ascending":
        return torch.randint(0, 50, (n,), generator=generator).float().sort().values
    if kind == "descending_fp16":
        return torch.randint(0, 50, (n,), generator=generator).float().sort(descending=True).values.half()
    if kind == "all_equal":
        return torch.zeros(n)
    if kind == "organ_pipe":
        half = torch.arange(n // 2, dtype=torch.float32)
        return torch.cat([half, half.flip(0), torch.zeros(n - 2 * (n // 2))])
    raise AssertionError(kind)


KINDS = ["bf16_deltas", "few_values", "distinct", "ascending", "descending_fp16", "all_equal", "organ_pipe"]


@pytest.fixture(params=["ids", "table", "numpy"], ids=["compiled-ids", "compiled-table", "numpy"])
def replay_everything(monkeypatch, request):
    """Replay even tiny inputs, with tiny blocks and exchange chunks, so every bookkeeping branch runs; by the
    compiled replay (introsort_replay.py) following entries by ids or by its table, and by the numpy one."""
    monkeypatch.setattr(sort_select, "COMPILED", request.param != "numpy" and sort_select.introsort_replay.AVAILABLE)
    if request.param == "table":
        monkeypatch.setattr(sort_select.introsort_replay, "IDS_MAX_ENTRIES", 0)
        monkeypatch.setattr(sort_select.introsort_replay, "MAX_TRACKED_SHARE", 1.0)  # follow any number compiled
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 0)
    monkeypatch.setattr(sort_select, "_BLOCK", 61)
    monkeypatch.setattr(sort_select, "_SWAP_CHUNK", 17)


@pytest.mark.parametrize("kind", KINDS)
def test_small_windows_match_torch_sort(replay_everything, kind):
    generator = torch.Generator().manual_seed(KINDS.index(kind))
    replayed = 0
    for _ in range(60):
        n = int(torch.randint(1, 3000, (1,), generator=generator))
        values = magnitudes(kind, n, generator)
        lo = int(torch.randint(0, n + 1, (1,), generator=generator))
        hi = int(torch.randint(lo, n + 1, (1,), generator=generator))
        for window in ((lo, hi), (0, hi), (lo, n)):
            for descending in (True, False):
                expected = sorted_window_reference(values, *window, descending)
                assert torch.equal(sort_select.sorted_window_mask(values, *window, descending), expected), (
                    kind, n, window, descending)
        packed = sort_select._packed_keys(values)
        replayed += packed is not None and sort_select._replay(packed, lo, hi, True)
    if kind != "organ_pipe":  # median-of-3 degrades on it: some draws spend the depth budget (checked above)
        assert replayed == 60


@pytest.mark.parametrize("n, density", [(1 << 17, 0.5), (300_001, 0.1), (2_500_000, 0.73)])
def test_large_bf16_windows_match_torch_sort(n, density):
    """Sizes above the replay threshold and the block size, with the default settings."""
    values = magnitudes("bf16_deltas", n, torch.Generator().manual_seed(n))
    k = int(density * n)
    assert torch.equal(sort_select.sorted_window_mask(values, 0, k, True), sorted_window_reference(values, 0, k, True))
    lo, hi = n // 100, n // 100 + k // 2
    assert torch.equal(sort_select.sorted_window_mask(values, lo, hi, False),
                       sorted_window_reference(values, lo, hi, False))


@pytest.mark.parametrize("values", [
    torch.tensor([1.0, float("nan"), 0.5] * 50),
    torch.tensor([1.0, -0.0, 0.0, 2.0] * 50),
    torch.tensor([1.0, -3.0, 2.0, 0.5] * 50),
    torch.arange(200, dtype=torch.float64),
], ids=["nan", "negative_zero", "negative", "float64"])
def test_inputs_the_replay_cannot_order_use_the_full_sort(replay_everything, values):
    assert sort_select._packed_keys(values) is None
    for descending in (True, False):
        assert torch.equal(sort_select.sorted_window_mask(values, 10, 90, descending),
                           sorted_window_reference(values, 10, 90, descending))


def test_a_spent_depth_budget_falls_back_to_the_full_sort(replay_everything, monkeypatch):
    """libstdc++ heap-sorts a range whose depth budget is spent; that is not replayed, so the full sort decides."""
    values = magnitudes("bf16_deltas", 5000, torch.Generator().manual_seed(3))
    monkeypatch.setattr(sort_select, "depth_budget", lambda n: 1)
    assert sort_select._replay(sort_select._packed_keys(values), 0, 2500, True) is False
    assert torch.equal(sort_select.sorted_window_mask(values, 0, 2500, True),
                       sorted_window_reference(values, 0, 2500, True))


def test_full_and_empty_windows():
    values = torch.rand(100)
    assert sort_select.sorted_window_mask(values, 0, 100, True).all()
    assert not sort_select.sorted_window_mask(values, 40, 40, True).any()


def test_ties_trim_and_breadcrumbs_equal_mergekits_formulas():
    """magnitude and magnitude_outliers on a tensor big enough to be replayed, against mergekit 0.1.5's
    argsort formulas written out (rows of 512 x 640 = 327,680 bf16 entries)."""
    generator = torch.Generator().manual_seed(7)
    delta = ((torch.randn(512, 640, generator=generator) * 0.01).bfloat16()
             - (torch.randn(512, 640, generator=generator) * 0.01).bfloat16())
    n = delta.numel()
    for density in (0.2, 0.5, 0.9):
        k = int(density * n)
        mask = torch.zeros(n, dtype=delta.dtype)
        mask[torch.argsort(delta.abs().reshape(-1).float(), descending=True)[:k]] = 1
        assert torch.equal(magnitude(delta, density), delta * mask.reshape_as(delta))
        keep, top = k, int(0.01 * n)
        bottom = n - keep - top
        mask = torch.zeros(n, dtype=delta.dtype)
        mask[torch.sort(delta.abs().reshape(-1).float()).indices[bottom : bottom + keep]] = 1
        assert torch.equal(magnitude_outliers(delta, density, 0.01), delta * mask.reshape_as(delta))


def test_consumed_magnitudes_are_made_afresh_when_the_replay_gives_up(replay_everything, monkeypatch):
    """With `remake`, the keys-only replay reorders the caller's temporary in place; if it then meets a spent
    depth budget, the full sort must run on fresh values, not on the reordered ones."""
    values = magnitudes("bf16_deltas", 5000, torch.Generator().manual_seed(4))
    expected = sorted_window_reference(values, 0, 2500, True)
    monkeypatch.setattr(sort_select, "depth_budget", lambda n: 1)
    scratch = values.clone()
    remade: list[int] = []

    def remake() -> torch.Tensor:
        remade.append(1)
        return values.clone()

    assert torch.equal(sort_select.sorted_window_mask(scratch, 0, 2500, True, remake=remake), expected)
    assert remade and not torch.equal(scratch, values)  # the replay did reorder the consumed copy


@pytest.mark.parametrize("near_end", [3, 20])
def test_scan_stops_are_found_in_every_block(monkeypatch, near_end):
    """The k-th stop of a scan, asked in any order and from either end of its block, is the k-th entry the
    scan's condition holds for, whether the block's stops were found whole or from an end."""
    monkeypatch.setattr(sort_select, "_BLOCK", 61)
    monkeypatch.setattr(sort_select, "_NEAR_END", near_end)
    rng = np.random.default_rng(0)
    for _ in range(50):
        entries = rng.integers(0, 10, size=int(rng.integers(1, 400))).astype(np.int16)
        low, high = sorted(int(v) for v in rng.integers(0, 11, size=2))
        stops = sort_select._Stops(entries, low, high if high > low else None)
        expected = np.flatnonzero((entries >= low) & (entries < high) if high > low else entries >= low)
        assert stops.total == expected.size
        for k in rng.permutation(expected.size):
            assert stops.kth(int(k)) == expected[k]
            assert stops.from_right(int(k)) == expected[expected.size - 1 - k]


@pytest.mark.parametrize("rescale", [False, True])
def test_trimming_in_place_gives_the_same_bits_in_the_same_storage(rescale):
    generator = torch.Generator().manual_seed(5)
    delta = (torch.randn(300, 257, generator=generator) * 0.01).to(torch.bfloat16)
    for trim in (lambda d, **kw: magnitude(d, 0.3, rescale, **kw),
                 lambda d, **kw: magnitude_outliers(d, 0.3, 0.05, rescale, **kw)):
        expected = trim(delta.clone())
        scratch = delta.clone()
        kept = trim(scratch, in_place=True)
        assert kept.data_ptr() == scratch.data_ptr()
        assert torch.equal(kept.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("kind", ["f32_of_bf16_deltas", "distinct", "few_values"])
@pytest.mark.parametrize("n, density", [(1 << 17, 0.5), (300_001, 0.1), (2_500_000, 0.73)])
def test_large_float32_windows_replay_the_32_bit_keys(kind, n, density):
    """float32 magnitudes (the default compute dtype) replay on their 32-bit keys, tracking only the entries
    of the magnitudes the window's ends cut (found by a histogram of the high 16 bits, then of the low 16 of
    those buckets), with the default settings; bf16 differences computed in float32 tie a lot."""
    generator = torch.Generator().manual_seed(n + len(kind))
    if kind == "f32_of_bf16_deltas":
        values = (magnitudes("bf16_deltas", n, generator).float() * 3).abs()
    else:
        values = magnitudes(kind, n, generator)
    assert values.dtype == torch.float32
    keys = values.view(torch.int32).numpy()
    k = int(density * n)
    inside, split = sort_select._wide_window_keys(keys, 0, k, True)
    assert sum(split.values()) < n / 2 and (bool(split) or kind == "distinct")  # keys-only, not packed
    assert torch.equal(sort_select.sorted_window_mask(values, 0, k, True), sorted_window_reference(values, 0, k, True))
    lo, hi = n // 100, n // 100 + k // 2
    assert torch.equal(sort_select.sorted_window_mask(values, lo, hi, False),
                       sorted_window_reference(values, lo, hi, False))


@pytest.mark.parametrize(("lo", "hi", "run"), [(0, 30_000, 0.0), (20_000, 90_000, 0.0), (0, 99_900, 0.0),
                                              (100, 200, 0.5)])
def test_a_mask_written_into_a_callers_stale_buffer_is_the_sorts(lo: int, hi: int, run: float) -> None:
    """`out`: the mask in a caller's buffer whatever it held before (all True here), for windows whose keys the
    comparison pass covers and a window inside one key's run (which it does not: the largest, 0.5, here); the
    result is a view of that buffer."""
    g = torch.Generator().manual_seed(lo + hi)
    values = (torch.randn(100_000, generator=g) * 0.01).clamp(-0.4, 0.4).bfloat16().abs()
    values[:40_000] = run  # a run of equal keys the window may end in, or lie in
    expected = torch.zeros(values.numel(), dtype=torch.bool)
    expected[torch.sort(values.float(), descending=True).indices[lo:hi]] = True
    stale = np.ones(120_000, dtype=np.bool_)
    mask = sort_select.sorted_window_mask(values.clone(), lo, hi, True, out=stale)
    plain = sort_select.sorted_window_mask(values.clone(), lo, hi, True)
    assert torch.equal(mask, plain) and torch.equal(mask, expected)
    if hi in (30_000, 200):  # the keys-only replay, which writes into `out`
        assert np.shares_memory(mask.numpy(), stale)


@pytest.mark.skipif(not sort_select.introsort_replay.AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1 << 16, (1 << 20) + 3])
def test_compiled_key_counts_equal_bincount_and_refuse_what_min_and_max_refuse(n):
    """introsort_replay.key_counts (the 16-bit selections' one-pass histogram) against numpy's bincount, with the
    range check numpy's min and max made: a key with the sign bit or a nan's bits, at any place of the four
    partial histograms or in the tail, refuses the keys (the selection then sorts whole)."""
    sort_select.introsort_replay.warm()
    rng = np.random.default_rng(n)
    keys = (torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.01).bfloat16().view(torch.int16)
            & 0x7FFF).numpy()
    keys[: n // 3] = 0  # a long run of one key
    limit = 0x7F80
    counts = np.zeros(1 << 15, dtype=np.int64)
    assert sort_select.introsort_replay.key_counts(keys, limit, counts)
    assert np.array_equal(counts, np.bincount(keys.astype(np.int64), minlength=1 << 15))
    for at in {i for i in (0, 1, 2, 3, n // 2, n - 1) if 0 <= i < n}:
        for bad in (-1, -32768, limit + 1, 0x7FFF):
            spoiled = keys.copy()
            spoiled[at] = bad
            assert not sort_select.introsort_replay.key_counts(spoiled, limit, np.zeros(1 << 15, dtype=np.int64))
            assert sort_select._narrow_key_counts(spoiled, limit) is None
    if n:
        spoiled = keys.copy()
        spoiled[-1] = limit  # infinity's bits: in range
        assert sort_select.introsort_replay.key_counts(spoiled, limit, np.zeros(1 << 15, dtype=np.int64))
