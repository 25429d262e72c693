"""TIES' selection over tensors too large for the ids its plan charged follows its entries by ids where the running
merge lends the memory (sort_select.lending), and by the table where it does not: the same mask either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mergesmith.kernels import introsort_replay, sort_select

pytestmark = pytest.mark.skipif(not introsort_replay.AVAILABLE, reason="numba is not installed")


def _deltas(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(n, generator=g) * 0.003).bfloat16().abs()


@pytest.mark.parametrize("granted", [True, False])
def test_a_lent_selection_follows_by_ids_and_gives_the_sorts_window(granted: bool, monkeypatch: Any) -> None:
    assert introsort_replay.warm()
    monkeypatch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 1000)  # this selection is over it: no ids charged
    ways: list[bool] = []
    replay = introsort_replay.replay

    def spying(*args: Any) -> bool:
        ways.append(bool(args[-1]))
        return replay(*args)

    monkeypatch.setattr(introsort_replay, "replay", spying)
    asked: list[int] = []
    returned: list[int] = []

    def lend(nbytes: int) -> bool:
        asked.append(nbytes)
        return granted

    values = _deltas(300_000)
    expected = torch.zeros(values.numel(), dtype=torch.bool)
    expected[torch.sort(values.float(), descending=True).indices[:150_000]] = True
    with sort_select.lending(lend, returned.append):
        mask = sort_select.sorted_window_mask(values.clone(), 0, 150_000, True)
    assert torch.equal(mask, expected)
    assert asked == [300_000 * introsort_replay.ID_BYTES]
    assert ways == [granted]
    assert returned == (asked if granted else [])
    assert sort_select._lender.lend is None  # the lender is gone after the block


def test_a_merge_lends_its_selections_memory(tmp_path: Any, tiny_models: Any, monkeypatch: Any) -> None:
    """The executor installs its budget as the lender while it runs: a TIES merge over tensors larger than
    IDS_MAX_ENTRIES borrows for them, and its output equals the merge whose selections were refused the memory."""
    from mergesmith.engine.execution.admission import MemoryBudget
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    assert introsort_replay.warm()
    models = [tiny_models("llama", seed=seed) for seed in (1, 2, 3)]
    config = tmp_path / "ties.yml"
    config.write_text(
        f"merge_method: ties\nbase_model: {models[0]}\nmodels:\n"
        + "".join(f"- model: {m}\n  parameters: {{density: 0.5, weight: 0.5}}\n" for m in models[1:])
        + "dtype: bfloat16\n"
    )
    monkeypatch.setattr(introsort_replay, "IDS_MAX_ENTRIES", 0)
    monkeypatch.setattr(sort_select, "REPLAY_MIN_ENTRIES", 0)
    outputs = []
    real = MemoryBudget.lend
    for granted in (True, False):
        lent: list[int] = []

        def lend(self: MemoryBudget, nbytes: int, granted: bool = granted, lent: list[int] = lent) -> bool:
            lent.append(nbytes)
            return real(self, nbytes) if granted else False

        monkeypatch.setattr(MemoryBudget, "lend", lend)
        out = tmp_path / f"out-{granted}"
        run_merge(str(config), out, MergeOptions(threads=2))
        assert lent  # every selection asked
        outputs.append((out / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]
