"""The device options of `tokensurgeon`, `extract-lora`, `evolve` and `moe`, run end to end on a CUDA GPU
(issue 33, item 5).

Each test runs one command the way a user does (the CLI, in-process) twice on the same small fixtures, once on
the CPU and once on the device under test, and checks that the device run used the GPU and exited 0, that its
results are the CPU run's within a tolerance stated (and justified) beside each comparison, and that the output
loads with transformers and gives finite logits. A last test solves, with device tensors, the rank-deficient
least-squares systems of tokensurgeon's common_interpolation and regmean (runtime.devices.min_norm_lstsq).

Without a GPU the tests skip. `MERGESMITH_TEST_DEVICE=cpu` runs them anyway with the CPU as the device under
test: that proves the commands, the comparisons and the assertions on a machine without a GPU, and leaves out
only the check that the GPU was used (`_assert_used_gpu`). bench/gpu_check.py runs this file on its GPU machine
(it selects test files that mention CUDA, and bench/cuda_select.py the tests whose skip reason names it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import finite_logits, load_causal_lm, read_state_dict, run_cli

DEVICE_ENV = "MERGESMITH_TEST_DEVICE"


def _device_under_test() -> str:
    """The device the second run of every test uses: cuda, or what $MERGESMITH_TEST_DEVICE names (cpu to
    check the tests themselves on a machine without a GPU)."""
    return os.environ.get(DEVICE_ENV) or "cuda"


DEVICE = _device_under_test()
ON_CUDA = DEVICE.startswith("cuda")
BF16_ULP = 2.0**-7
"""The largest gap between neighbouring bfloat16 values, relative to the smaller one (8 significant bits): two
float32 results a few float32 ulps apart can round to neighbouring bfloat16 values, never further apart."""

pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU ({DEVICE_ENV}=cpu runs the same checks on the CPU)",
)


def _allocated_bytes() -> int:
    """Bytes the CUDA caching allocator has handed out since the process started (a running total, so memory
    that earlier tests still hold does not count as this command's, as torch.cuda.max_memory_allocated would);
    0 before anything initialised CUDA."""
    if not ON_CUDA or not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize(DEVICE)
    return int(torch.cuda.memory_stats(DEVICE).get("allocated_bytes.all.allocated", 0))


def _run(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[str, int]:
    """Run `mergesmith ARGS` in-process; assert exit 0; return its stdout and the GPU bytes it allocated."""
    before = _allocated_bytes()
    code, out, err = run_cli(capsys, *args)
    assert code == 0, f"mergesmith {' '.join(map(str, args))} exited {code}:\n{err}"
    return out, _allocated_bytes() - before


def _assert_used_gpu(allocated: int, command: str) -> None:
    """The device run put tensors on the GPU. The one check left out when the device under test is the CPU
    ($MERGESMITH_TEST_DEVICE=cpu): there is nothing to observe then."""
    if not ON_CUDA:
        return
    assert allocated > 0, f"`mergesmith {command} ... {DEVICE}` allocated nothing on the GPU"


def _named(name: str) -> Callable[[str], str]:
    """torch.testing.assert_close's message with the tensor's name in front (the mismatch counts kept)."""
    return lambda message: f"{name}: {message}"


def _runs() -> tuple[tuple[str, str], tuple[str, str]]:
    """(name, device) of the reference run and of the run under test."""
    return ("cpu", "cpu"), ("device", DEVICE)


# ----- tokensurgeon --device ---------------------------------------------------------------------------
def test_tokensurgeon_cuda_rows_match_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OMP (the approximation of the 500 tokens the base lacks) runs on the device; every other row and tensor
    is the base's bytes whatever the device."""
    from tests.test_tokensurgeon import BASE, DONOR, EMBED, HEAD

    # Both devices must pick the same atoms, or rows legitimately differ by ~0.1. Over the 4 steps of all 500
    # targets the best atom's |correlation| beats the second best by at least 1e-4 (relative, measured), 100x
    # the float32 noise of a correlation (~1e-6); at k=16 the smallest gap is 9e-6, too close to call, and
    # past the donor's hidden size (48) the later picks are rounding noise (at k=64 every row differs
    # between two orders of summation).
    k = 4
    outs: dict[str, dict[str, torch.Tensor]] = {}
    for name, device in _runs():
        out = tmp_path / name
        _, allocated = _run(capsys, "tokensurgeon", BASE, DONOR, out, "--k", str(k), "--device", device, "-q")
        outs[name] = read_state_dict(out)
        finite_logits(load_causal_lm(out), (1, 5, 600, 1700, 2))
    _assert_used_gpu(allocated, "tokensurgeon --device")
    cpu, dev = outs["cpu"], outs["device"]
    assert cpu.keys() == dev.keys()
    for name, tensor in cpu.items():
        assert dev[name].dtype == tensor.dtype and dev[name].shape == tensor.shape, name
        if name not in (EMBED, HEAD):
            assert torch.equal(dev[name], tensor), name
            continue
        # The rows are solved in float32 and rounded once to the base's bfloat16. Solved in float64 instead,
        # they move by at most 1.5e-5 (k=4), a bound on what two float32 implementations can disagree by (each
        # is that close to the exact rows); rounding can then put a value one bfloat16 step (BF16_ULP relative)
        # away. atol 3e-4 is 20x that spread and 0.1% of the rows' largest value (0.32), far below what a wrong
        # atom or coefficient does (~0.1).
        torch.testing.assert_close(dev[name].float(), tensor.float(), rtol=BF16_ULP, atol=3e-4, msg=_named(name))
        # Only the 500 approximated rows may differ at all: the rest are the base's rows, copied bytes.
        differ = int((dev[name] != tensor).any(dim=1).sum())
        assert differ <= 500, f"{name}: {differ} rows differ"


# ----- extract-lora --device ----------------------------------------------------------------------------
def _lora_products(adapter: Path) -> dict[str, torch.Tensor]:
    """B @ A (float64) of every factored module, by module name: the update PEFT adds. The factors themselves are not
    comparable across devices (an SVD's singular vectors may come back with opposite signs)."""
    from safetensors.torch import load_file

    from mergesmith.io.lora_adapter import PEFT_PREFIX

    tensors = load_file(adapter / "adapter_model.safetensors")
    return {
        name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight"): (
            tensors[name.replace("lora_A", "lora_B")].double() @ tensor.double()
        )
        for name, tensor in tensors.items()
        if name.endswith(".lora_A.weight")
    }


