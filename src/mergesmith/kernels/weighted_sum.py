"""Linear's weighted sum as one compiled loop over the inputs, with the rounding of the torch path it replaces.

Why: methods/linear.linear_average forms sum_i w_i x_i in float32 with torch, one operation at a time: widen each
bfloat16 input into a float32 buffer, `addcmul` it into the sum, divide, round back to bfloat16. Each operation is
a pass over memory (a 1 M-entry block: 3 inputs of 2 MB, a 4 MB sum read and written five times), about 0.8 ns
an entry on one core of this project's VM (AMD EPYC, `python bench/profile_compiled.py --only linear`). Here
every entry is read once, summed in registers and written once, in L1-sized steps the compiler vectorises.

The bytes are the torch path's: in model order, each x_i * w_i is added to the running sum as torch's `addcmul`
does it on this machine, which is asked once (`torch_fuses`): with a fused multiply-add, one rounding, where torch
runs its AVX2 or AVX-512 kernels (their vector code calls fmadd, and their scalar tails are compiled with FMA
contraction), else the product rounded and then added (numba contracts nothing without fastmath, so each loop
does exactly what it says); starting from +0.0 as torch's zeros do. The sum is
divided by the float32 total of the weights unless that is zero or normalisation is off; the result is rounded
to nearest-even bfloat16 as torch converts (compiled.round_bf16, as TIES' bf16 mix rounds). A nan stays a nan, the
top half of its float32 bits; those are not torch's, which has two answers of its own (0xFFFF from its vector loop,
0x7FC0 from its scalar tail). tests/test_weighted_sum.py compares the two byte for byte (nan by being nan), odd
lengths, signed zeros and inf included.

Only where it pays and is exact: CPU tensors, contiguous, all bfloat16 or all float32, one to MAX_INPUTS of them;
anything else takes the torch path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .compiled import AVAILABLE, KernelGroup, compiled, narrow_bf16, numba_extension, round_bf16, widen_bf16

MAX_INPUTS = 6
"""Input counts the loops are compiled for (numba compiles one variant per count: the inputs are a tuple; each
variant adds ~30 ms to loading the group from the cache, so merges of more models take the torch path)."""

STEP = 512
"""Entries summed per step: a float32 sum of this many stays in L1 while every input adds into it. Each step's
loops index slices from 0 (not `start + j`): numba's wraparound check for a possibly negative index kept the
compiler from vectorising them, 4x slower."""


def _as_float32(value):  # noqa: ARG001 - typed by its overload below; only the compiled loops call it
    """An input entry as float32: bf16 bits (uint16) widened, a float32 as it is."""
    raise NotImplementedError


def _stored(value, out):  # noqa: ARG001 - typed by its overload below
    """A float32 sum as `out` stores it: rounded to bf16 bits for a uint16 array, as it is for a float32 one."""
    raise NotImplementedError


fused_multiply_add: Any = None


@numba_extension
def _typing() -> None:
    """The overloads of _as_float32 and _stored, registered once numba is loaded (compiled.numba_extension), and
    compiled.fused_multiply_add, which exists only then."""
    global fused_multiply_add
    from numba import types
    from numba.extending import overload

    from .compiled import fused_multiply_add

    @overload(_as_float32)
    def _as_float32_for(value):
        if isinstance(value, types.Integer):
            return lambda value: widen_bf16(value)
        return lambda value: value

    @overload(_stored)
    def _stored_for(value, out):
        if out.dtype == types.uint16:
            return lambda value, out: narrow_bf16(round_bf16(value))
        return lambda value, out: value


@compiled
def weighted_total(inputs, weights, divisor, fused, out):
    """out = (sum_k inputs[k] * weights[k]) / divisor, no division where divisor is 0; inputs a tuple of 1-D
    contiguous arrays, all bf16 bits (uint16, and out too) or all float32; `fused`: each product added with one
    rounding (see torch_fuses). One variant is compiled per input type and count."""
    n = out.shape[0]
    count = len(inputs)
    total = np.empty(STEP, dtype=np.float32)
    zero = np.float32(0.0)
    for start in range(0, n, STEP):
        m = min(STEP, n - start)
        for j in range(m):
            total[j] = zero
        for k in range(count):
            source = inputs[k][start : start + m]
            w = weights[k]
            if fused:
                for j in range(m):
                    total[j] = fused_multiply_add(_as_float32(source[j]), w, total[j])
            else:
                for j in range(m):
                    total[j] = total[j] + _as_float32(source[j]) * w
        result = out[start : start + m]
        if divisor != zero:
            for j in range(m):
                result[j] = _stored(total[j] / divisor, result)
        else:
            for j in range(m):
                result[j] = _stored(total[j], result)


@functools.cache
def torch_fuses() -> bool:
    """Whether torch's `addcmul` on this machine's CPU adds the product with one rounding (a fused multiply-add):
    asked once, of its vector loop, with x = w = 1 + 2**-12 added to -1, where the product's last bit (2**-24)
    survives only unrounded."""
    x = torch.full((64,), 1 + 2.0**-12)
    total = torch.full((64,), -1.0)
    total.addcmul_(x, torch.tensor(1 + 2.0**-12))
    return float(total[0]) != 2.0**-11


ENABLED = AVAILABLE
"""Whether linear sums go through these loops when they can (tests switch it off to compare with torch)."""


def _kind(tensors: Sequence[torch.Tensor]) -> torch.dtype | None:
    first = tensors[0]
    if first.dtype not in (torch.bfloat16, torch.float32) or not 1 <= len(tensors) <= MAX_INPUTS:
        return None
    for t in tensors:
        if t.dtype != first.dtype or t.device.type != "cpu" or not t.is_contiguous() or t.shape != first.shape:
            return None
    return first.dtype


def weighted_sum(tensors: Sequence[torch.Tensor], weights: Sequence[float], divisor: float) -> torch.Tensor | None:
    """sum_i w_i x_i / divisor (divisor 0: undivided) in the inputs' dtype, as linear_average computes it; None
    where these loops do not apply (the caller takes the torch path)."""
    kind = _kind(tensors) if ENABLED else None
    if kind is None or not KERNELS.ready(tensors[0].numel()):
        return None
    w = np.asarray(weights, dtype=np.float32)
    out = torch.empty_like(tensors[0])
    fused = torch_fuses()
    if kind == torch.bfloat16:
        flat = tuple(t.view(-1).view(torch.int16).numpy().view(np.uint16) for t in tensors)
        weighted_total(flat, w, np.float32(divisor), fused, out.view(-1).view(torch.int16).numpy().view(np.uint16))
    else:
        flat = tuple(t.view(-1).numpy() for t in tensors)
        weighted_total(flat, w, np.float32(divisor), fused, out.view(-1).numpy())
    return out


def _compile_all() -> None:
    """Compile (or load from numba's cache) both loops for every input count, on tiny inputs."""
    bits = np.zeros(1, dtype=np.uint16)
    values = np.zeros(1, dtype=np.float32)
    for count in range(1, MAX_INPUTS + 1):
        w = np.ones(count, dtype=np.float32)
        weighted_total((bits,) * count, w, np.float32(1), True, bits)
        weighted_total((values,) * count, w, np.float32(1), True, values)


KERNELS = KernelGroup("weighted_sum", _compile_all)
"""The loops above, used only once compiled: see compiled.KernelGroup."""
