"""TIES' and task arithmetic's mix in bfloat16, mergekit's stepwise rounding, as one compiled loop.

Why: with `dtype: bfloat16` mergekit computes the mix (weight the sparsified task vectors, elect the sign, sum,
normalise, scale, add the base) with torch operations in bfloat16, each of which computes in float32 and
rounds to bfloat16; TIES stays bit-equal to mergekit only by doing exactly that (task_arithmetic._mix). Those ~15
operations over the chunk were ~25% of the 1 B TIES bench merge's worker time, each a pass over memory and each
taking the GIL (bench/README.md, "Fourth round"). This loop makes the same roundings entry by entry, without the
GIL: every product, sum and quotient is formed in float32 and rounded to nearest-even bfloat16 where torch
rounds it, sums over the task vectors are accumulated in float32 in their order and rounded once, as torch's
reduction over dim 0 does. tests/test_bf16_mix.py compares it with task_arithmetic._mix byte for byte; the torch
path stays for other dtypes and devices, and where numba is missing.
"""

from __future__ import annotations

import numpy as np

from .compiled import AVAILABLE, compiled
from .compiled import sign as _sign

if AVAILABLE:
    from .compiled import bits_from_float32, float32_from_bits


@compiled
def _widen(bits):
    return float32_from_bits(np.uint32(bits) << np.uint32(16))


@compiled
def _round(value):
    """value rounded to the nearest bfloat16, ties to even (torch's conversion), back as float32."""
    if value != value:
        return value
    bits = bits_from_float32(value)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return float32_from_bits(bits)


@compiled
def mix(base, deltas, weights, consensus, normalize, lam, scale, out):
    """out (bf16 bits) = task_arithmetic._mix of base (bf16 bits, n) and deltas (bf16 bits, k x n) with the
    weights already rounded to bfloat16 (float32 values); lam a float32 (torch multiplies by the scalar in
    float32)."""
    count = deltas.shape[0]
    zero = np.float32(0.0)
    weighted = np.empty(count, dtype=np.float32)
    plain_divisor = zero
    for k in range(count):
        plain_divisor = plain_divisor + weights[k]
    plain_divisor = _round(plain_divisor)
    if abs(plain_divisor) < 1e-8:
        plain_divisor = np.float32(1.0)
    for i in range(base.shape[0]):
        for k in range(count):
            weighted[k] = _round(_widen(deltas[k, i]) * weights[k])
        if consensus == 0:
            total = zero
            for k in range(count):
                total = total + weighted[k]
            mixed = _round(total)
            divisor = plain_divisor
        else:
            votes = zero
            for k in range(count):
                votes = votes + (weighted[k] if consensus == 1 else _sign(weighted[k]))
            majority = np.float32(1.0) if _round(votes) >= 0 else np.float32(-1.0)
            total = zero
            share = zero
            for k in range(count):
                keep = np.float32(1.0) if _sign(weighted[k]) == majority else zero
                total = total + weighted[k] * keep
                share = share + weights[k] * keep
            mixed = _round(total)
            divisor = _round(share)
            if divisor == 0:
                divisor = np.float32(1.0)
        if normalize:
            mixed = _round(mixed / divisor)
        if scale:
            mixed = _round(mixed * lam)
        result = _round(_widen(base[i]) + mixed)
        out[i] = np.uint16(bits_from_float32(result) >> np.uint32(16))
