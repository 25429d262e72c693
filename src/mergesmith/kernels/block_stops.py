"""The stops of one scan step of a Hoare partition: which of 64 entries stop the scan, as their offsets in order.

Why a module of its own, and why by hand: introsort_replay's partition gathers, 64 entries at a time, the offsets of
the entries that stop each of Hoare's two scans (an entry the pivot does not precede, from the left; one that does
not precede the pivot, from the right), then exchanges the i-th stop from the left with the i-th from the right.
Written as a loop (`out[count] = t; count += key <= pivot`), the gather is a chain through `count` that LLVM does
not vectorise: one entry a step. A CPU with AVX-512 does it in a few instructions, a comparison of the 64 keys
into a mask and a compress of the offsets 0..63 by that mask (vpcompressd), which no library offers to numba's
loops: here they are emitted as LLVM IR (numba's `intrinsic`), with LLVM's generic
`llvm.experimental.vector.compress` (LLVM 19 and later), 16 lanes at a time, each compressed into a register and
stored whole. Compressing straight into memory (`llvm.masked.compressstore`, vpcompressd with a memory operand)
is microcoded on AMD's Zen 4 and made the replay slower than the loop: 4.26 against 3.05 ns an entry.

Measured on the 1 B bench's `model.layers.3.mlp.up_proj.weight` task vector (11.5 M bf16 magnitudes, TIES' top
half; one thread, AMD EPYC family 25 (Zen 4), min of 5, `python bench/profile_replay.py`): the replay following no
entries 1.50-1.54 against 3.05 ns an entry with the loop, following by ids the 1.9% that the window's end splits
2.56-2.78 against 4.16; the window the same bytes. The cold 1b TIES merge, three alternating pairs against the
loop: 12.2-12.6 s against 13.5-15.0 s, 16.3-16.8 against 20.5-21.1 user CPU-s (bench/README.md, ninth session).

Where the target CPU has no AVX-512 (or LLVM is older than 19) the loop is compiled instead: LLVM would expand
the compress into one conditional store a lane, no faster than the loop. Which one is decided when numba compiles
(by the features of the CPU it compiles for), so nothing is tested per call; the tests compare both on the same
blocks (tests/test_block_stops.py).
"""

from __future__ import annotations

from typing import Any

from .compiled import compiled, numba_extension

BLOCK = 64
"""Entries a gather looks at: the out buffer holds BLOCK + SPILL offsets."""

LANES = 16
"""Offsets compressed at a time (int32 in one 512-bit register)."""

SPILL = LANES
"""Extra room the out buffer needs: each group of LANES offsets is stored whole at the count so far, so the last
store may write up to LANES - 1 offsets past the block's last stop (never read)."""


def forward_stops(entries, first, pivot, key_shift, at_most, out):  # noqa: ARG001 - typed by its overload below
    """Writes to out[:count] the offsets t in 0..BLOCK-1, ascending, of the entries at first + t whose key
    (entry >> key_shift) is <= pivot (at_most) or >= pivot (not at_most); returns count. `out`: int32, at least
    BLOCK + SPILL entries."""
    raise NotImplementedError


def backward_stops(entries, last, pivot, key_shift, at_most, out):  # noqa: ARG001 - typed by its overload below
    """forward_stops from `last` down: the offsets t, ascending, of the entries at last - t (t in 0..BLOCK-1)."""
    raise NotImplementedError


def matching_bits(entries, first, low, high):  # noqa: ARG001 - typed by its overload below
    """The BLOCK-bit mask (a uint64) of the entries from `first` equal to `low` or to `high`: bit t for the entry at
    first + t. A comparison of the block and a move of its mask bits on any CPU with vector compares (LLVM lowers
    it with AVX-512's mask registers or SSE/AVX2's movemask), so no loop version is needed; a caller walks the set
    bits (numba's trailing_zeros) where matches are rare: ~0.1 ns an entry to find them (see introsort_replay)."""
    raise NotImplementedError


