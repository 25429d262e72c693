"""DARE and DELLA masks from the keyed stream: right statistics, and the same bytes however the work is cut.

The executor hands DARE/DELLA a counter-based stream (kernels/keyed_random.py) instead of a sequential
generator, so a tensor can be merged in row blocks: a totals pass gathers the task vectors' L1 norms, the
second pass writes each block. What must hold: the drop keeps `density` of the entries (within sampling error),
the rescale is the whole tensor's, and the output bytes do not depend on the block size, the thread count,
`--max-memory` or an interruption and resume.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from mergesmith.engine.execution import blocks
from mergesmith.kernels import keyed_merge
from mergesmith.kernels.keyed_random import CHUNK, MaskStream
from mergesmith.kernels.reductions import BlockedTotal, total
from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs

KEYED = ("dare_ties", "dare_linear", "della", "della_linear")


# ----- the stream ---------------------------------------------------------------------------------------------


def test_draws_depend_only_on_position_not_on_how_they_are_asked_for():
    stream = MaskStream(123)
    whole = stream.draws(1, 0, 3 * CHUNK + 17)
    pieces = [(0, 5), (5, CHUNK - 3), (CHUNK + 2, 2 * CHUNK + 1), (3 * CHUNK + 3, 3 * CHUNK + 17)]
    for start, end in pieces:
        assert np.array_equal(MaskStream(123).draws(1, start, end - start), whole[start:end])
    assert not np.array_equal(stream.draws(0, 0, 100), whole[:100])  # another task vector, another stream
    assert not np.array_equal(MaskStream(124).draws(1, 0, 100), whole[:100])  # another seed


def test_draws_are_pinned():
    """The bytes are part of the output format (a resume on another machine or numpy must draw the same): numpy
    guarantees Philox's stream; this pins our keying of it."""
    assert MaskStream(7).draws(0, 0, 4).tolist() == PINNED_FIRST_DRAWS
    assert MaskStream(7).draws(1, 5 * CHUNK + 3, 2).tolist() == PINNED_LATER_DRAWS


PINNED_FIRST_DRAWS = [4144027521, 242046904, 2011631631, 2656154035]
PINNED_LATER_DRAWS = [1396473438, 2731306328]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dare_keeps_density_within_sampling_error(p):
    n = 1 << 22
    kept = MaskStream(5).keep(0, 0, (n,), p).sum().item() / n
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - p) < 5 * sigma, (kept, p, sigma)


def test_della_keeps_density_on_average_and_more_of_the_large_entries():
    delta = torch.randn(512, 4096, generator=torch.Generator().manual_seed(0))
    mask = keyed_merge.keep_flags(MaskStream(9), keyed_merge.Vector(1, 0, 1.0, 0.4, 0.2), 0, delta).float()
    n = delta.numel()
    assert abs(mask.mean().item() - 0.4) < 5 * math.sqrt(0.4 * 0.6 / n)
    large = delta.abs() > delta.abs().median(dim=1, keepdim=True).values
    assert mask[large].mean().item() > 0.45 > 0.35 > mask[~large].mean().item()  # ~0.5 and ~0.3 expected


# ----- the rescale and the blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocked_total_equals_total_however_cut(dtype):
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(1)).to(dtype)
    for cuts in ([0, 300_001], [0, 17, 40_000, 40_001, 299_999, 300_001], [*range(0, 300_001, 999), 300_001]):
        acc = BlockedTotal()
        for a, b in zip(cuts, cuts[1:]):
            acc.add(x[a:b])
        assert torch.equal(acc.result(), total(x)), cuts
    small = BlockedTotal()
    small.add(x[:100])
    small.add(x[100:20_000])
    assert torch.equal(small.result(), x[:20_000].sum())


