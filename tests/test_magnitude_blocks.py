"""TIES and Breadcrumbs in row blocks (kernels/magnitude_blocks.py) write the whole-tensor merge's bytes.

The selection of each whole task vector's top-k (or middle band of) magnitudes moved into a totals pass, so a
large tensor merges block by block (issue 17: TIES under `--max-memory 300MB`). The whole-tensor path is bit-equal
to mergekit (tests/test_mergekit_reference.py); what must hold here is that the blocked path gives exactly its
bytes however the tensor is cut, in bf16 with many equal magnitudes at the threshold (where *which* ties survive
depends on replaying torch's sort) and in float32, and that the executor really runs it in blocks, within a
budget its memory estimate now admits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mergesmith.engine.execution import blocks
from mergesmith.kernels import sort_select
from mergesmith.methods import get_method
from mergesmith.methods.registry import MergeInputs

RANKED = ("ties", "breadcrumbs", "breadcrumbs_ties")


def _models(shape, dtype, n=3, seed=0, ties=False):
    """A base and n - 1 fine-tunes; with `ties`, deltas from a handful of values: many equal magnitudes."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(dtype)
    out = [base]
    for _ in range(n - 1):
        if ties:
            step = torch.randint(-3, 4, shape, generator=g).to(dtype) * 2.0**-6
            out.append((base.float() + step.float()).to(dtype))
        else:
            out.append((base.float() + 0.01 * torch.randn(shape, generator=g)).to(dtype))
    return out


def _params(method, rescale, densities=(0.4, 0.7)):
    spec = get_method(method)
    params = {p.name: p.default for p in spec.params} | {"rescale": rescale}
    models = [{}] + [{"weight": w, "density": d, "gamma": 0.05} for w, d in zip((0.6, 0.4, 0.3), densities)]
    return spec, params, models


def _blocked(method, tensors, step, rescale, densities=(0.4, 0.7), whole_numel=True):
    spec, params, models = _params(method, rescale, densities)
    rows = tensors[0].shape[0]
    width = tensors[0].numel() // rows

    def inputs(r, totals=None):
        block = [t[r : r + step] for t in tensors]
        return MergeInputs(block, 0, models, params, None, "t", offset=r * width, totals=totals,
                           whole_numel=tensors[0].numel() if whole_numel else 0)

    state = None
    for r in range(0, rows, step):
        state = spec.totals.gather(state, inputs(r))
    totals = spec.totals.finish(state)
    return torch.cat([spec.merge(inputs(r, totals)) for r in range(0, rows, step)])


def _whole(method, tensors, rescale, densities=(0.4, 0.7)):
    spec, params, models = _params(method, rescale, densities)
    return spec.merge(MergeInputs([t.clone() for t in tensors], 0, models, params, None, "t"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("method", RANKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rescale", [False, True])
def test_row_blocks_give_the_whole_tensors_bytes(method, dtype, rescale):
    """Above sort_select's replay threshold (120k entries), with ties at the threshold for the 16-bit dtypes."""
    tensors = _models((300, 400), dtype, ties=dtype != torch.float32)
    whole = _whole(method, tensors, rescale)
    for step in (1, 7, 64):
        assert _same_bits(_blocked(method, tensors, step, rescale), whole), step
    assert _same_bits(_blocked(method, tensors, 64, rescale, whole_numel=False), whole)


def test_the_blocked_selection_breaks_ties_as_the_sort_does():
    """The bf16 case is meaningful: the threshold falls inside a run of equal magnitudes, and a different choice
    among them (what a stable sort would keep) changes the output."""
    tensors = _models((300, 400), torch.bfloat16, ties=True)
    delta = (tensors[1] - tensors[0]).abs().reshape(-1)
    k = int(0.4 * delta.numel())
    threshold = delta.float().sort(descending=True).values[k - 1]
    assert int((delta.float() == threshold).sum()) > 1000  # many ties straddle the cut
    whole = _whole("ties", tensors, False)
    stable = torch.zeros(delta.numel(), dtype=torch.bool)
    stable[delta.float().sort(descending=True, stable=True).indices[:k]] = True
    unstable = sort_select.sorted_window_mask(delta, 0, k, True)
    assert not torch.equal(stable, unstable)
    assert _same_bits(_blocked("ties", tensors, 13, False), whole)


@pytest.mark.parametrize("densities", [(1.0, 0.5), (0.0, 0.5), (-0.5, 1.5)])
@pytest.mark.parametrize("method", RANKED)
def test_densities_that_keep_or_drop_everything(method, densities):
    tensors = _models((300, 400), torch.bfloat16, seed=3)
    whole = _whole(method, tensors, True, densities)
    assert _same_bits(_blocked(method, tensors, 50, True, densities), whole)


def test_small_tensors_every_replay_branch(monkeypatch):
    """Tiny tensors, with the replay forced on and its blocks shrunk, cut at rows whose offsets are not whole
    bytes of the packed masks (rows of 7 entries)."""
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 0)
    monkeypatch.setattr(sort_select, "_BLOCK", 61)
    monkeypatch.setattr(sort_select, "_SWAP_CHUNK", 17)
    for seed, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16) * 3):
        tensors = _models((129, 7), dtype, n=4, seed=seed, ties=dtype != torch.float32)
        for method in RANKED:
            whole = _whole(method, tensors, seed % 2 == 0, (0.3, 0.5, 0.9))
            for step in (1, 5, 40):
                assert _same_bits(_blocked(method, tensors, step, seed % 2 == 0, (0.3, 0.5, 0.9)), whole), (
                    seed, method, step)


