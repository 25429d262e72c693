"""DARE's and DELLA's float32 arithmetic for one chunk, and their Philox draws, as compiled loops without the GIL.

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
are torch's by construction. Keep flags come as one byte an entry (0 or 1): unpacked by numpy at ~0.05 ns an
entry, they make the loops plain passes that LLVM vectorises.

`philox_draws` computes keyed_random's draws: numpy's Philox-4x64-10 (the Random123 rounds and constants, the
counter numpy would use for each block of four outputs), 0.8 ns an entry against numpy's 1.8, output array
included (`python bench/profile_compiled.py --only Philox`, AMD EPYC with AVX-512; 2.0 before the rounds were
vectorised, see _philox_blocks; numpy's `random_raw` calls the generator through a function pointer per output,
and the state is set per keyed chunk).
Its output is numpy's, bit for bit (tests/test_keyed_kernels.py compares them at any start and length).
"""

from __future__ import annotations

import sys

import numpy as np

from .compiled import AVAILABLE as AVAILABLE  # the switch callers read (keyed_random, keyed_merge)
from .compiled import KernelGroup, compiled, narrow_bf16, round_bf16, widen_bf16
from .compiled import sign as _sign

_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)  # the round multipliers
_PHILOX_W0, _PHILOX_W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)  # the key increments


@compiled
def _positive_part(x):  # torch.clamp_min(x, 0): x unless x < 0 (so -0 and nan stay)
    return np.float32(0.0) if x < 0 else x


@compiled
def _negative_part(x):  # torch.clamp_max(x, 0): x unless x > 0
    return np.float32(0.0) if x > 0 else x


@compiled
def _pick(start, end, weight):  # torch.lerp's vectorised form, for weights 0 and 1: fma(coeff, end - start, base)
    if weight < 0.5:
        return start + weight * (end - start)
    return end + (weight - np.float32(1.0)) * (end - start)


BLOCK = 2048
"""Entries a kernel works on at a time: its per-entry state (weighted vector, sums, votes) lives in arrays of this
size that stay in the L1/L2 cache, and each inner loop is a plain pass over contiguous arrays that LLVM
vectorises. One loop over entries with the vectors' loop inside (branches on every entry's sign and flag, no
vector instructions) took 9-16 ns an entry on random signs, 10x this."""


_LOW32 = np.uint64(0xFFFFFFFF)
_M0_LOW, _M0_HIGH = _PHILOX_M0 & _LOW32, _PHILOX_M0 >> np.uint64(32)
_M1_LOW, _M1_HIGH = _PHILOX_M1 & _LOW32, _PHILOX_M1 >> np.uint64(32)


@compiled
def _high_product(a, b_low, b_high):
    """The high 64 bits of the 128-bit product of a and b = b_high * 2**32 + b_low, from four 32 x 32 -> 64-bit
    products: multiplications the vector units have (a 64 x 64 -> 128-bit one they do not), so a loop over
    independent Philox blocks vectorises."""
    shift = np.uint64(32)
    a_low, a_high = a & _LOW32, a >> shift
    low_low = a_low * b_low
    low_high = a_low * b_high
    high_low = a_high * b_low
    middle = (low_low >> shift) + (low_high & _LOW32) + (high_low & _LOW32)
    return a_high * b_high + (low_high >> shift) + (high_low >> shift) + (middle >> shift)


@compiled
def _philox_round(c0, c1, c2, c3, key0, key1):
    """One Philox-4x64 round: Random123's, its multiplications by _high_product."""
    high0, low0 = _high_product(c0, _M0_LOW, _M0_HIGH), c0 * _PHILOX_M0
    high1, low1 = _high_product(c2, _M1_LOW, _M1_HIGH), c2 * _PHILOX_M1
    return high1 ^ c1 ^ key0, low1, high0 ^ c3 ^ key1, low0


@compiled
def _philox_step(c0, c1, c2, c3, key0, key1):
    """A round, and the key's increment for the next."""
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, key0, key1)
    return c0, c1, c2, c3, key0 + _PHILOX_W0, key1 + _PHILOX_W1