@pytest.mark.parametrize("numel", [20_000, 300_001])
def test_invariant_blocked_total_does_not_depend_on_cuts_or_on_the_code_that_adds(numel, monkeypatch):
    """The device-independent total (keyed methods' L1 norms): the same bits however the tensor is cut, whether
    the compiled loop or the torch operations (what a GPU runs) add the blocks, and the exact sum to float32's
    pairwise accuracy."""
    from mergesmith.kernels import keyed_kernels, reductions

    x = torch.rand(numel, generator=torch.Generator().manual_seed(2)) * torch.logspace(-6, 0, numel)
    keyed_kernels.warm()
    totals = []
    for compiled in (True, False):
        monkeypatch.setattr(reductions, "_compiled", lambda flat, on=compiled: on)
        for cuts in ([0, numel], [0, 17, 16_384, 16_385, numel - 1, numel], [*range(0, numel, 999), numel]):
            acc = BlockedTotal(invariant=True)
            for a, b in zip(cuts, cuts[1:]):
                acc.add(x[a:b])
            totals.append(acc.result())
    assert all(t.dtype == torch.float64 and torch.equal(t, totals[0]) for t in totals)
    exact = math.fsum(x.double().tolist())
    assert abs(totals[0].item() - exact) <= 1e-6 * exact
    # numpy pieces (the compiled chunks' path), cut anywhere: a carry completed from a piece's head, pieces smaller
    # than the carry's gap, pieces that end on a block: the same bits
    for cuts in ([0, numel], [0, 17, 16_384, 16_385, numel - 1, numel], [*range(0, numel, 999), numel],
                 sorted({0, 5, 10, 16_390, 20_000, 20_001, 40_000, numel} & set(range(numel + 1)))):
        acc = BlockedTotal(invariant=True)
        for a, b in zip(cuts, cuts[1:]):
            acc.add(x[a:b].numpy().copy())
        assert torch.equal(acc.result(), totals[0]), cuts


def test_tree_block_sums_are_the_same_bits_compiled_and_in_torch(monkeypatch):
    """keyed_kernels' loop and reductions' torch operations (a GPU's path) add in the same order: equal bits on
    values of every magnitude, signs and zeros included."""
    from mergesmith.kernels import keyed_kernels, reductions

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8 * 16_384, generator=g) * torch.logspace(-30, 30, 8 * 16_384)
    x[::7] = 0.0
    keyed_kernels.warm()
    out = np.empty(8, dtype=np.float32)
    keyed_kernels.tree_block_sums(x.numpy(), 16_384, np.empty(8_192, dtype=np.float32), out)
    compiled_path = reductions.tree_block_sums(x)
    monkeypatch.setattr(reductions, "_compiled", lambda flat: False)
    torch_path = reductions.tree_block_sums(x)
    assert torch.equal(torch.from_numpy(out), torch_path) and torch.equal(compiled_path, torch_path)
    assert torch.isfinite(torch_path).all() and torch_path.abs().max() > 1e20  # the magnitudes did reach the sums


def _models(shape, dtype, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return [t.to(dtype) for t in [base] + [base + 0.01 * torch.randn(shape, generator=g) for _ in range(n - 1)]]


MODEL_PARAMS = [{}, {"weight": 0.6, "density": 0.4, "epsilon": 0.1}, {"weight": 0.4, "density": 0.7, "epsilon": 0.2}]


def _merge_in_blocks(method, tensors, step, seed=5):
    spec = get_method(method)
    params = {p.name: p.default for p in spec.params}
    rows = tensors[0].shape[0]
    width = tensors[0].numel() // rows

    def inputs(r, totals=None):
        block = [t[r : r + step] for t in tensors]
        return MergeInputs(block, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(seed), offset=r * width,
                           totals=totals)

    state = None
    for r in range(0, rows, step):
        state = spec.totals.gather(state, inputs(r))
    totals = spec.totals.finish(state)
    return torch.cat([spec.merge(inputs(r, totals)) for r in range(0, rows, step)])


@pytest.mark.parametrize("method", KEYED)
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (40, 600)), (torch.bfloat16, (40, 600)),
                                         (torch.float16, (40, 600)), (torch.float32, (20, 12, 30))])
def test_row_blocks_give_the_whole_tensors_bytes(method, dtype, shape):
    spec = get_method(method)
    assert spec.keyed_random and spec.totals is not None
    tensors = _models(shape, dtype)
    params = {p.name: p.default for p in spec.params}
    whole = spec.merge(MergeInputs(tensors, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(5)))
    for step in (1, 7, 16):
        assert torch.equal(_merge_in_blocks(method, tensors, step), whole), step
    other_seed = spec.merge(MergeInputs(tensors, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(6)))
    assert not torch.equal(other_seed, whole)


@pytest.mark.parametrize("method", KEYED)
def test_chunks_of_any_size_and_alignment_give_the_same_bytes(method, monkeypatch):
    """The merge computes a block in chunks (flat ranges cut at multiples of CHUNK_ELEMENTS of the tensor for
    DARE, whole rows for DELLA); however small the chunks and wherever a row block starts inside one, the bytes
    are those of the whole tensor in one chunk."""
    spec = get_method(method)
    tensors = _models((60, 333), torch.bfloat16)  # rows of 333 entries: blocks start mid-chunk
    params = {p.name: p.default for p in spec.params}
    whole = spec.merge(MergeInputs(tensors, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(5)))
    for chunk in (1000, 4096, 777):
        monkeypatch.setattr(keyed_merge, "CHUNK_ELEMENTS", chunk)
        for step in (60, 7, 13):
            assert torch.equal(_merge_in_blocks(method, tensors, step), whole), (chunk, step)


