"""TIES and Breadcrumbs in row blocks: the whole-tensor magnitude selection made by a totals pass.

Why: TIES keeps the top-k magnitudes of each *whole* task vector (Breadcrumbs a middle band of them), so it
was merged whole, and an embedding's working set (stacked float task vectors, their magnitudes, sort keys,
sign-election temporaries: ~30 bytes an entry with bf16 and two task vectors) did not fit a small
`--max-memory` (issue 17: 1 GB for a 300 MB budget on the 0.25b bench set). But only the selection needs the
whole tensor; everything after it (the kept entries, the rescale, the sign election, the mix) is elementwise.

So, like DARE's L1 norms, the selection is a totals pass (merge_inputs.TotalsPass):
- `gather`, per row block: each task vector's magnitudes |x_i - base| in the compute dtype, written into one
  buffer per task vector (2 bytes an entry for bf16/fp16, the sort_select replay's own keys);
- `finish`: per task vector in turn, `sorted_window_mask` over that buffer, the very call the whole-tensor path
  makes on the very same values (so the same entries survive, ties included, as mergekit's sort keeps them),
  and the rescale factor (|d|_1 / |kept|_1, the same blocked sums); then the buffer goes and the mask is kept
  packed, one bit an entry;
- the merge pass, per row block: the task vectors again, times their masks (and factors), then the mix.

Every operation a kept entry goes through is the one the whole-tensor path applies to it, so the bytes are the
same whatever the block size (tests/test_magnitude_blocks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import sort_select
from .bf16_mix import keep_masked, subtract
from .introsort_replay import ID_BYTES
from .merge_inputs import MERGE_WHOLE, MergeInputs, TotalsPass, check_same_shape, require_base
from .reductions import BlockedTotal, total
from .selection import L1_EPS, ZEROS, Selection, Window
from .sort_select import sorted_window_mask
from .work_buffers import WorkBuffers

Rule = Callable[[dict[str, Any], int], Selection]
"""(one task vector's model parameters, entries of the whole tensor) -> what of it survives."""

RescaleOf = Callable[[dict[str, Any]], bool]
"""(a recipe's global parameters) -> whether the survivors are rescaled (the method resolves its `rescale`)."""

_CHUNK = 1 << 20
"""Entries per step of finish's rescale sum: its temporaries stay a few MB."""

KEPT_DELTA_ENTRIES = 4 << 20
"""A worker keeps the merge pass's task vectors of a row block (`sparsified`) up to this many entries, all task
vectors together: the executor cuts blocks of ~1 M entries (2 M where a tensor is one block), so two task vectors of a
block fit."""

_BUFFERS = WorkBuffers()
"""Each worker's magnitudes of the tensor it selects from (`keys<row>`) and task vectors of a block (`deltas`), kept
from tensor to tensor where the running merge allows (kept_bytes, sort_select.kept_entries).

Why: made afresh, each is new memory whose pages the kernel zeroes as the first difference written into them touches
them: on the 1b TIES bench merge ~3,300 transparent huge pages (6.6 GB), ~1.9 s of CPU in `clear_page_erms`, most
of it here (perf). Kept, ~1,150 huge pages; the merge took 10.7-11.1 s against 11.5-11.9 s, 1.7-2.5 s of system time
against 3.7-3.9 s (two alternating cold runs, bench/README.md, issue 33)."""


def kept_bytes(selection_entries: int, delta_entries: int, tasks: int, compute_size: int) -> int:
    """What one worker keeps between tensors (see _BUFFERS), at most: for the largest tensor selected in blocks
    whose selection it keeps (`selection_entries` entries), the magnitudes of its `tasks` task vectors in
    `compute_size` bytes an entry and a mask of a byte an entry; and the task vectors of the largest block
    (`delta_entries` entries, all task vectors together). Nothing where it keeps no selection."""
    if selection_entries <= 0:
        return 0
    return (tasks * selection_entries + min(delta_entries, KEPT_DELTA_ENTRIES)) * compute_size + selection_entries


def _mask_buffer(numel: int) -> np.ndarray:
    """A selection's mask of `numel` entries, the worker's kept buffer where the merge keeps selections that large
    (the mask is packed at once, before the next selection)."""
    return _BUFFERS.array("mask", numel, np.bool_, keep_up_to=sort_select.kept_entries())


def _magnitudes_buffer(row: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """Task vector `row`'s magnitudes of a whole tensor of `numel` entries (contents undefined), the worker's kept
    buffer where the merge keeps selections that large (else a fresh one)."""
    return _BUFFERS.get(f"keys{row}", (numel,), like.dtype, like.device, keep_up_to=sort_select.kept_entries())


@dataclass
class _Gathering:
    """The totals pass's state: per task vector, its model parameters and its magnitudes so far (one buffer
    over the whole tensor where its size is known, else the blocks in order), None where no ranking is needed."""

    params: list[dict[str, Any]]
    rescale: bool
    keys: list[torch.Tensor | list[torch.Tensor] | None]
    numel: int = 0


@dataclass
class Selected:
    """The totals pass's result, the merge pass's `MergeInputs.totals`: per task vector the kept entries as
    packed bits over the whole tensor (or KEEP_ALL / ZEROS), and the rescale factor (None: no rescale)."""

    kept: list[np.ndarray | str] = field(default_factory=list)
    factors: list[torch.Tensor | None] = field(default_factory=list)


def gather(rule: Rule, rescale_of: RescaleOf, state: _Gathering | None, inputs: MergeInputs) -> _Gathering:
    """Fold one row block: write each ranked task vector's magnitudes where its entries lie in the tensor."""
    check_same_shape(inputs, "magnitude selection")
    base = inputs.tensors[require_base(inputs, "magnitude selection")]
    others = inputs.others()
    n = base.numel()
    if state is None:
        params = [dict(inputs.model_params[i]) for i in others]
        whole = inputs.whole_numel
        ranked = [isinstance(rule(p, max(whole, n)), Window) for p in params]  # the kind does not depend on n > 0
        keys: list[torch.Tensor | list[torch.Tensor] | None] = [
            (_magnitudes_buffer(row, whole, base) if whole else []) if r else None for row, r in enumerate(ranked)
        ]
        state = _Gathering(params, rescale_of(inputs.params), keys)
    for row, i in enumerate(others):
        buffer = state.keys[row]
        if buffer is None:
            inputs.done_with(i)
            continue
        if isinstance(buffer, list):
            out = base.new_empty(base.shape)
            buffer.append(out.view(-1))
        else:
            out = buffer[inputs.offset : inputs.offset + n].view(base.shape)
        subtract(inputs.tensors[i], base, out)  # the whole path's difference, into its place
        inputs.done_with(i)
        out.abs_()  # magnitudes_of's values
    state.numel += n
    return state


class _GaveUp(Exception):
    """sort_select's replay gave up on keys it had reordered (a spent depth budget: adversarial input)."""


def _gave_up() -> torch.Tensor:
    raise _GaveUp


def finish(rule: Rule, state: _Gathering) -> Selected | str:
    """Select each task vector's survivors, one task vector at a time (its magnitudes go as its mask is made);
    MERGE_WHOLE where sort_select could not replay the sort on keys it may reorder (they are the only copy)."""
    with sort_select.holding_ids():  # the task vectors' selections share one lent ids buffer
        return _select_each(rule, state)


def _select_each(rule: Rule, state: _Gathering) -> Selected | str:
    """finish's loop over the task vectors."""
    selected = Selected()
    for row, params in enumerate(state.params):
        selection = rule(params, state.numel)
        buffer, state.keys[row] = state.keys[row], None
        if not isinstance(selection, Window):
            selected.kept.append(selection)
            selected.factors.append(None)
            continue
        assert buffer is not None  # gather kept the magnitudes of every task vector a Window ranks
        keys = torch.cat(buffer) if isinstance(buffer, list) else buffer
        del buffer
        window = (selection.lo, selection.hi, selection.descending)
        n = keys.numel()
        if not state.rescale:
            # the keys are ours to reorder (no copy), and the call holds the only reference, so the packed
            # replay (float32) drops them once it has packed them
            only = [keys]
            del keys
            try:
                mask = sorted_window_mask(only.pop(), *window, remake=_gave_up, zeros_free=True, out=_mask_buffer(n))
            except _GaveUp:
                return MERGE_WHOLE
            selected.kept.append(np.packbits(mask.cpu().numpy()))
            selected.factors.append(None)
            continue
        before = total(keys)
        # a copy of the keys is reordered: |d * mask| needs them
        mask = sorted_window_mask(keys, *window, zeros_free=True, out=_mask_buffer(n))
        after = BlockedTotal()  # total(|d * mask|) in pieces: the same bits, no tensor-sized temporary
        for start in range(0, keys.numel(), _CHUNK):
            piece = slice(start, start + _CHUNK)
            after.add((keys[piece] * mask[piece].to(keys.device)).abs_())
        after_sum = after.result()
        del keys
        selected.kept.append(np.packbits(mask.cpu().numpy()))
        selected.factors.append(None if before < L1_EPS or after_sum < L1_EPS else before / after_sum)
    return selected


def sparsified(inputs: MergeInputs, selected: Selected) -> torch.Tensor:
    """The merge pass over one row block: the stacked task vectors with what the selection kept of them, as
    the whole-tensor path leaves them before its mix."""
    check_same_shape(inputs, "magnitude selection")
    base = inputs.tensors[require_base(inputs, "magnitude selection")]
    others = inputs.others()
    keep = KEPT_DELTA_ENTRIES if sort_select.kept_entries() else 0  # none kept where the merge keeps no selection
    deltas = _BUFFERS.get("deltas", (len(others), *base.shape), base.dtype, base.device, keep_up_to=keep)
    for row, i in enumerate(others):
        delta, kept = deltas[row], selected.kept[row]
        if isinstance(kept, str) and kept == ZEROS:
            delta.zero_()
            inputs.done_with(i)
            continue
        subtract(inputs.tensors[i], base, delta)
        inputs.done_with(i)
        if isinstance(kept, np.ndarray):
            keep_masked(delta, _unpacked(kept, inputs.offset, delta.numel()).view(delta.shape).to(delta.device))
            factor = selected.factors[row]
            if factor is not None:
                delta.mul_(factor)
    return deltas


def _unpacked(packed: np.ndarray, start: int, count: int) -> torch.Tensor:
    """Bits [start, start + count) of a packed mask, as a bool tensor."""
    first, skip = divmod(start, 8)
    bits = np.unpackbits(packed[first : (start + count + 7) // 8], count=skip + count)
    return torch.from_numpy(bits[skip:].view(np.bool_))


SELECT_SCRATCH = 44 << 20
"""sort_select's scratch beside its keys, mask and tracker on a large tensor: a partition's exchange chunks and
kept stop positions (see sort_select._SWAP_CHUNK; ~30 MB measured on 32 M bf16 entries)."""


def totals_memory(n_inputs: int, numel: int, compute_size: int) -> tuple[int, int]:
    """(peak, kept) bytes of the pass over `numel` entries. The peak is the first task vector's selection: every
    task vector's magnitudes in the compute dtype, and what sort_select adds for one of them, which reorders its
    keys (16 or 32 bits) in place: a bool mask and a tracker of 8 bytes for each entry of the magnitude the
    window's end cuts (counted for up to a quarter of the entries: measured 22% on bf16 deltas of 1% of the
    weights, less on wider ones; more than half takes the packed replay, 8 bytes an entry), and the partition's
    scratch (with 32-bit keys 2 bytes an entry more, as measured on 5 M entries); float64 takes torch's full
    sort. `rescale: true` copies the keys first (the compute dtype's size an entry more). The compiled replay
    adds the followed entries' ids (introsort_replay.ID_BYTES an entry) where sort_select.follows_by_ids. Kept: the
    packed masks, a bit an entry per task vector."""
    tasks = max(0, n_inputs - 1)
    ids = ID_BYTES if sort_select.follows_by_ids(numel) else 0
    select = ({2: 3, 4: 5}.get(compute_size, 17) + ids) * numel + min(16 * numel, SELECT_SCRATCH)
    kept = tasks * numel // 8
    return numel * compute_size * tasks + select + kept, kept


def totals_pass(rule: Rule, rescale_of: RescaleOf) -> TotalsPass:
    """The TotalsPass of a method that ranks magnitudes by `rule` (needed whenever the tensor is cut in blocks)."""
    return TotalsPass(
        needed=lambda params: True,
        gather=lambda state, inputs: gather(rule, rescale_of, state, inputs),
        finish=lambda state: finish(rule, state),
        memory=totals_memory,
    )
