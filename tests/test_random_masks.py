"""Random masks come from a CPU generator, drawn on the CPU and moved to the compute device, so a seed
gives the same output bytes on every device (the device is not part of the resume fingerprint).

There is no GPU here: the 'meta' device stands in for "some device other than the CPU" (it holds no
data, so any draw made there would leave the CPU generator untouched)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mergesmith.kernels import selection
from mergesmith.methods import arcee_fusion, task_arithmetic
from mergesmith.methods.registry import MergeInputs, MethodSpec


def _delta(shape: tuple[int, ...] = (64, 48), seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rescale", [True, False])
def test_dare_equals_a_pure_cpu_reference(dtype, rescale):
    delta = _delta(dtype=dtype)
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    mask = torch.bernoulli(torch.full(delta.shape, 0.3, dtype=work), generator=_gen(7))
    expected = selection.keep_l1_norm(delta.to(work), mask, rescale).to(dtype)
    assert torch.equal(task_arithmetic.random_drop(delta, 0.3, _gen(7), rescale), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dare_masks_for_another_device_are_drawn_from_the_cpu_generator(dtype):
    """The same draws from the CPU generator whether the tensor is on the CPU or elsewhere. (Without
    rescaling: on 'meta' there is no norm to rescale by. DELLA's probabilities depend on the data, so it
    needs a real device: test_methods_math.py::test_methods_run_on_cuda compares it with the CPU's.)"""
    delta = _delta(dtype=dtype)
    on_cpu, elsewhere = _gen(11), _gen(11)
    out = task_arithmetic.random_drop(delta, 0.3, on_cpu, rescale=False)
    moved = task_arithmetic.random_drop(delta.to("meta"), 0.3, elsewhere, rescale=False)
    assert moved.device.type == "meta" and moved.shape == out.shape and moved.dtype == out.dtype
    assert torch.equal(on_cpu.get_state(), elsewhere.get_state())  # the CPU generator made the same draws
    assert not torch.equal(on_cpu.get_state(), _gen(11).get_state())  # and it did draw


def test_arcee_fusion_samples_with_the_cpu_generator(monkeypatch):
    monkeypatch.setattr(arcee_fusion, "QUANTILE_SAMPLE", 100)
    scores = _delta((40, 40))
    qs = torch.tensor([0.25, 0.5, 0.75])
    on_cpu, elsewhere = _gen(3), _gen(3)
    expected = arcee_fusion.quantiles(scores, qs, on_cpu, "x")
    got = arcee_fusion.quantiles(scores.to("meta"), qs, elsewhere, "x")
    assert got.device.type == "meta" and got.shape == expected.shape
    assert torch.equal(on_cpu.get_state(), elsewhere.get_state())


def test_the_executor_hands_methods_a_cpu_generator_whatever_the_device(tmp_path, tiny_models, monkeypatch):
    from mergesmith.config import parse_config
    from mergesmith.engine.execution import compute as recipe_compute
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import build_plan

    base = tiny_models("llama", seed=1)
    a, b = tiny_models.derive(base, seed=2), tiny_models.derive(base, seed=3)
    cfg = parse_config(
        {
            "merge_method": "dare_ties",
            "base_model": str(base),
            "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in (a, b)],
        }
    )
    plan, ckpts = build_plan(cfg, MergeOptions(random_seed=4))
    recipe = next(r for r in plan.recipes if r.op == "merge" and r.seed is not None)
    seen: list[Any] = []

    def record(inputs: MergeInputs) -> torch.Tensor:
        seen.append((inputs.generator, {t.device.type for t in inputs.tensors}))
        return torch.zeros(recipe.shape)

    fake = MethodSpec(name="dare_ties", merge=record)
    monkeypatch.setattr(recipe_compute, "require_method", lambda _name: fake)
    for device in ("cpu", "meta"):
        recipe_compute.compute(recipe, ckpts, torch.float32, False, torch.device(device))
    (cpu_gen, cpu_devices), (meta_gen, meta_devices) = seen
    assert cpu_devices == {"cpu"} and meta_devices == {"meta"}
    assert cpu_gen.device.type == "cpu" and meta_gen.device.type == "cpu"
    assert torch.equal(cpu_gen.get_state(), meta_gen.get_state())
    assert torch.equal(cpu_gen.get_state(), torch.Generator().manual_seed(recipe.seed).get_state())