def test_flat_chunks_start_at_multiples_of_the_chunk_size_of_the_tensor():
    """So every flat chunk but a block's first and last covers whole keyed chunks of draws."""
    size = keyed_merge.CHUNK_ELEMENTS
    pieces = keyed_merge.pieces((100, 5632), 3 * 5632, by_rows=False)
    starts = [3 * 5632 + p.start for p in pieces]
    assert all(start % size == 0 for start in starts[1:])
    assert pieces[0].start == 0 and pieces[-1].end == 100 * 5632
    assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
    assert all(0 < p.end - p.start <= size for p in pieces)
    rows = keyed_merge.pieces((100, 5632), 0, by_rows=True)  # DELLA: whole rows
    assert all(p.start % 5632 == 0 and p.end % 5632 == 0 for p in rows)


def _invariant_l1(t: torch.Tensor) -> float:
    acc = BlockedTotal(invariant=True)
    acc.add(t.abs())
    return float(acc.result())


def test_rescale_keeps_each_task_vectors_l1_norm_exactly_as_the_formula_says():
    """dare_linear of one task vector with weight 1: out - base is the rescaled kept delta, whose L1 norm is the
    delta's (to float rounding), and whose entries are the delta's times one factor |d|_1 / |m d|_1."""
    base, tuned = _models((256, 1024), torch.float32, n=2)
    spec = get_method("dare_linear")
    params = {p.name: p.default for p in spec.params}
    mp = [{}, {"weight": 1.0, "density": 0.3}]
    out = spec.merge(MergeInputs([base, tuned], 0, mp, params, None, "t", stream=MaskStream(2)))
    delta = tuned - base
    kept = out - base
    mask = keyed_merge.keep_flags(MaskStream(2), keyed_merge.Vector(1, 0, 1.0, 0.3), 0, delta).float()
    factor = np.float32(_invariant_l1(delta) / _invariant_l1(delta * mask))  # the norms' ratio, rounded once to float32
    assert torch.equal(out, base + delta * mask * float(factor))
    assert kept.abs().sum().item() == pytest.approx(delta.abs().sum().item(), rel=1e-4)
    assert (kept != 0).float().mean().item() == pytest.approx(0.3, abs=0.01)


# ----- end to end: the executor ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_models(tiny_models):
    base = tiny_models("llama", seed=21)
    return base, tiny_models.derive(base, seed=22, scale=0.02), tiny_models.derive(base, seed=23, scale=0.02)


def _run(method, models, out: Path, *, threads=1, max_memory=None, stop_after=None, shard=40_000):
    from mergesmith.config import parse_config
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import RunControls, run_merge

    base, a, b = models
    eps = method.startswith("della")
    cfg = parse_config(
        {
            "merge_method": method,
            "base_model": str(base),
            "models": [
                {"model": str(a), "parameters": {"weight": 0.6, "density": 0.4} | ({"epsilon": 0.1} if eps else {})},
                {"model": str(b), "parameters": {"weight": 0.4, "density": 0.7} | ({"epsilon": 0.2} if eps else {})},
            ],
        }
    )
    options = MergeOptions(
        random_seed=3, threads=threads, max_memory=max_memory, copy_tokenizer=False, write_model_card=False,
        out_shard_size=shard,
    )
    stop = threading.Event()
    done = [0]

    def progress(event):
        if event.recipe is not None:
            done[0] += 1
            if stop_after is not None and done[0] >= stop_after:
                stop.set()

    run_merge(cfg, out, options, controls=RunControls(on_progress=progress, stop=stop))
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("method", ["dare_ties", "della"])
def test_same_bytes_whole_blocked_threads_budget_and_resume(method, three_models, tmp_path, monkeypatch):
    from mergesmith.engine.execution import local_executor as executor
    from mergesmith.errors import MergeInterrupted

    whole = _run(method, three_models, tmp_path / "whole")
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1024)  # the tiny embedding (256 x 32) now takes 8 blocks
    passes: list[str] = []
    gather = executor.LocalExecutor._gather_totals
    monkeypatch.setattr(
        executor.LocalExecutor, "_gather_totals", lambda self, r, b: passes.append(r.name) or gather(self, r, b)
    )
    assert _run(method, three_models, tmp_path / "blocked") == whole
    assert "model.embed_tokens.weight" in passes  # it really ran in row blocks, with a totals pass
    assert _run(method, three_models, tmp_path / "threads", threads=2) == whole
    assert _run(method, three_models, tmp_path / "budget", threads=2, max_memory=200_000) == whole
    resumed = tmp_path / "resumed"
    with pytest.raises(MergeInterrupted):
        _run(method, three_models, resumed, stop_after=3)
    assert _run(method, three_models, resumed) == whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("method", KEYED)
