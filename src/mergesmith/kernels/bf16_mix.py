"""TIES' and task arithmetic's mix in bfloat16, mergekit's stepwise rounding, as compiled loops.

Why: with `dtype: bfloat16` mergekit computes the mix (weight the sparsified task vectors, elect the sign, sum,
normalise, scale, add the base) with torch operations in bfloat16, each of which computes in float32 and
rounds to bfloat16; TIES stays bit-equal to mergekit only by doing exactly that (task_vector_mix._mix). Those ~15
operations over the chunk were ~25% of the 1 B TIES bench merge's worker time, each a pass over memory and each
taking the GIL (bench/README.md, "Fourth round"). This loop makes the same roundings entry by entry, without the
GIL: every product, sum and quotient is formed in float32 and rounded to nearest-even bfloat16 where torch
rounds it, sums over the task vectors are accumulated in float32 in their order and rounded once, as torch's
reduction over dim 0 does. tests/test_bf16_mix.py compares it with task_vector_mix._mix byte for byte; the torch
path stays for other dtypes and devices, and where numba is missing. The two elementwise steps before the mix
(the task vector's subtraction, and its masking by the magnitude selection) are here too, for the same reason.
"""

from __future__ import annotations

import numpy as np
import torch

from .compiled import AVAILABLE, KernelGroup, compiled, narrow_bf16, round_bf16, widen_bf16
from .compiled import sign as _sign


@compiled
def mix(base, rows, weights, consensus, normalize, lam, scale, out):
    """out (bf16 bits) = task_vector_mix._mix of base (bf16 bits, n) and the task vectors `rows` (a tuple of k
    1-D bf16 bit arrays of n) with the weights already rounded to bfloat16 (float32 values); lam a float32 (torch
    multiplies by the scalar in float32).

    One pass, entry by entry: the task vectors come as a tuple, whose length is part of the compiled type, so the
    loops over them unroll and the entry loop vectorises; each row is a 1-D array the compiler knows contiguous,
    where a column slice of the stacked 2-D deltas (task_vector_mix cuts large tensors so) was typed as strided and
    did not vectorise. On this VM (2-vCPU AMD EPYC family 25), one thread, 4 M entries, ns an entry: 2 task vectors
    with the sum consensus 1.35 against 4.82 for the loop it replaces (per-block passes over float32 buffers of a
    strided 2-D array), 3 task vectors 1.72 against 6.29, 1 without a consensus 0.49 against 2.32 (an ad-hoc timing,
    bit-equal on all). A weighted task vector is rounded again where it is needed a second time (the votes, then
    the kept sum) rather than kept: a product and a rounding cost less than a store and a load."""
    count = len(rows)
    n = base.shape[0]
    zero = np.float32(0.0)
    one = np.float32(1.0)
    plain_divisor = zero
    for k in range(count):
        plain_divisor = plain_divisor + weights[k]
    plain_divisor = round_bf16(plain_divisor)
    if abs(plain_divisor) < 1e-8:
        plain_divisor = one
    for j in range(n):
        if consensus == 0:
            total = zero
            for k in range(count):
                total = total + round_bf16(widen_bf16(rows[k][j]) * weights[k])
            total = round_bf16(total)
            share = plain_divisor
        else:
            votes = zero
            for k in range(count):
                weighted = round_bf16(widen_bf16(rows[k][j]) * weights[k])
                if consensus == 1:
                    votes = votes + weighted
                else:
                    votes = votes + _sign(weighted)
            elected = one if round_bf16(votes) >= 0 else -one
            total = zero
            share = zero
            for k in range(count):
                weighted = round_bf16(widen_bf16(rows[k][j]) * weights[k])
                keep = one if _sign(weighted) == elected else zero
                total = total + weighted * keep
                share = share + weights[k] * keep
            total = round_bf16(total)
            divisor = round_bf16(share)
            share = one if divisor == 0 else divisor
        mixed = total
        if normalize:
            mixed = round_bf16(mixed / share)
        if scale:
            mixed = round_bf16(mixed * lam)
        out[j] = narrow_bf16(round_bf16(widen_bf16(base[j]) + mixed))


@compiled
def difference(a, b, out):
    """out = a - b on bf16 bits (1-D, contiguous), rounded as torch's bfloat16 subtraction rounds."""
    for i in range(out.shape[0]):
        out[i] = narrow_bf16(round_bf16(widen_bf16(a[i]) - widen_bf16(b[i])))


@compiled
def keep_where(delta, mask):
    """delta *= mask in place on bf16 bits and a bool mask (1-D, contiguous), as torch multiplies a bfloat16
    tensor by a bool one: a dropped entry becomes its product with 0 (-0 for a negative one, nan for inf)."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(delta.shape[0]):
        delta[i] = narrow_bf16(round_bf16(widen_bf16(delta[i]) * (one if mask[i] else zero)))


ELEMENTWISE = AVAILABLE
"""The task vectors' bf16 subtraction and masking on the CPU by the loops above (the same bytes as torch's; one
thread, both steps: 3.0 ns an entry with torch, 0.6 compiled, `python bench/profile_compiled.py`; tests switch it
off to compare)."""


def bits_of(t: torch.Tensor) -> np.ndarray:
    """The bfloat16 tensor's bits as a uint16 numpy view (strided where it is)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _elementwise(*tensors: torch.Tensor) -> bool:
    return (
        ELEMENTWISE
        and all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
        and KERNELS.ready(tensors[0].numel())
    )


def subtract(x: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x - base (same shapes): torch.sub, or its compiled twin for contiguous bf16 CPU tensors."""
    if _elementwise(x, base, out) and x.shape == base.shape == out.shape:
        difference(bits_of(x.view(-1)), bits_of(base.view(-1)), bits_of(out.view(-1)))
        return out
    return torch.sub(x, base, out=out)


def keep_masked(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """delta.mul_(mask) for a bool mask of delta's shape: compiled for contiguous bf16 CPU tensors."""
    if _elementwise(delta) and mask.dtype == torch.bool and mask.is_contiguous() and mask.shape == delta.shape:
        keep_where(bits_of(delta.view(-1)), mask.view(-1).numpy())
        return delta
    return delta.mul_(mask)


PRECOMPILED_COUNTS = 3
"""The mix is compiled per number of task vectors (the tuple's length is in its type): for 1 to this many at a
group's start (the common merges of two to four models); more compile at their first use (0.3-0.5 s once, for 4 to 8
task vectors here), loaded from numba's cache after (~3 ms)."""


def _compile_all() -> None:
    """Compile (or load from numba's cache) the loops here, on tiny inputs, for the argument types merges give."""
    one = np.zeros(1, dtype=np.uint16)
    for count in range(1, PRECOMPILED_COUNTS + 1):
        mix(one, (one,) * count, np.ones(count, dtype=np.float32), 1, True, np.float32(1), False, one)
    difference(one, one, one)
    keep_where(one, np.ones(1, dtype=np.bool_))


KERNELS = KernelGroup("bf16_mix", _compile_all)
"""The loops above, used (by this module and task_vector_mix) only once compiled: see compiled.KernelGroup."""


def warm() -> bool:
    """Compile (or load) the loops here now and wait for it: whether they are ready."""
    return KERNELS.wait()
