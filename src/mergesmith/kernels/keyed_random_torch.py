"""keyed_random's Philox draws computed with torch integer operations, on whatever device the tensors are on.

Why: DARE's and DELLA's keep masks must be the same bits on every device (the merged bytes may not depend on
where the arithmetic ran), and keyed_random.MaskStream draws them on the CPU with numpy's Philox-4x64-10 (or
keyed_kernels' compiled copy of it). On a GPU that made the merge wait on the CPU for every mask and copy the
mask over (issue 33: dare_ties on an H100 was CPU-bound). Here the same generator is written as elementwise
torch operations over blocks of the counter, so the draws are computed on the GPU itself, bit for bit those of
the CPU stream (tests/test_keyed_random_torch.py compares them with numpy's generator).

Nothing here relies on integer overflow, whose result C++ leaves undefined for signed types (torch has no
unsigned 64-bit arithmetic on every device): each 64-bit Philox word is held as two int64 tensors of 32-bit
halves, and the 64x64 -> 128-bit products of a round multiply a 32-bit half by a 16-bit limb of the constant
(< 2**48), summed in 16-bit columns with explicit carries (every intermediate < 2**51). The keying (counter
(1 + block, chunk, stream, 0), key (seed, KEY_TAG), draws the low then the high half of each output) is
keyed_random's; see MaskStream._chunk.

On the CPU this is not used: measured by `python bench/philox_torch.py` (4M draws, one thread of a shared
2-core machine), numpy's generator takes ~2.4 ns a draw, keyed_kernels' compiled one ~2 ns, and these torch
operations ~20 ns (each of their ~500 operations per call passes over the whole array). On a GPU the same
operations run at the device's memory speed, and a call costs ~500 kernel launches whatever its size, so
callers draw a keyed chunk range at a time or more (MaskStream.draws_on).
"""

from __future__ import annotations

import torch

KEY_TAG = 0x6D65726765736D74
"""keyed_random's second key word ("mergesmt")."""

ROUNDS = 10
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157  # the round multipliers (Random123's Philox-4x64)
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B  # the key increments
_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF

PIECE = 1 << 22
"""Draws computed at a time: the work tensors hold one int64 per block of 8 draws (4 MB each for a piece of
this size, a few dozen alive at once), and a piece this large amortises the per-operation launch cost on a GPU."""


def _limbs(value: int) -> tuple[int, int, int, int]:
    """The 16-bit limbs of a 64-bit constant, lowest first."""
    return tuple((value >> (16 * k)) & _LOW16 for k in range(4))  # type: ignore[return-value]


_M0_LIMBS, _M1_LIMBS = _limbs(_M0), _limbs(_M1)

Word = tuple[torch.Tensor, torch.Tensor]
"""A 64-bit word of every block: (high 32 bits, low 32 bits) as int64 tensors with values in [0, 2**32)."""


def _mulhilo(word: Word, limbs: tuple[int, int, int, int]) -> tuple[Word, Word]:
    """(high, low) 64-bit halves of the 128-bit product word * constant (given by its 16-bit limbs).

    The product is the sum of x_i * m_k at bit 32 i + 16 k (x_i: the word's 32-bit halves, m_k: the limbs),
    each < 2**48; summed in 16-bit columns (at most two terms a column, < 2**49) and carried column by column,
    the result's 16-bit limbs come out one at a time."""
    x1, x0 = word
    m0, m1, m2, m3 = limbs
    columns = (x0 * m0, x0 * m1, x0 * m2 + x1 * m0, x0 * m3 + x1 * m1, x1 * m2, x1 * m3)
    out = []
    carry: torch.Tensor | int = 0
    for column in columns:
        total = column + carry
        out.append(total & _LOW16)
        carry = total >> 16  # total >= 0: the arithmetic shift is the logical one
    out.append(carry & _LOW16)  # type: ignore[operator]
    out.append(carry >> 16)  # type: ignore[operator]
    halves = [out[2 * h] | (out[2 * h + 1] << 16) for h in range(4)]  # < 2**32 each
    return (halves[3], halves[2]), (halves[1], halves[0])


def _xor(word: Word, key: int) -> Word:
    return word[0] ^ (key >> 32), word[1] ^ (key & _LOW32)


def _xor_words(a: Word, b: Word) -> Word:
    return a[0] ^ b[0], a[1] ^ b[1]


def philox_blocks(counter: tuple[Word, Word, Word, Word], key: tuple[int, int]) -> tuple[Word, Word, Word, Word]:
    """The four 64-bit outputs of Philox-4x64-10 for each block's counter (c0, c1, c2, c3) and the key (k0, k1):
    keyed_kernels._philox_block, a block per tensor entry."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(ROUNDS):
        high0, low0 = _mulhilo(c0, _M0_LIMBS)
        high1, low1 = _mulhilo(c2, _M1_LIMBS)
        c0, c1, c2, c3 = _xor(_xor_words(high1, c1), k0), low1, _xor(_xor_words(high0, c3), k1), low0
        k0 = (k0 + _W0) & _MASK64
        k1 = (k1 + _W1) & _MASK64
    return c0, c1, c2, c3


def _split(value: torch.Tensor) -> Word:
    """A non-negative int64 tensor (< 2**63) as a word."""
    return value >> 32, value & _LOW32


def _constant(value: int, like: torch.Tensor) -> Word:
    return torch.full_like(like, value >> 32), torch.full_like(like, value & _LOW32)


def draws(seed: int, stream: int, start: int, count: int, chunk: int, device: torch.device | str) -> torch.Tensor:
    """The 32-bit draws start, ..., start + count - 1 of `stream` (keyed_random.MaskStream.draws, same bits) as an
    int64 tensor on `device`, values in [0, 2**32). `chunk` is keyed_random.CHUNK (a multiple of 8)."""
    out = torch.empty(count, dtype=torch.int64, device=device)
    for first in range(start, start + count, PIECE):
        piece = min(PIECE, start + count - first)
        out[first - start : first - start + piece] = _piece(seed, stream, first, piece, chunk, torch.device(device))
    return out


def _piece(seed: int, stream: int, start: int, count: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Draws [start, start + count): block g (global, 8 draws each) is block g % (chunk / 8) of keyed chunk
    g // (chunk / 8), counter (1 + that, chunk, stream, 0)."""
    per_chunk = chunk // 8
    first, last = start // 8, (start + count - 1) // 8
    blocks = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    counter = (
        _split(blocks % per_chunk + 1),
        _split(blocks // per_chunk),
        _constant(stream & _MASK64, blocks),
        _constant(0, blocks),
    )
    words = philox_blocks(counter, (seed & _MASK64, KEY_TAG))
    halves = torch.stack([half for high, low in words for half in (low, high)], dim=1)  # low half first
    skip = start - 8 * first
    return halves.reshape(-1)[skip : skip + count]

