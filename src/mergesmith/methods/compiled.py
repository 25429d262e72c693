"""numba, where it is installed: what the compiled loops of this package share.

Why a module of its own: keyed_kernels.py (DARE's and DELLA's chunks, the Philox draws), introsort_replay.py
(TIES' magnitude selection) and bf16_mix.py (TIES' bfloat16 mix) compile their loops the same way, and all fall
back to their numpy/torch paths where numba cannot be imported (a platform without a wheel): one place says
whether it can and how, and holds the helpers they share (torch's sign, the consensus codes, and the bit-level
intrinsics, which exist only with numba: the loops that call them are never called without it).
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

CONSENSUS_CODES = {None: 0, "sum": 1, "count": 2}
"""How the compiled mixes are told the sign consensus (none, `sum`, `count`)."""


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled to machine code that runs without the GIL, cached on disk (the first use in a fresh
    install compiles for about a second, later processes load it in ~0.1 s), with numpy's float semantics (a
    division by zero gives inf or nan, not an exception); `function` itself where numba is missing."""
    if njit is None:
        return function
    return njit(nogil=True, cache=True, error_model="numpy")(function)


@compiled
def sign(x):
    """torch.sign of a float32: (0 < x) - (x < 0), so +0 for zeros and nan; without a branch, so that loops
    calling it vectorise."""
    return np.float32(x > 0) - np.float32(x < 0)


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

    @intrinsic
    def mulhilo64(typingctx, a, b):
        """(high, low) 64-bit halves of the 128-bit product a * b (one `mul` instruction on x86-64)."""
        signature = types.UniTuple(types.uint64, 2)(types.uint64, types.uint64)

        def codegen(context, builder, sig, args):
            wide = ir.IntType(128)
            product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
            high = builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))
            low = builder.trunc(product, ir.IntType(64))
            return context.make_tuple(builder, sig.return_type, (high, low))

        return signature, codegen
