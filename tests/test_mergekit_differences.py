"""Where mergesmith deliberately differs from mergekit 0.1.5 (issue 16 item 4), one test per difference.

Each test computes both behaviours itself, without mergekit: ours through mergesmith's own code, and
mergekit's as its documented arithmetic (the measurements against mergekit itself, on 1M-entry tensors,
are `tests/reference/measure_differences.py`, summarised in the README section "Where outputs equal
mergekit's"). Each fails if mergesmith's behaviour changes toward, or away from, what the README says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mergesmith.kernels import reductions
from tests.helpers import read_state_dict

MILLION = 1 << 20


def _rel_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    return abs(x.double().item() - exact.item()) / abs(exact.item())


# ----- reductions -----------------------------------------------------------------------------------


def test_bf16_dot_accumulates_in_float32_like_torch_dot() -> None:
    """Karcher's <mean, u> on bf16 tensors above DOT_SERIAL_MAX entries: products and sums in float32,
    rounded once (as torch.dot, which mergekit calls, does). Rounding each product to bf16 first (the
    old blocked path) is off by far more than one bf16 step where the terms cancel."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(MILLION, generator=g).bfloat16()
    c = torch.randn(MILLION, generator=g).double()
    c -= (c @ a.double()) / (a.double() @ a.double()) * a.double()  # nearly orthogonal: the terms cancel
    b = c.bfloat16()
    exact = torch.dot(a.double(), b.double())
    ours = reductions.dot(a, b)
    assert ours.dtype == torch.bfloat16
    assert ours.item() == exact.bfloat16().item()  # float32 accumulation, rounded once: the nearest bf16
    assert ours.item() == torch.dot(a, b).item()
    rounded_products = reductions.total(a * b)
    assert _rel_err(rounded_products, exact) > 20 * _rel_err(ours, exact)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert reductions.dot(a, b).item() == ours.item()
    finally:
        torch.set_num_threads(threads)


def test_blocked_float32_reductions_are_closer_to_float64_than_torchs() -> None:
    """Above ATen's grain size mergesmith reduces in fixed blocks (bits independent of the thread count),
    so it is not bit-equal to mergekit's torch.linalg.vector_norm / torch.dot there; measured against
    float64, the blocked norm and dot product are the more accurate ones."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(MILLION + 777, generator=g) * 0.02 + 0.001
    b = torch.randn(MILLION + 777, generator=g) * 0.02 + 0.001
    norm64, dot64 = a.double().norm(), torch.dot(a.double(), b.double())
    ours_norm, torch_norm = reductions.l2(a), torch.linalg.vector_norm(a)
    ours_dot, torch_dot = reductions.dot(a, b), torch.dot(a, b)
    assert ours_norm.item() != torch_norm.item() and ours_dot.item() != torch_dot.item()  # not bit-equal
    assert _rel_err(ours_norm, norm64) < _rel_err(torch_norm, norm64) / 10
    assert _rel_err(ours_dot, dot64) < _rel_err(torch_dot, dot64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert reductions.l2(a).item() == ours_norm.item() and reductions.dot(a, b).item() == ours_dot.item()
    finally:
        torch.set_num_threads(threads)


def test_small_reductions_are_torchs_own() -> None:
    """Below the grain size (where the reference fixtures live) the reductions are torch's serial ones,
    which is why the fixtures are bit-equal."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4000, generator=g), torch.randn(4000, generator=g)
    assert torch.equal(reductions.l2(a), torch.linalg.vector_norm(a))
    assert torch.equal(reductions.dot(a, b), torch.dot(a, b))
    assert torch.equal(reductions.dot(a.bfloat16(), b.bfloat16()), torch.dot(a.bfloat16(), b.bfloat16()))


# ----- output dtypes ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_models: Any) -> tuple[Path, Path]:
    return tiny_models("llama", seed=1), tiny_models("llama", seed=2)


