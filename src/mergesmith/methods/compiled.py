"""numba, where it is installed: the decorator the compiled loops of this package share.

Why a module of its own: keyed_kernels.py (DARE's and DELLA's chunks, the Philox draws) and introsort_replay.py
(TIES' magnitude selection) compile their loops the same way, and both fall back to their numpy/torch paths
where numba cannot be imported (a platform without a wheel): one place says whether it can and how.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

try:  # a dependency; the fallbacks are exercised by the tests through each module's switch
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

AVAILABLE = njit is not None


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled to machine code that runs without the GIL, cached on disk (the first use in a fresh
    install compiles for about a second, later processes load it in ~0.1 s), with numpy's float semantics (a
    division by zero gives inf or nan, not an exception); `function` itself where numba is missing."""
    if njit is None:
        return function
    return njit(nogil=True, cache=True, error_model="numpy")(function)


@compiled
def sign(x):
    """torch.sign of a float32: (0 < x) - (x < 0), so +0 for zeros and nan."""
    if x > 0:
        return np.float32(1.0)
    if x < 0:
        return np.float32(-1.0)
    return np.float32(0.0)


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def float32_from_bits(typingctx, bits):
        """The float32 whose IEEE bits are the uint32 `bits` (a bitcast: no instruction)."""

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @intrinsic
    def bits_from_float32(typingctx, value):
        """The IEEE bits of the float32 `value`, as a uint32."""

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen
