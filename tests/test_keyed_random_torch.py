"""The keyed Philox stream computed with torch integer operations (kernels/keyed_random_torch.py), for devices.

What must hold: its draws are numpy's Philox-4x64 stream as keyed by keyed_random.MaskStream, bit for bit, for
any seed, stream, first position and length (chunk boundaries, odd positions, pieces); masks and DARE/DELLA
merges drawn by it are the CPU path's bytes; and tensors off the CPU take it. No GPU is needed: the device path
is forced on CPU tensors (keyed_random.drawn_by_numpy), and the `meta` device shows the dispatch.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mergesmith.kernels import keyed_merge, keyed_random, keyed_random_torch
from mergesmith.kernels.keyed_random import CHUNK, MaskStream
from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs
from tests.helpers import one_torch_thread

KEYED = ("dare_ties", "dare_linear", "della", "della_linear")


one_thread = pytest.fixture(autouse=True)(one_torch_thread)


def _numpy_draws(seed: int, stream: int, start: int, count: int) -> np.ndarray:
    """numpy's generator itself (not keyed_kernels' compiled copy), as int64."""
    saved = keyed_random.COMPILED
    keyed_random.COMPILED = False
    try:
        return MaskStream(seed).draws(stream, start, count).astype(np.int64)
    finally:
        keyed_random.COMPILED = saved


def _torch_draws(seed: int, stream: int, start: int, count: int) -> np.ndarray:
    return keyed_random_torch.draws(seed, stream, start, count, CHUNK, "cpu").numpy()


SPANS = [
    (0, 1), (0, 8), (1, 7), (3, 5), (2, 13), (5, 1000),  # inside one block, across blocks, odd starts
    (CHUNK - 5, 11), (CHUNK - 1, 2), (CHUNK, 9),  # across and at the first chunk boundary
    (3 * CHUNK - 4097, 2 * CHUNK + 8195),  # several chunks, neither end aligned
    (7 * 2**30 + 3, 77),  # far into a large tensor (chunk numbers past 2**16)
]


@pytest.mark.parametrize("start,count", SPANS)
def test_torch_draws_are_numpys_bit_for_bit(start, count):
    for seed in (0, 7, 2**63 - 1, 2**64 - 1, 0x123456789ABCDEF0):
        for stream in (0, 1, 3, 2**32 + 5):
            torch_bits = _torch_draws(seed, stream, start, count)
            assert torch_bits.dtype == np.int64 and torch_bits.shape == (count,)
            assert np.array_equal(torch_bits, _numpy_draws(seed, stream, start, count)), (seed, stream)


def test_torch_draws_match_at_random_seeds_positions_and_lengths():
    rng = random.Random(33)
    for _ in range(40):
        seed, stream = rng.getrandbits(64), rng.randrange(8)
        start, count = rng.randrange(6 * CHUNK), rng.randrange(1, 3 * CHUNK)
        assert np.array_equal(_torch_draws(seed, stream, start, count), _numpy_draws(seed, stream, start, count))


def test_torch_draws_are_the_pinned_ones():
    """tests/test_keyed_masks.py pins the stream's first draws: the torch stream gives them too."""
    from tests.test_keyed_masks import PINNED_FIRST_DRAWS, PINNED_LATER_DRAWS

    assert _torch_draws(7, 0, 0, 4).tolist() == PINNED_FIRST_DRAWS
    assert _torch_draws(7, 1, 5 * CHUNK + 3, 2).tolist() == PINNED_LATER_DRAWS


def test_pieces_join_without_a_seam(monkeypatch):
    """Long requests are computed PIECE draws at a time: any piece size, aligned or not, gives the same draws."""
    expected = _numpy_draws(11, 2, CHUNK - 37, 1500)
    for piece in (1, 8, 13, 100, 1024):
        monkeypatch.setattr(keyed_random_torch, "PIECE", piece)
        assert np.array_equal(_torch_draws(11, 2, CHUNK - 37, 1500), expected), piece