# ----- end to end: the executor ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_models(tiny_models):
    base = tiny_models("llama", seed=41)
    return base, tiny_models.derive(base, seed=42, scale=0.02), tiny_models.derive(base, seed=43, scale=0.02)


def _run(method, models, out: Path, dtype: str, *, threads=1, max_memory=None):
    from mergesmith.config import parse_config
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    base, a, b = models
    cfg = parse_config(
        {
            "merge_method": method,
            "base_model": str(base),
            "dtype": dtype,
            "models": [
                {"model": str(a), "parameters": {"weight": 0.6, "density": 0.4, "gamma": 0.02}},
                {"model": str(b), "parameters": {"weight": 0.4, "density": 0.7, "gamma": 0.02}},
            ],
        }
    )
    options = MergeOptions(threads=threads, max_memory=max_memory, copy_tokenizer=False, write_model_card=False)
    run_merge(cfg, out, options)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("method,dtype", [("ties", "bfloat16"), ("ties", "float32"), ("breadcrumbs_ties", "bfloat16")])
def test_executor_blocks_ranked_tensors_with_the_same_bytes(method, dtype, three_models, tmp_path, monkeypatch):
    from mergesmith.engine.execution import local_executor as executor

    whole = _run(method, three_models, tmp_path / "whole", dtype)
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1024)  # the tiny embedding (256 x 32) now takes 8 blocks
    passes: list[str] = []
    gather = executor.LocalExecutor._gather_totals
    monkeypatch.setattr(
        executor.LocalExecutor, "_gather_totals", lambda self, r, b: passes.append(r.name) or gather(self, r, b)
    )
    assert _run(method, three_models, tmp_path / "blocked", dtype) == whole
    assert "model.embed_tokens.weight" in passes  # it really ran in row blocks, with a totals pass
    assert _run(method, three_models, tmp_path / "budget", dtype, threads=2, max_memory=200_000) == whole


