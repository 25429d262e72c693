"""Sparsification of task vectors: which entries of a delta survive, and how the survivors are rescaled.

Four rules, one per paper, each keeping about a `density` fraction of the entries of a task vector d:

- `magnitude` (TIES, Yadav et al. 2023, arXiv:2306.01708, step "trim"): keep the k = max(1, floor(density n))
  entries of largest |d|;
- `random` (DARE, Yu et al. 2023, arXiv:2311.03099, "drop and rescale"): keep each entry independently with
  probability `density`;
- `magnitude_outliers` (Model Breadcrumbs, Davari & Belilovsky 2023, arXiv:2312.06795): drop the floor(gamma n)
  largest |d| and enough of the smallest that floor(density n) remain (fewer outliers are dropped when gamma
  and density together ask for more than n);
- `della_magprune` (DELLA, Deep et al. 2024, arXiv:2406.11617, "MagPrune"): keep each entry with a probability
  that grows linearly with its magnitude rank within its row, from density - epsilon (smallest) to
  density + epsilon (largest).

Rescaling (`rescale: true`) multiplies the survivors so the task vector keeps its L1 norm: this is how
mergekit 0.1.5 realises the papers' 1/p rescaling (the two agree in expectation for DARE, where the kept
fraction concentrates at p). A density of 1 or more returns the task vector untouched (no draw is made).

Random rules draw only from the generator they are given, in a fixed order, so results are identical
for a given seed whatever the thread count. The generator is a CPU one and the draws are made on the
CPU (then moved to the tensor's device), so a seed gives the same mask on any device. Magnitude
ranks are those of torch's sort of the float32 magnitudes, mergekit's call, so equal magnitudes are broken
the same way; on the CPU sort_select finds that sort's window without paying for the whole sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.bf16_mix import keep_masked
from ..kernels.reductions import total
from ..kernels.sort_select import sorted_window_mask

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


def _float_work(delta: torch.Tensor) -> torch.dtype:
    """Random draws (always on the CPU) are made in float32 for dtypes other than bfloat16, as mergekit does
    on the CPU; the same on every device, so the probabilities, and so the mask, do not depend on it."""
    if delta.dtype == torch.bfloat16:
        return delta.dtype
    return torch.float32


def _cpu_bernoulli(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
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


def magnitude_window(n: int, density: float) -> Selection:
    """TIES trim: the max(1, floor(density * n)) largest magnitudes."""
    if density >= 1:
        return KEEP_ALL
    if density <= 0 or n == 0:
        return ZEROS
    return Window(0, max(1, int(density * n)), descending=True)


def outliers_window(n: int, density: float, gamma: float) -> Selection:
    """Breadcrumbs: drop the floor(gamma * n) largest magnitudes and the smallest, keeping floor(density * n)."""
    if density >= 1:
        return KEEP_ALL
    keep = int(density * n)
    top = int(gamma * n)
    bottom = max(0, n - keep - top)
    return Window(bottom, bottom + keep, descending=False)


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


def magnitude(delta: torch.Tensor, density: float, rescale: bool = False, in_place: bool = False) -> torch.Tensor:
    """TIES trim: keep the max(1, floor(density * n)) largest-magnitude entries (written over `delta` with
    `in_place`)."""
    return apply_selection(delta, magnitude_window(delta.numel(), density), rescale, in_place)


def magnitude_outliers(
    delta: torch.Tensor, density: float, gamma: float = 0.01, rescale: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Breadcrumbs: drop the gamma largest-magnitude entries and the smallest, keeping floor(density * n)
    (written over `delta` with `in_place`)."""
    return apply_selection(delta, outliers_window(delta.numel(), density, gamma), rescale, in_place)


def random_drop(delta: torch.Tensor, density: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """DARE: keep each entry with probability `density` (one Bernoulli draw per entry)."""
    if density >= 1:
        return delta
    dtype = _float_work(delta)
    probs = torch.full(delta.shape, fill_value=density, dtype=dtype)  # on the CPU, where the draw is made
    mask = torch.bernoulli(probs, generator=generator).to(delta.device)
    return keep_l1_norm(delta.to(dtype), mask, rescale).to(delta.dtype)


def della_problem(density: float, epsilon: float) -> str | None:
    """Why DELLA cannot draw with this density and epsilon (None when it can): with 0 < density < 1 the keep
    probabilities density - epsilon and density + epsilon must lie strictly inside (0, 1)."""
    if not 0 < density < 1:
        return None  # 0 drops everything, 1 or more keeps everything: nothing is drawn
    if density + epsilon >= 1 or density - epsilon <= 0:
        return f"density ({density}) +/- epsilon ({epsilon}) must stay inside (0, 1); choose a smaller epsilon"
    return None


def della_magprune(
    delta: torch.Tensor, density: float, epsilon: float, generator: torch.Generator | None, rescale: bool = True
) -> torch.Tensor:
    """DELLA MagPrune: keep probability linear in the magnitude rank within each row.

    The smallest entry of a row is kept with probability density - epsilon, the largest with density + epsilon;
    both must lie in (0, 1). A 1-D tensor is one row.
    """
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    problem = della_problem(density, epsilon)
    if problem:
        raise ValueError(f"della: {problem}")
    dtype = _float_work(delta)
    shape = delta.shape
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    probs = della_probabilities(rows, density, epsilon)
    mask = _cpu_bernoulli(probs, generator).to(dtype)
    return keep_l1_norm(rows.to(dtype), mask, rescale).to(delta.dtype).reshape(shape)


def della_probabilities(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """MagPrune's keep probability of every entry of `rows` (ranked along dim 1), in the work dtype.

    The inverse of the sorting permutation gives each entry's rank; that is argsort(argsort(.)) (mergekit's
    call) with one sort fewer, and the same ranks, since argsort of a permutation is its unique inverse."""
    dtype = _float_work(rows)
    order = torch.argsort(rows.abs(), dim=1, descending=False)
    # rank as mergekit rounds it: the 0-based position converted to the work dtype, then + 1 in that dtype
    column = [1, rows.shape[1]] + [1] * (rows.dim() - 2)  # ranks run along dim 1, also of 3-D tensors
    positions = (torch.arange(rows.shape[1], device=rows.device).to(dtype) + 1).view(column).expand_as(order)
    ranks = torch.empty(order.shape, dtype=dtype, device=rows.device).scatter_(1, order, positions)
    # Each row's ranks are a permutation of `positions`, whose smallest and largest are its first and last (the
    # rounding to the work dtype is monotone): mergekit's min and max over the ranks, without two more passes.
    lowest = positions[:, :1]
    highest = positions[:, -1:]
    span = highest - lowest
    # A one-entry row has no spread of ranks; it is kept with probability `density` (mergekit would divide 0 by 0).
    position = torch.where(span > 0, (ranks - lowest) / torch.where(span > 0, span, 1), 0.5).clamp(0, 1)
    return (density - epsilon) + position * 2 * epsilon


def work_dtype_of(delta: torch.Tensor) -> torch.dtype:
    """The dtype random sparsifiers compute in (see _float_work)."""
    return _float_work(delta)