@compiled
def _philox_block(c0, c1, c2, c3, k0, k1):
    """The four 64-bit outputs of Philox-4x64-10 for counter (c0, c1, c2, c3) and key (k0, k1), one block alone (a
    block the range's ends cut: _philox_cut_block; _philox_blocks computes whole ones eight at a time)."""
    for _ in range(10):
        c0, c1, c2, c3, k0, k1 = _philox_step(c0, c1, c2, c3, k0, k1)
    return c0, c1, c2, c3


@compiled
def _philox_blocks(k0, k1, chunk, stream, first_block, last_block, out):
    """Philox-4x64-10 blocks first_block..last_block - 1 of a keyed chunk (counter (block + 1, chunk, stream, 0)),
    their eight 32-bit halves each written to out[8 * (block - first_block):], low half first: the rounds, one
    block an iteration, so that LLVM computes 8 blocks at once in AVX-512 registers. It does only with
    no branch and no inner loop (the ten rounds are written out: LLVM vectorises only innermost loops) and with
    indices that cannot be negative (with an offset added, numba's test for a negative index stayed in the loop).
    0.64 ns a draw here against 1.7 for scalar rounds with 128-bit products, as this module had them before (an ad hoc
    loop of 64k draws;
    `python bench/profile_compiled.py --only Philox` times the whole of MaskStream.draws)."""
    chunk64, stream64 = np.uint64(chunk), np.uint64(stream)
    shift = np.uint64(32)
    for block in range(first_block, last_block):
        c0, c1, c2, c3 = np.uint64(block + 1), chunk64, stream64, np.uint64(0)
        key0, key1 = k0, k1
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3, key0, key1 = _philox_step(c0, c1, c2, c3, key0, key1)
        c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, key0, key1)
        j = 8 * (block - first_block)
        out[j] = np.uint32(c0 & _LOW32)
        out[j + 1] = np.uint32(c0 >> shift)
        out[j + 2] = np.uint32(c1 & _LOW32)
        out[j + 3] = np.uint32(c1 >> shift)
        out[j + 4] = np.uint32(c2 & _LOW32)
        out[j + 5] = np.uint32(c2 >> shift)
        out[j + 6] = np.uint32(c3 & _LOW32)
        out[j + 7] = np.uint32(c3 >> shift)