def test_the_word_product_is_exact_at_the_extremes():
    """mulhilo's 128-bit products against Python's integers, at words with every bit set and random ones."""
    rng = random.Random(5)
    values = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1] + [rng.getrandbits(64) for _ in range(200)]
    constants = [keyed_random_torch._M1, keyed_random_torch._M0, 2**64 - 1]
    words = torch.tensor([[[v & 0xFFFFFFFF for v in values], [v >> 32 for v in values]]] * 3, dtype=torch.int64)
    limbs = torch.tensor([[(c >> (16 * k)) & 0xFFFF for k in range(4)] for c in constants]).view(3, 1, 4, 1)
    quarters = keyed_random_torch.mulhilo(words, limbs)
    for w, constant in enumerate(constants):
        for i, v in enumerate(values):
            assert sum(quarters[w, q, i].item() << (32 * q) for q in range(4)) == v * constant, (w, i)


# ----- the device path, forced on the CPU ------------------------------------------------------------------------


@pytest.fixture
def device_path(monkeypatch):
    """Every tensor takes the device path (as a CUDA tensor would), and keyed_merge's torch operations."""
    monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)
    monkeypatch.setattr(keyed_merge, "FUSED", False)


def test_masks_drawn_on_the_device_path_are_the_cpu_masks(monkeypatch):
    probs = torch.rand(70, 1000, generator=torch.Generator().manual_seed(3))
    start = CHUNK - 999
    cpu_keep = MaskStream(21).keep(1, start, (70, 1000), 0.37)
    cpu_keep_with = MaskStream(21).keep_with(2, start, probs)
    monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)
    stream = MaskStream(21)
    assert torch.equal(stream.keep(1, start, (70, 1000), 0.37), cpu_keep)
    assert torch.equal(stream.keep_with(2, start, probs), cpu_keep_with)
    assert 0.3 < cpu_keep.float().mean().item() < 0.44  # not all kept or all dropped


@pytest.fixture
def device_draws(monkeypatch) -> list[int]:
    """The device path on the CPU (keyed_random_torch's draws, not numpy's), each computation's size recorded."""
    monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)
    counts: list[int] = []
    real = keyed_random_torch.draws

    def counted(seed, stream, start, count, chunk, device):
        counts.append(count)
        return real(seed, stream, start, count, chunk, device)

    monkeypatch.setattr(keyed_random_torch, "draws", counted)
    return counts


def test_a_window_serves_the_pieces_that_follow(monkeypatch, device_draws):
    """On a device, one computation covers the next pieces of a tensor (a call costs launches, not entries)."""
    monkeypatch.setattr(keyed_random, "WINDOW", 5000)
    stream = MaskStream(4)
    got = [stream.draws_on(1, start, 1000, torch.device("cpu")).numpy() for start in range(100, 5100, 1000)]
    assert len(device_draws) == 1
    got.append(stream.draws_on(1, 5100, 1000, torch.device("cpu")).numpy())  # past the window: a new one
    assert len(device_draws) == 2
    assert np.array_equal(np.concatenate(got), _numpy_draws(4, 1, 100, 6000))


def test_a_window_stops_at_the_end_of_the_block(monkeypatch, device_draws):
    """A stream made for one row block (the executor's, with `end`) draws ahead up to the block's end, no further:
    each block gets a fresh stream, so draws past it were computed for nothing (4x the draws of a 1b dare_ties
    merge in 1M-entry blocks with the 4M window)."""
    monkeypatch.setattr(keyed_random, "WINDOW", 5000)
    stream = MaskStream(4, end=2100)
    got = [stream.draws_on(1, start, 1000, torch.device("cpu")).numpy() for start in (100, 1100)]
    assert device_draws == [2000]  # the block's 2000 entries from 100 on, one computation, not the 5000 window
    assert np.array_equal(np.concatenate(got), _numpy_draws(4, 1, 100, 2000))


