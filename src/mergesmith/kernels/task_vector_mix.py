"""The mix of sparsified task vectors, base + lambda * (weighted sum or sign-elected mean), in the compute dtype.

methods/task_arithmetic.py states the rule (its docstring: steps 2 and 3). This is how it is computed, step by
step in the compute dtype as mergekit 0.1.5 rounds it (TIES stays bit-equal to mergekit only so), in chunks of
MIX_CHUNK entries so that the half-dozen temporaries stay a few chunks big, and for bfloat16 on the CPU by
bf16_mix's compiled loop (the same bytes) once that is ready. DARE and DELLA with a seed take keyed_merge.py's
float32 path instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import bf16_mix
from .compiled import CONSENSUS_CODES

CONSENSUS_METHODS = ("sum", "count")


def sign_consensus_mask(deltas: torch.Tensor, method: str = "sum", int8: bool = False) -> torch.Tensor:
    """Boolean mask over stacked (weighted) deltas: True where an entry has the elected majority sign.

    The majority sign of a position is + when the sum (or the count of signs) over models is >= 0, else -.
    An entry that is exactly zero never matches either sign.
    """
    sign = deltas.sign().to(torch.int8 if int8 else deltas.dtype)
    if method == "sum":
        votes = deltas.sum(dim=0)
    elif method == "count":
        votes = sign.sum(dim=0)
    else:
        raise ValueError(f"consensus_method must be one of {', '.join(CONSENSUS_METHODS)}, got {method!r}")
    majority = (votes >= 0).to(sign.dtype) * 2 - 1
    return sign == majority


MIX_CHUNK = 1 << 22
"""Entries mixed at a time: the mix is elementwise across models, so large tensors are mixed in chunks and its
half-dozen temporaries (weighted copies, signs, votes, masks) stay a few chunks big instead of tensor-sized."""


def merge_task_vectors(
    base: torch.Tensor,
    deltas: torch.Tensor,
    weights: Sequence[float],
    *,
    consensus: str | None,
    normalize: bool,
    lam: float = 1.0,
    int8_mask: bool = False,
) -> torch.Tensor:
    """base + lambda * mix of the stacked, already sparsified task vectors `deltas` (shape [n, *base.shape])."""
    options = dict(consensus=consensus, normalize=normalize, lam=lam, int8_mask=int8_mask)
    n = base.numel()
    if n <= MIX_CHUNK:
        return _mix(base, deltas, weights, **options)
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    flat_out, flat_base, flat_deltas = out.view(-1), base.reshape(-1), deltas.reshape(deltas.shape[0], -1)
    for start in range(0, n, MIX_CHUNK):
        end = min(n, start + MIX_CHUNK)
        flat_out[start:end] = _mix(flat_base[start:end], flat_deltas[:, start:end], weights, **options)
    return out


def _mix(
    base: torch.Tensor,
    deltas: torch.Tensor,
    weights: Sequence[float],
    *,
    consensus: str | None,
    normalize: bool,
    lam: float,
    int8_mask: bool,
) -> torch.Tensor:
    """merge_task_vectors on one chunk (or a whole small tensor)."""
    if _compiled_mix_applies(base, deltas, consensus):
        return _compiled_mix(base, deltas, weights, consensus, normalize, lam)
    w = torch.tensor(list(weights), dtype=deltas.dtype, device=deltas.device)
    w = w.view(-1, *([1] * base.dim()))
    weighted = deltas * w
    if consensus is not None:
        # The boolean mask as 0/1 in the delta's dtype: the same products as torch's bool promotion, but two
        # same-dtype multiplications run ~10x faster than the mixed-dtype ones (measured in bench/README.md).
        mask = sign_consensus_mask(weighted, consensus, int8_mask).to(weighted.dtype)
        mixed = (weighted * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = weighted.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    if lam != 1:
        mixed = mixed * lam
    return (base + mixed).to(base.dtype)


COMPILED_MIX = bf16_mix.AVAILABLE
"""bfloat16 mixes on the CPU by bf16_mix's compiled loop (the same bytes; tests switch it off to compare)."""


def _compiled_mix_applies(base: torch.Tensor, deltas: torch.Tensor, consensus: str | None) -> bool:
    return (
        COMPILED_MIX
        and base.device.type == "cpu"
        and base.dtype == deltas.dtype == torch.bfloat16
        and consensus in CONSENSUS_CODES
        and bf16_mix.KERNELS.ready(base.numel())
    )


def _compiled_mix(
    base: torch.Tensor, deltas: torch.Tensor, weights: Sequence[float], consensus: str | None, normalize: bool,
    lam: float,
) -> torch.Tensor:
    out = torch.empty(base.shape, dtype=base.dtype)
    rounded = torch.tensor(list(weights), dtype=torch.bfloat16).float().numpy()
    rows = deltas.reshape(deltas.shape[0], -1)
    bf16_mix.mix(
        bf16_mix.bits_of(base.reshape(-1)),
        tuple(bf16_mix.bits_of(row) for row in rows),
        rounded,
        CONSENSUS_CODES[consensus],
        normalize,
        np.float32(lam),
        lam != 1,
        bf16_mix.bits_of(out.view(-1)),
    )
    return out
