"""DARE's and DELLA's float32 arithmetic for one chunk, as two compiled loops that run without the GIL.

Why compiled: keyed_merge.py computes a chunk with ~20 in-place torch operations. Each one passes over the
chunk's buffers again, and torch 2.13 takes the GIL inside every in-place operation (to hand back `self`), so
the executor's two worker threads wait on each other: 26% of their samples on a cold 1b dare_ties merge, and
two threads reached 1.74x one thread's rate (bench/README.md, "Third round"). Fused, a chunk is one pass over
its inputs, made by a loop numba compiles to machine code, which runs with the GIL released (`nogil=True`).
No library offers this fusion on the CPU without a C compiler at run time (torch.compile's CPU backend needs
one); numba brings its own LLVM.

The loops reproduce keyed_merge's torch operations one for one, in float32 and in the same order (the same
products, sums, clamps, signs, lerps and divisions), so the bytes are the same as the torch path's, which is
still used on other devices and where numba cannot be imported (tests/test_keyed_kernels.py compares them).
The rounding to the output dtype and the norms' blocked sums stay with torch (reductions.BlockedTotal), so they
are torch's by construction. Keep flags come packed, 8 an entry byte, most significant bit first
(numpy.packbits' order), as the totals pass stores them.
"""

from __future__ import annotations

import numpy as np

try:  # numba is a dependency; without it (a platform with no wheel) keyed_merge runs its torch operations
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

AVAILABLE = njit is not None

CONSENSUS_CODES = {None: 0, "sum": 1, "count": 2}


def _compiled(function):
    """`function` compiled without the GIL, cached on disk (the first use in a fresh install compiles for ~1 s),
    with numpy's float semantics (a division by zero gives inf or nan, not an exception); as is without numba."""
    if njit is None:
        return function
    return njit(nogil=True, cache=True, error_model="numpy")(function)


@_compiled
def _sign(x):  # torch.sign: (0 < x) - (x < 0), so +0 for zeros and nan
    if x > 0:
        return np.float32(1.0)
    if x < 0:
        return np.float32(-1.0)
    return np.float32(0.0)


@_compiled
def _positive_part(x):  # torch.clamp_min(x, 0): x unless x < 0 (so -0 and nan stay)
    return np.float32(0.0) if x < 0 else x


@_compiled
def _negative_part(x):  # torch.clamp_max(x, 0): x unless x > 0
    return np.float32(0.0) if x > 0 else x


@_compiled
def _pick(start, end, weight):  # torch.lerp's vectorised form, for weights 0 and 1: fma(coeff, end - start, base)
    if weight < 0.5:
        return start + weight * (end - start)
    return end + (weight - np.float32(1.0)) * (end - start)


@_compiled
def _flag(packed, k, i):
    return np.float32((packed[k, i >> 3] >> (7 - (i & 7))) & 1)


@_compiled
def magnitudes(base, x, packed, k, mags, kept):
    """mags = |x - base| and kept = mags * keep (keep: row k of `packed`), over the chunk's n entries."""
    for i in range(base.shape[0]):
        a = abs(x[i] - base[i])
        mags[i] = a
        kept[i] = a * _flag(packed, k, i)


@_compiled
def mix(base, xs, packed, masked, factors, weights, consensus, normalize, divisor, lam, scale, out):
    """out = base + lam * mix of the task vectors xs[k] - base, masked (where masked[k]) by row k of `packed`
    and multiplied by factors[k]: keyed_merge.merge's and keyed_merge._mix's operations, entry by entry.
    consensus: 0 none, 1 sum, 2 count (CONSENSUS_CODES); `divisor` is the no-consensus normaliser; `scale`
    says whether lam multiplies (keyed_merge skips the multiplication for lam == 1)."""
    count = xs.shape[0]
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(base.shape[0]):
        b = base[i]
        if consensus == 0:
            acc = zero
            for k in range(count):
                d = xs[k, i] - b
                if masked[k]:
                    d = d * _flag(packed, k, i)
                w = d * factors[k]
                acc = w if k == 0 else acc + w
            if normalize:
                acc = acc / divisor
        else:
            pos = zero
            neg = zero
            votes = zero
            pos_w = zero
            neg_w = zero
            for k in range(count):
                d = xs[k, i] - b
                if masked[k]:
                    d = d * _flag(packed, k, i)
                w = d * factors[k]
                if k == 0:
                    pos = _positive_part(w)
                    neg = _negative_part(w)
                    votes = _sign(w)
                else:
                    pos = pos + _positive_part(w)
                    neg = neg + _negative_part(w)
                    votes = votes + _sign(w)
                if normalize:
                    s = _sign(w)
                    pos_w = pos_w + weights[k] * _positive_part(s)
                    neg_w = neg_w + (-weights[k]) * _negative_part(s)
            if consensus == 1:
                votes = pos + neg
            elected = min(_sign(votes) + one, one)
            acc = _pick(neg, pos, elected)
            if normalize:
                share = _pick(neg_w, pos_w, elected)
                share = share + -(abs(_sign(share)) - one)  # 1 where no vector is on the elected side
                acc = acc / share
        if scale:
            acc = acc * lam
        out[i] = acc + b


def packed_rows(count: int, entries: int) -> np.ndarray:
    """An uninitialised (count, bytes) array for the packed keep flags of `count` vectors over `entries`."""
    return np.empty((count, (entries + 7) // 8), dtype=np.uint8)