def lowest_bit(bits):  # noqa: ARG001 - typed by its overload below
    """The index of the lowest set bit of a nonzero uint64 (one instruction: numba's trailing_zeros)."""
    raise NotImplementedError


def target_compresses() -> bool:
    """Whether numba compiles for a CPU with AVX-512 (its own host, unless NUMBA_CPU_NAME names another) with an
    LLVM that has the generic compress (19 or later)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if llvm.llvm_version_info < (19,):
        return False
    if config.CPU_NAME and config.CPU_NAME != "host":
        return "+avx512f" in (config.CPU_FEATURES or "").split(",")
    return bool(llvm.get_host_cpu_features().get("avx512f", False))


COMPRESS: bool | None = None
"""The way forward_stops and backward_stops are compiled, once numba is loaded: True by compress, False by the loop."""


@compiled
def stops_by_loop(entries, first, pivot, key_shift, at_most, backward, out):
    """forward_stops (from `first` up) or backward_stops (from `first` down) by a loop, one entry a step."""
    count = 0
    step = -1 if backward else 1
    if at_most:
        for t in range(BLOCK):
            out[count] = t
            count += (entries[first + step * t] >> key_shift) <= pivot
    else:
        for t in range(BLOCK):
            out[count] = t
            count += (entries[first + step * t] >> key_shift) >= pivot
    return count


_forward_compress: Any = None
_backward_compress: Any = None


@compiled
def stops_by_compress(entries, first, pivot, key_shift, at_most, backward, out):
    """stops_by_loop by compare and compress (LLVM 19 or later; any CPU, fast with AVX-512)."""
    if backward:
        return _backward_compress(entries, first - BLOCK + 1, pivot, key_shift, at_most, out)
    return _forward_compress(entries, first, pivot, key_shift, at_most, out)


def _splat(context: Any, builder: Any, value: Any, value_type: Any, element_type: Any) -> Any:
    """A BLOCK-lane vector of `value` (of numba type value_type) cast to element_type (a numba integer type)."""
    from llvmlite import ir

    element = context.get_data_type(element_type)
    block_type = ir.VectorType(element, BLOCK)
    cast = context.cast(builder, value, value_type, element_type)
    one = builder.insert_element(ir.Constant(block_type, ir.Undefined), cast, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(block_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), BLOCK), [0] * BLOCK))


def _load_block(context: Any, builder: Any, array_type: Any, array: Any, first: Any) -> Any:
    """The BLOCK entries of a contiguous array from index `first`, as one vector."""
    from llvmlite import ir

    element = context.get_data_type(array_type.dtype)
    block_type = ir.VectorType(element, BLOCK)
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.load(builder.bitcast(builder.gep(data, [first]), block_type.as_pointer()), align=element.width // 8)


def _matching_intrinsic() -> Any:
    """An intrinsic (entries, first, low, high) -> uint64: matching_bits."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    def matching(typingctx, entries, first, low, high):
        signature = types.uint64(entries, first, low, high)

        def codegen(context, builder, sig, args):
            entries_value, first_value, low_value, high_value = args
            element_type = sig.args[0].dtype
            block = _load_block(context, builder, sig.args[0], entries_value, first_value)
            equal_low = builder.icmp_signed("==", block, _splat(context, builder, low_value, sig.args[2], element_type))
            equal_high = builder.icmp_signed("==", block,
                                             _splat(context, builder, high_value, sig.args[3], element_type))
            return builder.bitcast(builder.or_(equal_low, equal_high), ir.IntType(BLOCK))

        return signature, codegen

    return intrinsic(matching)


