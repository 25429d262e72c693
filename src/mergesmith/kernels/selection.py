"""What survives of a task vector, mechanically: a window of torch's magnitude sort, the mask applied, the L1 rescale.

The papers' rules (which window TIES and Breadcrumbs keep, DARE's and DELLA's keep probabilities) are stated in
methods/task_arithmetic.py; this module is what they share to carry them out, and what the row-block path
(magnitude_blocks.py) shares with the whole-tensor one, so the two cannot disagree:

- a rule's answer is a Selection: a Window of positions [lo, hi) of torch.sort(|d|), KEEP_ALL or ZEROS;
- `apply_selection` finds that window's entries (sort_select: the window without the whole sort, with torch's
  tie-breaking, mergekit's call) and keeps them, `keep_l1_norm` rescales the survivors so the task vector keeps
  its L1 norm (`rescale: true`: how mergekit 0.1.5 realises the papers' 1/p rescaling);
- random rules draw on the CPU from the generator they are given (`cpu_bernoulli`), in float32 for dtypes other
  than bfloat16 (`work_dtype_of`), so a seed gives the same mask on any device and any thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bf16_mix import keep_masked
from .reductions import total
from .sort_select import sorted_window_mask

L1_EPS = 1e-7
"""Below this L1 norm (before or after masking) a task vector is not rescaled."""


def keep_l1_norm(delta: torch.Tensor, mask: torch.Tensor, rescale: bool, in_place: bool = False) -> torch.Tensor:
    """delta * mask, times |delta|_1 / |delta * mask|_1 when `rescale` (and both norms are not ~0).

    With `in_place` the result is written over `delta` (the same products, so the same bits): a caller whose
    delta is its own scratch saves a tensor-sized allocation, which for an embedding is the peak's margin.
    """
    before = total(delta.abs()) if rescale else 0.0
    kept = keep_masked(delta, mask) if in_place else delta * mask
    if not rescale:
        return kept
    after = total(kept.abs())
    if before < L1_EPS or after < L1_EPS:
        return kept
    return kept.mul_(before / after) if in_place else kept * (before / after)


def work_dtype_of(delta: torch.Tensor) -> torch.dtype:
    """Random draws (always on the CPU) are made in float32 for dtypes other than bfloat16, as mergekit does
    on the CPU; the same on every device, so the probabilities, and so the mask, do not depend on it."""
    if delta.dtype == torch.bfloat16:
        return delta.dtype
    return torch.float32


def cpu_bernoulli(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One Bernoulli draw per entry, made on the CPU from a CPU generator, returned on `probs`' device."""
    return torch.bernoulli(probs.cpu(), generator=generator).to(probs.device)


def magnitudes_of(delta: torch.Tensor) -> torch.Tensor:
    """|delta| as a fresh 1-D tensor (sort_select may reorder it in place)."""
    return delta.abs().reshape(-1)


KEEP_ALL = "keep all"
"""A selection that keeps the task vector untouched (density 1 or more: no ranking, no rescale)."""

ZEROS = "zeros"
"""A selection that replaces the task vector by zeros (TIES with density 0 or less)."""


@dataclass(frozen=True)
class Window:
    """The entries torch.sort(|d|, descending) puts at positions [lo, hi) survive."""

    lo: int
    hi: int
    descending: bool


Selection = Window | str
"""What a magnitude rule keeps of a task vector of n entries: a Window, KEEP_ALL or ZEROS. One function per rule
says it, so the whole-tensor path and the row-block path (magnitude_blocks.py) cannot disagree."""


def apply_selection(delta: torch.Tensor, selection: Selection, rescale: bool, in_place: bool) -> torch.Tensor:
    """`delta` with only the selected entries kept (see keep_l1_norm for `rescale` and `in_place`)."""
    if selection == KEEP_ALL:
        return delta
    if selection == ZEROS:
        return torch.zeros_like(delta)
    assert isinstance(selection, Window)
    mask = sorted_window_mask(
        magnitudes_of(delta), selection.lo, selection.hi, selection.descending, remake=lambda: magnitudes_of(delta),
        zeros_free=True,  # a zero entry of the task vector is zero whether it is kept or not
    )
    return keep_l1_norm(delta, mask.reshape_as(delta), rescale, in_place)