def test_keyed_masks_are_drawn_on_the_device_with_the_cpu_bits(method):
    """On CUDA the stream draws on the device (kernels/keyed_random_torch.py) and keeps exactly the CPU's entries,
    so the result agrees with the CPU's to float rounding (the device's reductions add in another order)."""
    spec = get_method(method)
    params = {p.name: p.default for p in spec.params}
    tensors = _models((64, 300), torch.float32)
    delta = tensors[1] - tensors[0]
    vector = keyed_merge.Vector(1, 0, 1.0, 0.4, 0.1 if method.startswith("della") else None)
    on_gpu = keyed_merge.keep_flags(MaskStream(4), vector, 77, delta.cuda())
    assert on_gpu is not None and on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), keyed_merge.keep_flags(MaskStream(4), vector, 77, delta))

    def on(device: str) -> torch.Tensor:
        moved = [t.to(device) for t in tensors]
        return spec.merge(MergeInputs(moved, 0, MODEL_PARAMS, params, None, "t", stream=MaskStream(4)))

    gpu = on("cuda")
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), on("cpu"), rtol=1e-4, atol=1e-5)


# ----- the float32 arithmetic (keyed_merge.py) ------------------------------------------------------------------


def _reference_mix(tensors, masks, weights, factors, consensus, normalize):
    """The family's formula in float64 with torch.where, on given keep masks and per-vector multipliers."""
    base = tensors[0].double()
    ws = torch.stack([(x.double() - base) * m.double() * f for x, m, f in zip(tensors[1:], masks, factors)])
    w = torch.tensor(weights, dtype=torch.float64).view(-1, 1, 1)
    if consensus is None:
        mixed = ws.sum(0)
        return base + (mixed / sum(weights) if normalize else mixed)
    votes = ws.sum(0) if consensus == "sum" else ws.sign().sum(0)
    keep = torch.where(votes >= 0, ws > 0, ws < 0)
    mixed = (ws * keep).sum(0)
    if normalize:
        divisor = (w * keep).sum(0)
        mixed = mixed / torch.where(divisor == 0, 1.0, divisor)
    return base + mixed


@pytest.mark.parametrize("consensus", [None, "sum", "count"])
@pytest.mark.parametrize("normalize", [False, True])
def test_float32_mix_is_the_formula_rounded_once(consensus, normalize):
    """keyed_merge's in-place float32 mix (positive and negative sums picked by lerp, weights of the elected side)
    agrees with a float64 evaluation of the formula with torch.where on the same masks, to float32 rounding."""
    tensors = _models((64, 300), torch.float32, n=4, seed=3)
    vectors = [keyed_merge.Vector(i, i - 1, w, d) for i, w, d in ((1, 0.6, 0.4), (2, 0.3, 0.7), (3, 0.5, 0.5))]
    mix = keyed_merge.Mix(consensus, normalize, False, 1.0)
    out = keyed_merge.merge(tensors, 0, vectors, mix, MaskStream(8), 0, None)
    masks = [keyed_merge.keep_flags(MaskStream(8), v, 0, tensors[0]) for v in vectors]
    ref = _reference_mix(tensors, masks, [v.weight for v in vectors], [v.weight for v in vectors], consensus,
                         normalize)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-6)


def test_della_ranks_break_ties_by_column():
    """Equal magnitudes rank in column order: with all |d| equal, the keep threshold rises along each row."""
    delta = torch.full((1, 4096), 0.5)
    delta[0, ::2] = -0.5  # signs do not matter, magnitudes do
    vec = keyed_merge.Vector(1, 0, 1.0, 0.5, 0.4)
    kept = keyed_merge.keep_flags(MaskStream(1), vec, 0, delta).float().view(-1)
    assert kept[:1024].mean().item() < 0.25 < 0.75 < kept[-1024:].mean().item()  # ~0.15 and ~0.85 expected