def test_the_executor_draws_each_entry_once_on_the_device_path(monkeypatch, tmp_path, tiny_models, device_draws):
    """dare_ties merged in row blocks on the device path (on the CPU here): the draws computed, over both passes
    and every block, are one per entry per task vector."""
    import mergesmith
    from mergesmith.engine.execution import blocks
    from mergesmith.kernels import keyed_merge

    base = tiny_models("llama", seed=1)
    a, b = tiny_models.derive(base, seed=2, scale=0.01), tiny_models.derive(base, seed=3, scale=0.01)
    cfg = tmp_path / "dare.yml"
    cfg.write_text(
        f"merge_method: dare_ties\nbase_model: {base}\nmodels:\n"
        f"  - model: {a}\n    parameters: {{weight: 0.5, density: 0.5}}\n"
        f"  - model: {b}\n    parameters: {{weight: 0.5, density: 0.5}}\n"
    )
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1024)  # the larger tensors in several row blocks
    monkeypatch.setattr(keyed_merge, "FUSED", False)
    plan = mergesmith.plan(str(cfg)).plan
    merged = sum(r.numel() for r in plan.recipes if r.op == "merge")
    assert any(len(blocks.row_blocks(r)) > 1 for r in plan.recipes)
    mergesmith.merge(str(cfg), tmp_path / "out", threads=2, random_seed=3)
    assert sum(device_draws) == 2 * merged


@pytest.mark.parametrize("method", KEYED)
def test_merges_on_the_device_path_are_the_cpu_bytes(method, monkeypatch):
    """DARE and DELLA with masks drawn by the torch stream (whole tensors and row blocks with a totals pass, masks
    kept as device tensors between the passes) give the bytes of the CPU path (compiled loops where numba is)."""
    from tests.test_keyed_masks import MODEL_PARAMS, _merge_in_blocks, _models

    spec = get_method(method)
    params = {p.name: p.default for p in spec.params}
    results = {}
    for path in ("cpu", "device"):
        if path == "device":
            monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)
            monkeypatch.setattr(keyed_merge, "FUSED", False)
        for shape, dtype in (((48, 700), torch.bfloat16), ((10, 6, 50), torch.float32)):
            tensors = _models(shape, dtype)
            whole = spec.merge(MergeInputs(tensors, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(5)))
            results[path, shape, "whole"] = whole
            results[path, shape, "blocks"] = _merge_in_blocks(method, tensors, 7)
    for key, value in results.items():
        if key[0] == "device":
            assert torch.equal(value, results[("cpu", *key[1:])]), key


@pytest.mark.parametrize("shape", [(30, 200), (6, 40, 5), (333,), ()])
def test_della_ranks_on_the_device_path_are_the_cpu_ranks(shape, monkeypatch):
    """DELLA's thresholds by a stable torch sort (device path) equal the CPU's sort of (magnitude bits, column)
    keys, ties included: magnitudes rounded to a few values, signs mixed, zeros."""
    g = torch.Generator().manual_seed(8)
    delta = (torch.randn(shape, generator=g) * 3).round() / 4
    vec = keyed_merge.Vector(1, 0, 1.0, 0.5, 0.3)
    cpu = keyed_merge._della_thresholds_of(vec, delta)
    monkeypatch.setattr(keyed_random, "drawn_by_numpy", lambda device: False)  # the device path's stable sort
    assert torch.equal(keyed_merge._della_thresholds_of(vec, delta), cpu)
    assert delta.numel() < 2 or len(set(cpu.tolist())) > 1  # ranks make a difference


def test_tensors_off_the_cpu_are_drawn_by_the_torch_stream(monkeypatch):
    """A `meta` tensor stands for a GPU one: its masks come from keyed_random_torch on its device, not numpy."""
    devices = []
    real = keyed_random_torch.draws

    def recorded(seed, stream, start, count, chunk, device):
        devices.append(torch.device(device))
        return real(seed, stream, start, count, chunk, device)

    monkeypatch.setattr(keyed_random_torch, "draws", recorded)
    monkeypatch.setattr(MaskStream, "draws", lambda *args: pytest.fail("drew with numpy for a meta tensor"))
    delta = torch.empty(40, 300, device="meta")
    stream = MaskStream(9)
    dare = keyed_merge.keep_flags(stream, keyed_merge.Vector(1, 0, 1.0, 0.4), 0, delta)
    assert dare is not None and dare.device.type == "meta" and dare.shape == delta.shape
    with_probs = stream.keep_with(2, 0, torch.empty(5, 7, device="meta"))
    assert with_probs.device.type == "meta" and with_probs.shape == (5, 7)
    assert stream.keep(3, 0, (4, 4), 0.5, device="meta").device.type == "meta"
    assert devices and all(d.type == "meta" for d in devices)
    assert keyed_random.drawn_by_numpy(torch.device("cpu"))  # and the CPU keeps numpy's (or the compiled) path