def test_extract_lora_cuda_update_matches_cpu(
    tiny_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The SVDs run on the device; the rank-8 updates B @ A match the CPU's, the modules saved whole are the
    fine-tune's bytes, and the adapter applied to the base gives finite logits."""
    from mergesmith.io.references import open_checkpoint

    base = tiny_models("llama", seed=0, layers=2)
    ft = tiny_models.derive(base, seed=11, scale=0.02)
    rank = 8
    adapters: dict[str, Path] = {}
    for name, device in _runs():
        adapters[name] = tmp_path / name
        args = ["--model", ft, "--base", base, "--out", adapters[name], "--max-rank", str(rank), "--device", device]
        out, allocated = _run(capsys, "extract-lora", *args, "-q")
        assert "low-rank modules" in out
    _assert_used_gpu(allocated, "extract-lora --device")
    configs = {n: json.loads((p / "adapter_config.json").read_text()) for n, p in adapters.items()}
    assert configs["device"] == configs["cpu"] and configs["cpu"]["r"] == rank
    cpu, dev = _lora_products(adapters["cpu"]), _lora_products(adapters["device"])
    assert cpu.keys() == dev.keys() and len(cpu) == 14  # 7 linear layers x 2 layers
    fine, plain = read_state_dict(ft), read_state_dict(base)
    for module, product in cpu.items():
        # A truncated SVD's product is unique while s[r-1] > s[r]; here that gap is >= 0.6% of s[0], and the
        # float32 products of the CPU's SVD against a float64 SVD (and against the same SVD of the columns
        # reordered) differed by at most 1.5e-6. atol 1e-4 leaves that 60x room for another SVD algorithm,
        # and is 0.13% of the largest entry of an update (0.08).
        delta = fine[f"{module}.weight"].double() - plain[f"{module}.weight"].double()
        s = torch.linalg.svdvals(delta)
        assert (s[rank - 1] - s[rank]) / s[0] > 5e-3, f"{module}: rank {rank} cuts between near-equal values"
        torch.testing.assert_close(dev[module], product, rtol=0, atol=1e-4, msg=_named(module))
    whole = {n: t for n, t in read_state_dict(adapters["cpu"]).items() if "lora_" not in n}
    assert whole, "the embedding and lm_head travel whole (modules_to_save)"
    for name, tensor in read_state_dict(adapters["device"]).items():
        if "lora_" not in name:
            assert torch.equal(tensor, whole[name]), name
    # the adapter applied to the base (mergesmith's `base+adapter` input, checked against PEFT in test_lora.py)
    model = load_causal_lm(base)
    adapted = open_checkpoint(f"{base}+{adapters['device']}")
    model.load_state_dict({n: adapted.get(n) for n in adapted.tensors}, strict=True)
    finite_logits(model)


# ----- evolve --device / --merge-cuda --------------------------------------------------------------------
def test_evolve_cuda_scores_and_merges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One generation of two candidates (seed fixed), scored on the device and merged there (--merge-cuda),
    then the best merged (--merge-best). The first generation's genomes depend on the seed alone, so both runs
    merge the same two candidates: their tensors must match the CPU's, whatever each run scored."""
    pytest.importorskip("cma", reason="cma is not installed (pip install 'mergesmith[evolve]')")
    import yaml

    import mergesmith.engine.run as engine_run
    from mergesmith.evolve import candidates
    from tests.test_evolve import genome_doc, write_genome

    merged: list[tuple[str, dict[str, torch.Tensor]]] = []  # (device, state) of each candidate, in order
    best_devices: list[str] = []
    merge_in_memory, run_merge = candidates.merge_in_memory, engine_run.run_merge

    def recording_merge(plan: Any, checkpoints: Any, device: str = "cpu") -> dict[str, torch.Tensor]:
        state = merge_in_memory(plan, checkpoints, device)
        merged.append((str(device), {n: t.clone() for n, t in state.items()}))
        return state

    def recording_run_merge(*args: Any, **kw: Any) -> Any:
        best_devices.append(str(args[2].device))
        return run_merge(*args, **kw)

    monkeypatch.setattr(candidates, "merge_in_memory", recording_merge)
    monkeypatch.setattr(engine_run, "run_merge", recording_run_merge)
    genome = write_genome(tmp_path, genome_doc())
    runs: dict[str, dict[str, Any]] = {}
    for name, device in _runs():
        merged.clear()
        best_devices.clear()
        storage, best = tmp_path / f"storage-{name}", tmp_path / f"best-{name}"
        merge_cuda = "--merge-cuda" if device.startswith("cuda") else "--no-merge-cuda"
        args = ["--storage-path", storage, "--max-fevals", "2", "--popsize", "2", "--random-seed", "3"]
        out, allocated = _run(
            capsys, "evolve", genome, *args, "--device", device, merge_cuda, "--in-memory", "--merge-best", best, "-q"
        )
        assert "best fitness" in out
        history = [json.loads(line) for line in (storage / "history.jsonl").read_text().splitlines()]
        runs[name] = {
            "history": history,
            "summary": json.loads((storage / "summary.json").read_text()),
            "best_config": yaml.safe_load((storage / "best_config.yml").read_text()),
            "merged": list(merged),
            "best_devices": list(best_devices),
            "best": best,
        }
    _assert_used_gpu(allocated, "evolve --device --merge-cuda")
    cpu, dev = runs["cpu"], runs["device"]
    merge_device = "cuda" if ON_CUDA else "cpu"
    assert [d for d, _ in dev["merged"]] == [merge_device] * 2 and dev["best_devices"] == [merge_device]
    assert [r["params"] for r in dev["history"]] == [r["params"] for r in cpu["history"]]
    # the device run's best: finite scores and fitness (on a GPU the candidates are scored in bfloat16, the
    # CPU's in float32, so the scores themselves may differ by a prompt or two and are not compared)
    best = dev["summary"]["best"]
    assert math.isfinite(best["fitness"])
    assert all(math.isfinite(v) for metrics in best["scores"].values() for v in metrics.values()), best["scores"]
    # The candidates' tensors. task_arithmetic is elementwise float32 arithmetic rounded once to the genome's
    # bfloat16: the devices may differ in the last float32 bit (fused multiply-adds), which can put a value one
    # bfloat16 step (BF16_ULP relative) apart after rounding; atol 1e-6 only for values at zero.
    for (_, want), (_, got) in zip(cpu["merged"], dev["merged"], strict=True):
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype == torch.bfloat16, name
            torch.testing.assert_close(got[name].float(), tensor.float(), rtol=BF16_ULP, atol=1e-6, msg=_named(name))
    # --merge-best: the best genome's merge, on the merge device; it loads and is that candidate's CPU merge
    evaluation = best["evaluation"]
    assert dev["best_config"] == dev["history"][evaluation - 1]["config"]
    written = read_state_dict(dev["best"])
    want = cpu["merged"][evaluation - 1][1]
    assert written.keys() <= want.keys()
    for name, tensor in written.items():
        torch.testing.assert_close(tensor.float(), want[name].float(), rtol=BF16_ULP, atol=1e-6, msg=_named(name))
    finite_logits(load_causal_lm(dev["best"]))


# ----- moe --device (gate_mode hidden) ------------------------------------------------------------------
def test_moe_hidden_gates_cuda_match_cpu(
    tiny_models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gate_mode hidden runs the base model on every expert's prompts on the device (`hidden_avg` is the same
    pass; cheap_embed and the random modes run no model, on any device). The router weights match the CPU's;
    everything else (attention, norms, experts) is copied bytes."""
    from tests.test_moe import experts_config, write_config

    models = [tiny_models("llama", seed=s) for s in (1, 2, 3, 4)]
    config = experts_config(models[0], models, "hidden", experts_per_token=2, dtype="float32")
    path = write_config(tmp_path, config)
    outs: dict[str, dict[str, torch.Tensor]] = {}
    for name, device in _runs():
        # a cache of its own per run: the CPU run's router weights are never the device run's
        monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / f"cache-{name}"))
        out = tmp_path / name
        _, allocated = _run(capsys, "moe", path, out, "--device", device, "-q")
        assert list((tmp_path / f"cache-{name}" / "moe-router").glob("*.safetensors")), "no router pass ran"
        outs[name] = read_state_dict(out)
        finite_logits(load_causal_lm(out))
    _assert_used_gpu(allocated, "moe --device")
    cpu, dev = outs["cpu"], outs["device"]
    assert cpu.keys() == dev.keys()
    gates = [n for n in cpu if n.endswith("block_sparse_moe.gate.weight")]
    assert len(gates) == 4
    for name, tensor in cpu.items():
        if name not in gates:
            assert torch.equal(dev[name], tensor), name
            continue
        # Unit-norm rows from float32 forward passes (4 layers, hidden 32): the CPU's float32 rows differ from
        # float64 ones by 7e-8, so the devices' reduction orders move them by ~1e-7. atol 1e-4 leaves 1000x
        # room, and is 10^4 below the distance between two experts' rows (> 1.0).
        torch.testing.assert_close(dev[name], tensor, rtol=0, atol=1e-4, msg=_named(name))


# ----- least-squares solves of rank-deficient systems on the device ------------------------------------
def test_rank_deficient_solves_cuda_match_cpu() -> None:
    """The systems that are rank-deficient exactly when it matters, solved with device tensors: tokensurgeon's
    common_interpolation weights over neighbours with repeated rows, and regmean's fallback for a Gram with a
    feature no input ever activates. CUDA's own lstsq (gels) assumes full rank and raises or returns inf
    there; runtime.devices.min_norm_lstsq gives the CPU's minimum-norm answer on every device."""
    from mergesmith.methods.regmean import regmean_linear
    from mergesmith.tokensurgeon.approximate import common_interpolation

    g = torch.Generator().manual_seed(3)
    distinct = torch.randn(60, 16, generator=g)
    atoms = torch.cat([distinct, distinct[:20]])  # rows 60..79 repeat rows 0..19
    targets = distinct[:20] + 0.05 * torch.randn(20, 16, generator=g)
    for scheme in ("least_squares", "barycentric"):
        fits = {}
        for name, device in _runs():
            idx, w = common_interpolation(targets.to(device), atoms.to(device), 8, scheme=scheme)
            assert w.device.type == torch.device(device).type and torch.isfinite(w).all(), scheme
            # fits, not weights: equal distances to a row and its repeat may be ordered differently on a GPU
            fits[name] = torch.bmm(w.unsqueeze(1), atoms.to(device)[idx]).squeeze(1).cpu()
        # the same float32 inputs to the same CPU solve; only the distances and the products ran on the device
        # (float32 reduction order, ~1e-6 here), and these rows are of norm ~4
        torch.testing.assert_close(fits["device"], fits["cpu"], rtol=0, atol=1e-4, msg=_named(scheme))
    weights = [torch.randn(8, 6, generator=g) for _ in range(3)]
    features = [torch.randn(40, 6, generator=g) for _ in range(3)]
    for x in features:
        x[:, 5] = 0  # feature 5 is never active: its Gram row and column are zero, the sum is singular
    grams = [x.T @ x for x in features]
    merged = {
        name: regmean_linear([w.to(device) for w in weights], [gr.to(device) for gr in grams], 0.9).cpu()
        for name, device in _runs()
    }
    assert torch.isfinite(merged["device"]).all()
    # the products G W^T run on the device (float32 sums of 6 terms ~40 each), so the CPU's gelsd solves
    # right-hand sides that differ in the last bits; the merged weights are ~1
    torch.testing.assert_close(merged["device"], merged["cpu"], rtol=1e-4, atol=1e-4)