@compiled
def _philox_cut_block(k0, k1, chunk, stream, block, lo, hi, out, offset):
    """The halves of one Philox block that fall in [lo, hi) of its chunk, to out[offset + position]."""
    words = _philox_block(np.uint64(block + 1), np.uint64(chunk), np.uint64(stream), np.uint64(0), k0, k1)
    first = 8 * block
    for q in range(8):
        if lo <= first + q < hi:
            out[offset + first + q] = np.uint32((words[q // 2] >> np.uint64(32 * (q % 2))) & _LOW32)


@compiled
def philox_draws(k0, k1, stream, start, chunk_size, out):
    """out[i] = 32-bit draw start + i of `stream` (keyed_random.MaskStream.draws: entry j of keyed chunk c is half
    j % 2, low first, of output j // 2 of the chunk, and output o is word o % 4 of the block whose counter is
    (o // 4 + 1, c, stream, 0))."""
    end = start + out.shape[0]
    entry = start
    while entry < end:
        chunk = entry // chunk_size
        lo = entry - chunk * chunk_size
        hi = min(end - chunk * chunk_size, chunk_size)
        offset = chunk * chunk_size - start  # out index of the chunk's entry 0
        whole_first, whole_last = -(-lo // 8), hi // 8  # the blocks wholly inside [lo, hi)
        if whole_last > whole_first:
            _philox_blocks(k0, k1, chunk, stream, whole_first, whole_last, out[offset + 8 * whole_first :])
        first_cut, last_cut = lo // 8, (hi - 1) // 8  # the blocks the range's ends cut, if they do
        first_is_cut = first_cut < whole_first
        if first_is_cut:
            _philox_cut_block(k0, k1, chunk, stream, first_cut, lo, hi, out, offset)
        if last_cut >= whole_last and not (first_is_cut and last_cut == first_cut):
            _philox_cut_block(k0, k1, chunk, stream, last_cut, lo, hi, out, offset)
        entry = chunk * chunk_size + hi


@compiled
def magnitudes(base, x, flags, mags, kept):
    """mags = |x - base| and kept = mags * keep (flags: 0 or 1 an entry), over the chunk."""
    for i in range(base.shape[0]):
        a = abs(x[i] - base[i])
        mags[i] = a
        kept[i] = a * np.float32(flags[i])


STEP = 2048
"""Entries `dare_totals` draws and masks at a time: its draws and flags stay in the L1 cache between the loops
over them. A multiple of 8, so that each step's flags fill whole bytes of the packed mask."""


_PACK_FLAGS = np.uint64(0x8040201008040201 if sys.byteorder == "little" else 0x0102040810204080)
"""Eight flag bytes (0 or 1) read as one native word w: the top byte of w * _PACK_FLAGS holds flag i at bit 7 - i
(numpy's packbits order). Little-endian, flag i is bit 8i of w, and the multiplier has bits 9j (j = 0..7), so the
flag lands on bits 8i + 9j: in the top byte only where i + j = 7, at bit 63 - i; no two product terms share a bit,
so nothing carries into the top byte (big-endian, flag i is bit 8(7 - i) and bits 7k, k = 1..8, do the same).
dare_totals on a cached 1 M-entry chunk, one thread: 1.86 against 2.05 ns an entry with a shift a flag."""


@compiled
def dare_totals(base, x, k0, k1, stream, start, chunk_size, threshold, draws, flags, mags, kept, packed, sums, block,
                tree):
    """A DARE task vector's part of one chunk of the totals pass, in one loop nest: its draws (philox_draws, from
    entry `start` of `stream`), the keep flags draw < threshold (keyed_merge._dare_keep's test), mags = |x - base|
    and kept = mags * keep (`magnitudes`' arithmetic), and the flags packed 8 to a byte, the first in the high bit,
    zeros after the last (numpy's packbits). `x`: the input's bfloat16 bits, widened here (widen_into's
    conversion); `base`: the base in float32. `draws` and `flags`: STEP-entry scratch.

    Why one loop nest: done as before, a vector's chunk was five calls (widen, draws, a numpy comparison and a
    packbits that each allocate their result, magnitudes), each a pass over the chunk and a hand-over of the GIL
    between the workers; here the draws and flags of STEP entries stay in the L1 cache and the chunk is one call
    that allocates nothing. Measured (AMD EPYC, one thread): the loops cost what the five steps did, 0.85 ns an
    entry on a cached 256 K-entry chunk, and the totals pass the same 2.3-2.4 ns an entry by
    `python bench/profile_compiled.py --only "keyed totals"`; where the steps' results are fresh memory (a process
    that has not yet raised glibc's mmap threshold) the pass took 2.7-2.9 ns against 2.4. A cold 1b dare_ties merge
    made ~10% fewer context switches (`perf stat -e context-switches`: 102-108 K against 115-124 K) in about the
    same time (7.3-7.7 s against 7.6-7.7 s, three alternating runs each).

    `sums` (float32, 2 rows, or no columns: none wanted): row 0 gets the pairwise sums (tree_block_sums, `tree` its
    scratch) of mags over each whole `block` of entries from the chunk's first (a multiple of STEP), row 1 those of
    kept, as each block is done, while it is in the cache: reductions.BlockedTotal's block sums, for a chunk that
    starts on one of its blocks; an entry past the last whole block is the caller's to add. Added by the caller
    instead, the sums were ~0.4 ns of the totals pass's ~2.5 ns an entry (a call and Python a chunk and vector)."""
    n = base.shape[0]
    words = flags.view(np.uint64)
    for j0 in range(0, n, STEP):
        m = min(STEP, n - j0)
        philox_draws(k0, k1, stream, start + j0, chunk_size, draws[:m])
        b = base[j0 : j0 + m]
        xs = x[j0 : j0 + m]
        mg = mags[j0 : j0 + m]
        kp = kept[j0 : j0 + m]
        for i in range(m):
            flags[i] = draws[i] < threshold
        for i in range(m):
            a = abs(widen_bf16(xs[i]) - b[i])
            mg[i] = a
            kp[i] = a * np.float32(flags[i])
        for i in range(m, -(-m // 8) * 8):
            flags[i] = 0
        out = packed[j0 // 8 :]
        for q in range(-(-m // 8)):  # eight 0/1 flag bytes to one byte by a multiplication (_PACK_FLAGS)
            out[q] = np.uint8((words[q] * _PACK_FLAGS) >> np.uint64(56))
        done = j0 + m
        if sums.shape[1] > 0 and done % block == 0:
            b = done // block - 1
            tree_block_sums(mags[b * block : done], block, tree, sums[0, b : b + 1])
            tree_block_sums(kept[b * block : done], block, tree, sums[1, b : b + 1])


@compiled
def tree_block_sums(values, block, scratch, out):
    """out[b] = the pairwise sum of values[b * block : (b + 1) * block] (block a power of two, scratch block // 2
    entries): halves added entry by entry, then halves of those, down to one; reductions.tree_block_sums' torch
    operations in the same order, so the same bits, at ~0.05 ns an entry (each level slices from 0: a computed
    index would keep LLVM from vectorising, 0.30 ns)."""
    half = block // 2
    for b in range(out.shape[0]):
        start = b * block
        low = values[start : start + half]
        high = values[start + half : start + block]
        for i in range(half):
            scratch[i] = low[i] + high[i]
        width = half // 2
        while width >= 1:
            head = scratch[:width]
            tail = scratch[width : 2 * width]
            for i in range(width):
                head[i] = head[i] + tail[i]
            width //= 2
        out[b] = scratch[0]


@compiled
def widen_into(bits, out):
    """out = the float32 of each bfloat16 in `bits` (its uint16 bit patterns): exact, as torch's copy_ converts."""
    for i in range(bits.shape[0]):
        out[i] = widen_bf16(bits[i])


@compiled
def narrow_into(values, out):
    """out = the bfloat16 bits of each float32 in `values`, rounded to nearest-even as torch converts; returns the
    number of nans, whose bits torch sets its own way (0xFFFF from its vector loop, 0x7FC0 from its scalar tail): a
    caller that finds any converts those values with torch instead."""
    nans = 0
    for i in range(values.shape[0]):
        v = values[i]
        nans += v != v
        out[i] = narrow_bf16(round_bf16(v))
    return nans


@compiled
def _add_vector(k, w, count, consensus, normalize, weight, pos, neg, votes, pos_w, neg_w):
    """Fold task vector k's weighted entries w[:count] into the sums of a block (keyed_merge._mix's operations)."""
    if consensus == 0:
        if k == 0:
            pos[:count] = w[:count]
        else:
            for j in range(count):
                pos[j] = pos[j] + w[j]
        return
    if k == 0:
        for j in range(count):
            pos[j] = _positive_part(w[j])
            neg[j] = _negative_part(w[j])
            votes[j] = _sign(w[j])
    else:
        for j in range(count):
            pos[j] = pos[j] + _positive_part(w[j])
            neg[j] = neg[j] + _negative_part(w[j])
            votes[j] = votes[j] + _sign(w[j])
    if normalize:
        for j in range(count):
            s = _sign(w[j])
            pos_w[j] = pos_w[j] + weight * _positive_part(s)
            neg_w[j] = neg_w[j] + (-weight) * _negative_part(s)


@compiled
def _mixed(base, pos, neg, votes, pos_w, neg_w, consensus, normalize, divisor, lam, scale):
    """An entry's result once every task vector is folded into its sums: base + lam * the mix. Scalars only: an
    array argument costs a reference count update per call, per entry here (~60 ns an entry, measured)."""
    one = np.float32(1.0)
    if consensus == 0:
        acc = pos
        if normalize:
            acc = acc / divisor
    else:
        v = pos + neg if consensus == 1 else votes
        elected = min(_sign(v) + one, one)
        acc = _pick(neg, pos, elected)
        if normalize:
            share = _pick(neg_w, pos_w, elected)
            share = share + -(abs(_sign(share)) - one)  # 1 where no vector is on the elected side
            acc = acc / share
    if scale:
        acc = acc * lam
    return acc + base


@compiled
def mix(base, xs, flags, masked, factors, weights, consensus, normalize, divisor, lam, scale, out):
    """out = base + lam * mix of the task vectors xs[k] - base, masked (where masked[k]) by the 0/1 flags of row
    k of `flags` and multiplied by factors[k]: keyed_merge.merge's and keyed_merge._mix's operations, entry by entry.
    consensus: 0 none, 1 sum, 2 count (compiled.CONSENSUS_CODES); `divisor` is the no-consensus normaliser; `scale`
    says whether lam multiplies (keyed_merge skips the multiplication for lam == 1)."""
    zero = np.float32(0.0)
    w = np.empty(BLOCK, dtype=np.float32)
    pos = np.empty(BLOCK, dtype=np.float32)  # the sum without consensus
    neg = np.empty(BLOCK, dtype=np.float32)
    votes = np.empty(BLOCK, dtype=np.float32)
    pos_w = np.empty(BLOCK, dtype=np.float32)
    neg_w = np.empty(BLOCK, dtype=np.float32)
    n = base.shape[0]
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        b = base[start : start + count]
        pos_w[:count] = zero
        neg_w[:count] = zero
        for k in range(xs.shape[0]):
            x = xs[k, start : start + count]
            factor = factors[k]
            if masked[k]:  # w = (x - base) * keep * factor, in torch's order
                keep = flags[k, start : start + count]
                for j in range(count):
                    w[j] = ((x[j] - b[j]) * np.float32(keep[j])) * factor
            else:
                for j in range(count):
                    w[j] = (x[j] - b[j]) * factor
            _add_vector(k, w, count, consensus, normalize, weights[k], pos, neg, votes, pos_w, neg_w)
        o = out[start : start + count]
        for j in range(count):
            o[j] = _mixed(b[j], pos[j], neg[j], votes[j], pos_w[j], neg_w[j], consensus, normalize, divisor, lam, scale)


@compiled
def mix_bf16(base, xs, packed, masked, factors, weights, consensus, normalize, divisor, lam, scale, out):
    """`mix` for bfloat16 inputs and output, straight from and to their bits: `base` and the rows of `xs` are
    uint16 bit patterns, widened here; the keep flags of task vector k are row k of `packed`, 8 to a byte as the
    totals pass packed them (numpy's packbits: the first entry in the high bit); out gets the bits of each result
    rounded to nearest-even (keyed_kernels.narrow_into's rounding). Returns the number of nan results, whose bits
    torch sets its own way: a caller that finds any rounds that chunk again by torch (keyed_merge._round_into).

    Why: `mix` reads float32 copies of the inputs and 0/1 bytes of the flags, made by a widening pass per input and
    numpy's unpackbits, and writes a float32 result that a last pass rounds: on a 256 K-entry chunk those arrays are
    ~4.5 MB, beyond a core's L2 cache, and each pass is a call that hands the GIL over between the workers. Here
    a BLOCK of entries is widened, unpacked, mixed and rounded while it stays in the L1 cache, in one call."""
    zero = np.float32(0.0)
    base32 = np.empty(BLOCK, dtype=np.float32)
    keep = np.empty(BLOCK, dtype=np.uint8)
    mixed = np.empty(BLOCK, dtype=np.float32)
    w = np.empty(BLOCK, dtype=np.float32)
    pos = np.empty(BLOCK, dtype=np.float32)
    neg = np.empty(BLOCK, dtype=np.float32)
    votes = np.empty(BLOCK, dtype=np.float32)
    pos_w = np.empty(BLOCK, dtype=np.float32)
    neg_w = np.empty(BLOCK, dtype=np.float32)
    n = base.shape[0]
    nans = 0
    for start in range(0, n, BLOCK):  # BLOCK is a multiple of 8: a block starts on a whole byte of the flags
        count = min(BLOCK, n - start)
        bits = base[start : start + count]
        for j in range(count):
            base32[j] = widen_bf16(bits[j])
        pos_w[:count] = zero
        neg_w[:count] = zero
        for k in range(xs.shape[0]):
            x = xs[k, start : start + count]
            factor = factors[k]
            if masked[k]:
                _unpack_flags(packed[k, start // 8 :], count, keep)
                for j in range(count):
                    w[j] = ((widen_bf16(x[j]) - base32[j]) * np.float32(keep[j])) * factor
            else:
                for j in range(count):
                    w[j] = (widen_bf16(x[j]) - base32[j]) * factor
            _add_vector(k, w, count, consensus, normalize, weights[k], pos, neg, votes, pos_w, neg_w)
        for j in range(count):  # apart from the rounding: one loop with both ran ~10% slower
            mixed[j] = _mixed(base32[j], pos[j], neg[j], votes[j], pos_w[j], neg_w[j], consensus, normalize, divisor,
                              lam, scale)
        o = out[start : start + count]
        for j in range(count):
            v = mixed[j]
            nans += v != v
            o[j] = narrow_bf16(round_bf16(v))
    return nans


_FLAG_WORDS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).view(np.uint64).reshape(256)
"""The eight flag bytes of each packed byte (its high bit first, numpy's unpackbits), as one native 64-bit word."""


@compiled
def _unpack_flags(packed, count, flags):
    """flags[:count] = the first `count` bits of `packed`, the high bit of each byte first (numpy's unpackbits);
    `flags` holds a multiple of 8 bytes. A packed byte's eight flags are one word of _FLAG_WORDS, stored at once:
    mix_bf16 on two masked task vectors with the sum consensus, 2.2 against 2.9 ns an entry (one thread, AMD EPYC
    family 25) with a shift and a store per flag."""
    words = flags.view(np.uint64)
    for q in range(-(-count // 8)):
        words[q] = _FLAG_WORDS[packed[q]]


def _compile_all() -> None:
    """Compile (or load from numba's cache) every loop here, on tiny inputs (~0.4 s from the cache, seconds to
    compile)."""
    one = np.zeros(1, dtype=np.float32)
    flags = np.zeros((1, 1), dtype=np.uint8)
    philox_draws(np.uint64(0), np.uint64(0), 0, 0, 8, np.empty(1, dtype=np.uint32))
    magnitudes(one, one, flags[0], one, one)
    bits = np.zeros(1, dtype=np.uint16)
    draws, step_flags = np.empty(STEP, dtype=np.uint32), np.empty(STEP, dtype=np.uint8)
    no_sums = np.zeros((2, 0), dtype=np.float32)
    dare_totals(one, bits, np.uint64(0), np.uint64(0), 0, 0, 8, np.uint32(1), draws, step_flags, one, one, flags[0],
                no_sums, 2, one)
    widen_into(bits, one)
    narrow_into(one, bits)
    tree_block_sums(np.zeros(2, dtype=np.float32), 2, one, one)
    masked = np.ones(1, dtype=np.bool_)
    for consensus in (0, 1):
        mix(one, one.reshape(1, 1), flags, masked, one, one, consensus, True, np.float32(1), np.float32(1), True, one)
        mix_bf16(bits, bits.reshape(1, 1), flags, masked, one, one, consensus, True, np.float32(1), np.float32(1), True,
                 bits)


KERNELS = KernelGroup("keyed_kernels", _compile_all)
"""The loops above, used (by keyed_merge and keyed_random) only once compiled: see compiled.KernelGroup."""


def warm() -> bool:
    """Compile (or load) the loops here now and wait for it: whether they are ready."""
    return KERNELS.wait()