def _compress_intrinsic(reverse: bool) -> Any:
    """An intrinsic (entries, first, pivot, key_shift, at_most, out) -> count over the BLOCK entries from `first`:
    their keys compared with the pivot into a BLOCK-bit mask (reversed for a backward scan, so that offset t is
    the entry at first + BLOCK - 1 - t), then, LANES at a time, the offsets compressed by the mask and stored at
    out[count so far]."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i1, i32, i64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)

    def stops(typingctx, entries, first, pivot, key_shift, at_most, out):
        signature = types.int64(entries, first, pivot, key_shift, at_most, out)

        def codegen(context, builder, sig, args):
            entries_value, first_value, pivot_value, shift_value, at_most_value, out_value = args
            element_type = sig.args[0].dtype
            block = _load_block(context, builder, sig.args[0], entries_value, first_value)
            keys = builder.ashr(block, _splat(context, builder, shift_value, sig.args[3], element_type))
            pivots = _splat(context, builder, pivot_value, sig.args[2], element_type)
            at_most_flag = context.cast(builder, at_most_value, sig.args[4], types.boolean)
            mask = builder.select(at_most_flag, builder.icmp_signed("<=", keys, pivots),
                                  builder.icmp_signed(">=", keys, pivots))
            if reverse:
                mask = builder.shuffle_vector(mask, ir.Constant(mask.type, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, BLOCK), list(range(BLOCK - 1, -1, -1))))
            lanes_type = ir.VectorType(i32, LANES)
            lane_mask_type = ir.VectorType(i1, LANES)
            compress = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lanes_type, [lanes_type, lane_mask_type, lanes_type]),
                f"llvm.experimental.vector.compress.v{LANES}i32")
            popcount = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
            out_array = context.make_array(sig.args[5])(context, builder, value=out_value)
            count = ir.Constant(i64, 0)
            for group in range(BLOCK // LANES):
                offsets = list(range(group * LANES, (group + 1) * LANES))
                group_mask = builder.shuffle_vector(mask, ir.Constant(mask.type, ir.Undefined),
                                                    ir.Constant(ir.VectorType(i32, LANES), offsets))
                packed = builder.call(compress, [ir.Constant(lanes_type, offsets), group_mask,
                                                 ir.Constant(lanes_type, ir.Undefined)])
                target = builder.gep(out_array.data, [count])
                builder.store(packed, builder.bitcast(target, lanes_type.as_pointer()), align=4)
                bits = builder.zext(builder.bitcast(group_mask, ir.IntType(LANES)), i64)
                count = builder.add(count, builder.call(popcount, [bits]))
            return count

        return signature, codegen

    stops.__name__ = "backward_stops_by_compress" if reverse else "forward_stops_by_compress"
    return intrinsic(stops)


@numba_extension
def _typing() -> None:
    """The compress intrinsics (LLVM 19 or later) and the overloads of forward_stops and backward_stops, by
    compress where the target has AVX-512, else by the loop (see the module docstring), registered once numba is
    loaded (compiled.numba_extension)."""
    global COMPRESS, _forward_compress, _backward_compress
    import llvmlite.binding as llvm
    from numba.extending import overload

    if llvm.llvm_version_info >= (19,):
        _forward_compress, _backward_compress = _compress_intrinsic(reverse=False), _compress_intrinsic(reverse=True)
    COMPRESS = target_compresses()
    gather = stops_by_compress if COMPRESS else stops_by_loop
    matching = _matching_intrinsic()

    @overload(matching_bits)
    def _matching(entries, first, low, high):
        return lambda entries, first, low, high: matching(entries, first, low, high)

    from numba.cpython.unsafe.numbers import trailing_zeros

    @overload(lowest_bit)
    def _lowest(bits):
        return lambda bits: trailing_zeros(bits)

    @overload(forward_stops)
    def _forward(entries, first, pivot, key_shift, at_most, out):
        return lambda entries, first, pivot, key_shift, at_most, out: gather(entries, first, pivot, key_shift,
                                                                             at_most, False, out)

    @overload(backward_stops)
    def _backward(entries, last, pivot, key_shift, at_most, out):
        return lambda entries, last, pivot, key_shift, at_most, out: gather(entries, last, pivot, key_shift,
                                                                            at_most, True, out)