def _merge(tmp_path: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_merge(path, tmp_path / "out", MergeOptions(threads=1))
    return read_state_dict(tmp_path / "out")


def test_bfloat16_output_of_float32_inputs_rounds_inputs_first_like_mergekit(tmp_path: Path, pair: Any) -> None:
    """`dtype: bfloat16` on float32 inputs: like mergekit, mergesmith casts every input to bf16 first
    (the config's dtype is the compute dtype) and linear then sums those in float32; measured bit-equal
    to mergekit on 1M-entry tensors. Summing the float32 inputs instead (one rounding, at the end) gives
    other bytes: both computed here, so a change of either behaviour shows."""
    a, b = pair
    out = _merge(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.7}},
                {"model": str(b), "parameters": {"weight": 0.3}},
            ],
            "dtype": "bfloat16",
        },
    )
    ins_a, ins_b = read_state_dict(a), read_state_dict(b)

    def weighted(xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:  # both programs' float32 average
        out = torch.zeros_like(xa, dtype=torch.float32)
        out.addcmul_(xa.float(), torch.tensor(0.7)).addcmul_(xb.float(), torch.tensor(0.3))
        return out.div_(torch.tensor([0.7, 0.3]).sum()).bfloat16()

    differs = 0
    for name, got in out.items():
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, weighted(ins_a[name].bfloat16(), ins_b[name].bfloat16())), name
        differs += int((weighted(ins_a[name], ins_b[name]) != got).sum())  # float32 inputs, one rounding
    assert differs > 0


def test_arcee_fusion_writes_the_configured_dtype(tmp_path: Path, pair: Any) -> None:
    """arcee_fusion with `dtype: bfloat16` writes bf16 tensors (mergekit 0.1.5 writes float32 for this
    method whatever `dtype` says: its fused tensor leaves the method as float32 and is not cast back)."""
    a, b = pair
    out = _merge(
        tmp_path,
        {"merge_method": "arcee_fusion", "base_model": str(a), "models": [{"model": str(b)}], "dtype": "bfloat16"},
    )
    assert {t.dtype for t in out.values()} == {torch.bfloat16}


# ----- MoE `hidden` gates ----------------------------------------------------------------------------


def test_moe_hidden_gates_run_the_base_in_its_own_dtype(tmp_path: Path, tiny_models: Any, monkeypatch: Any) -> None:
    """mergekit-moe runs the base model in bfloat16 for `hidden` gates; mergesmith runs it in its own
    dtype (float32 here): the router rows are the float32 residual states, measurably not the bf16 ones."""
    from transformers import AutoModelForCausalLM

    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.moe import run_moe

    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))
    base, other = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    prompts = [["tok10 tok11 tok12"], ["tok60 tok61"]]
    cfg = tmp_path / "moe.yml"
    experts = [{"source_model": str(m), "positive_prompts": p} for m, p in zip((base, other), prompts)]
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "gate_mode": "hidden", "experts": experts}))
    run_moe(cfg, tmp_path / "out", MergeOptions())
    state = read_state_dict(tmp_path / "out")

    def rows(dtype: torch.dtype) -> list[torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype).eval()
        result = []
        for (prompt,) in prompts:
            ids = torch.tensor([[1] + [int(w.removeprefix("tok")) for w in prompt.split()]])
            with torch.no_grad():
                hidden = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states[:-1])[:, 0, -1]
            hidden = hidden.float()
            result.append(hidden / hidden.norm(dim=-1, keepdim=True))
        return result

    own, bf16 = rows(torch.float32), rows(torch.bfloat16)
    far_from_bf16 = 0.0
    for e in range(2):
        for layer in range(own[e].shape[0]):
            got = state[f"model.layers.{layer}.block_sparse_moe.gate.weight"][e].float()
            torch.testing.assert_close(got, own[e][layer], rtol=1e-4, atol=1e-5)
            far_from_bf16 = max(far_from_bf16, (got - bf16[e][layer]).abs().max().item())
    assert far_from_bf16 > 1e-3
