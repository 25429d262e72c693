"""Inputs are memory-mapped file pages that count in resident memory: the executor drops them as soon as
they are spent (converted to the compute dtype, or consumed by a method that says so), not only after the
whole output tensor is written. Dropping must never change the result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mergesmith.engine.execution.compute import compute
from mergesmith.engine.plan import InputRef, TensorRecipe
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.kernels import task_vector_mix as task_arithmetic


def _models(tmp_path: Path) -> dict[str, Checkpoint]:
    torch.manual_seed(0)
    checkpoints = {}
    for name in ("base", "a", "b"):
        path = tmp_path / f"{name}.safetensors"
        save_file({"w": torch.randn(64, 1024).to(torch.bfloat16)}, str(path))
        checkpoints[name] = Checkpoint.open(str(path))
    return checkpoints


def _ties() -> TensorRecipe:
    return TensorRecipe(
        name="w",
        shape=(64, 1024),
        dtype="BF16",
        op="merge",
        inputs=tuple(InputRef(m, "w") for m in ("base", "a", "b")),
        method="ties",
        base_index=0,
        model_params=((), (("weight", 0.5), ("density", 0.5)), (("weight", 0.5), ("density", 0.5))),
        params=(("normalize", True), ("rescale", False), ("lambda", 1.0), ("int8_mask", False)),
    )


def _record(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, ...]]) -> None:
    real_advise = Checkpoint.advise

    def advise(self: Checkpoint, name: str, advice: str, *args: Any) -> None:
        events.append((advice, Path(self.ref).stem))
        real_advise(self, name, advice, *args)

    real_mix = task_arithmetic.merge_task_vectors

    def mix(*args: Any, **kwargs: Any) -> torch.Tensor:
        events.append(("mix",))
        return real_mix(*args, **kwargs)

    monkeypatch.setattr(Checkpoint, "advise", advise)
    monkeypatch.setattr(task_arithmetic, "merge_task_vectors", mix)


def test_ties_drops_each_task_model_once_its_difference_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoints = _models(tmp_path)
    expected = compute(_ties(), checkpoints, torch.bfloat16, False, torch.device("cpu"))
    events: list[tuple[str, ...]] = []
    _record(monkeypatch, events)
    merged = compute(_ties(), checkpoints, torch.bfloat16, False, torch.device("cpu"))
    assert torch.equal(merged, expected)  # dropped pages read back the same
    mix_at = events.index(("mix",))
    assert {e for e in events[:mix_at]} == {("dontneed", "a"), ("dontneed", "b")}  # the base is still in use


def test_converted_inputs_are_dropped_before_the_method_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints = _models(tmp_path)
    events: list[tuple[str, ...]] = []
    _record(monkeypatch, events)
    compute(_ties(), checkpoints, torch.float32, True, torch.device("cpu"))
    mix_at = events.index(("mix",))
    assert {e for e in events[:mix_at]} == {("dontneed", "base"), ("dontneed", "a"), ("dontneed", "b")}