def test_zero_magnitudes_at_the_cut_are_left_out_with_the_same_bytes(monkeypatch):
    """A bf16 task vector is often mostly exact zeros, and TIES' cut then lies among them: sort_select leaves the
    zeros' choice free there (no replay to follow them), which changes the mask but not one output byte."""
    from mergesmith.kernels import selection as sparsify

    g = torch.Generator().manual_seed(9)
    base = torch.randn(400, 400, generator=g).bfloat16()
    step = torch.randint(-2, 3, (400, 400), generator=g).bfloat16() * 2.0**-6
    step[torch.rand(400, 400, generator=g) < 0.6] = 0  # 60% unchanged entries
    tensors = [base, (base.float() + step.float()).bfloat16(), (base.float() - step.float() * 0.5).bfloat16()]
    delta = (tensors[1] - tensors[0]).abs().reshape(-1)
    k = int(0.5 * delta.numel())
    exact = sort_select.sorted_window_mask(delta, 0, k, True)
    free = sort_select.sorted_window_mask(delta, 0, k, True, zeros_free=True)
    assert not torch.equal(exact, free) and torch.equal(exact[delta != 0], free[delta != 0])
    cases = [(method, rescale) for method in RANKED for rescale in (False, True)]
    freed = {case: _whole(*case[:1], tensors, case[1], (0.5, 0.7)) for case in cases}
    for case in cases:
        assert _same_bits(_blocked(case[0], tensors, 33, case[1], (0.5, 0.7)), freed[case]), case
    original = sort_select.sorted_window_mask
    monkeypatch.setattr(sparsify, "sorted_window_mask", lambda *a, zeros_free=False, **kw: original(*a, **kw))
    for case in cases:  # the whole-tensor merge with the sort's exact choice among the zeros
        assert _same_bits(_whole(case[0], tensors, case[1], (0.5, 0.7)), freed[case]), case


def test_the_estimate_admits_the_bench_embedding_under_300mb():
    """Issue 17's case, by the executor's accounting: the 0.25b bench set's embedding (32000 x 1024, bf16,
    a base and two task vectors) under `--max-memory 300MB` was estimated (and used) at about 1 GB whole; blocked,
    its estimate is below the budget, so it no longer runs alone over it."""
    from mergesmith.engine.plan import InputRef, TensorRecipe
    from mergesmith.engine.planning.shared import recipe_memory

    spec = get_method("ties")
    recipe = TensorRecipe(
        "model.embed_tokens.weight", (32000, 1024), "BF16", "merge",
        tuple(InputRef(f"m{i}", "model.embed_tokens.weight") for i in range(3)), "ties", 0,
        tuple(tuple(({"weight": 0.5, "density": 0.5} if i else {}).items()) for i in range(3)),
        tuple({p.name: p.default for p in spec.params}.items()), None,
    )
    assert blocks.two_pass(recipe)
    assert 200e6 < recipe_memory(recipe, "BF16") < 300e6


def test_a_replay_that_gives_up_merges_the_tensor_whole(three_models, tmp_path, monkeypatch):
    """The blocked selection reorders the only copy of the magnitudes; where the replay gives up (a spent depth
    budget: adversarial input, forced here) the executor merges that tensor whole instead, with the same bytes."""
    from mergesmith.engine.execution import local_executor as executor

    whole = _run("ties", three_models, tmp_path / "whole", "bfloat16")
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 1024)
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 0)
    monkeypatch.setattr(sort_select, "depth_budget", lambda n: 0)
    written: list[tuple[str, bool]] = []
    compute_block = executor.LocalExecutor._compute_block

    def spy(self, recipe, rows, put, whole=False, totals=None):
        written.append((recipe.name, whole))
        return compute_block(self, recipe, rows, put, whole=whole, totals=totals)

    monkeypatch.setattr(executor.LocalExecutor, "_compute_block", spy)
    passes: list[str] = []
    gather = executor.LocalExecutor._gather_totals
    monkeypatch.setattr(
        executor.LocalExecutor, "_gather_totals", lambda self, r, b: passes.append(r.name) or gather(self, r, b)
    )
    assert _run("ties", three_models, tmp_path / "blocked", "bfloat16") == whole
    assert "model.embed_tokens.weight" in passes  # the blocked pass was tried ...
    assert ("model.embed_tokens.weight", True) in written  # ... and the tensor then merged whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("method", RANKED)
def test_row_blocks_on_a_cuda_device_give_the_whole_tensors_bytes(method):
    """On another device the selection is that device's full sort, whole or from the gathered magnitudes."""
    tensors = [t.cuda() for t in _models((300, 400), torch.bfloat16, ties=True)]
    whole = _whole(method, tensors, False)
    assert whole.device.type == "cuda"
    assert _same_bits(_blocked(method, tensors, 64, False).cpu(), whole.cpu())
