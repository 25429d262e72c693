"""keyed_random's Philox draws computed with torch integer operations, on whatever device the tensors are on.

Why: DARE's and DELLA's keep masks must be the same bits on every device (the merged bytes may not depend on
where the arithmetic ran), and keyed_random.MaskStream draws them on the CPU with numpy's Philox-4x64-10 (or
keyed_kernels' compiled copy of it). On a GPU that made the merge wait on the CPU for every mask and copy the
mask over (issue 33: dare_ties on an H100 was CPU-bound). Here the same generator is written as elementwise
torch operations over blocks of the counter, so the draws are computed on the GPU itself, bit for bit those of
the CPU stream (tests/test_keyed_random_torch.py compares them with numpy's generator).

Nothing here relies on integer overflow, whose result C++ leaves undefined for signed types (torch has no
unsigned 64-bit arithmetic on every device): each 64-bit Philox word is held as two int64 32-bit halves, and the
64x64 -> 128-bit products of a round multiply a 32-bit half by a 16-bit limb of the constant (< 2**48), summed in
16-bit columns with explicit carries (every intermediate < 2**51). The state of all blocks is one (4 words, 2
halves, blocks) tensor and a round's two products are computed stacked, so a round is ~20 tensor operations
whatever the number of blocks: on a GPU a call costs ~200 kernel launches plus memory-speed passes, and callers
draw a few million entries at a time (keyed_random.MaskStream.draws_on's window). The keying (counter
(1 + block, chunk, stream, 0), key (seed, KEY_TAG), the low then the high half of each output) is keyed_random's;
see MaskStream._chunk.

On the CPU this is not used: measured by `python bench/philox_torch.py` (4M draws, one thread, AMD EPYC, a shared
2-core machine, torch 2.13), numpy's generator takes ~1.5 ns a draw, keyed_kernels' compiled copy ~1.4 ns, and
these torch operations ~47 ns (in pieces of CPU_PIECE draws; ~125 ns in pieces of PIECE, out of the cache).
No GPU was available to time it there.
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
"""Draws computed at a time on a GPU: the work tensors hold one int64 per block of 8 draws per 32-bit quarter (a
few dozen MB for a piece of this size), and a piece this large amortises the launch cost of an operation."""

CPU_PIECE = 1 << 16
"""Draws computed at a time on the CPU (only when asked for: keyed_random draws with numpy there): the work tensors
stay in the cache, ~2.5x faster than PIECE at a time (bench/philox_torch.py)."""


def _limbs(value: int) -> list[int]:
    """The 16-bit limbs of a 64-bit constant, lowest first."""
    return [(value >> (16 * k)) & _LOW16 for k in range(4)]


def _halves(value: int) -> list[int]:
    """The 32-bit halves of a 64-bit value, low first."""
    return [value & _LOW32, value >> 32]


def _round_keys(seed: int) -> list[list[list[int]]]:
    """The key (k0, k1) of each round as 32-bit halves: (seed, KEY_TAG) bumped by the Weyl increments."""
    k0, k1, keys = seed & _MASK64, KEY_TAG, []
    for _ in range(ROUNDS):
        keys.append([_halves(k0), _halves(k1)])
        k0, k1 = (k0 + _W0) & _MASK64, (k1 + _W1) & _MASK64
    return keys


def mulhilo(words: torch.Tensor, limbs: torch.Tensor) -> torch.Tensor:
    """The 128-bit products words[w] * constant[w], exact, for a stack of 64-bit words.

    `words`: int64 (W, 2, N), the 32-bit halves of each word (low first, values in [0, 2**32)); `limbs`: int64
    (W, 1, 4, 1), each constant's 16-bit limbs (lowest first). Returns int64 (W, 4, N): the product's 32-bit
    quarters, lowest first (so [:, :2] is the low word and [:, 2:] the high word, as halves).

    The product is the sum of x_i * m_k at bit 32 i + 16 k (x_i: a half of the word, m_k: a limb), each < 2**48.
    Summed in 16-bit columns (at most two terms a column, < 2**49), the odd columns are split at bit 16 into the
    32-bit quarters around them, and the quarters' carries are passed up one at a time: every value < 2**51."""
    width = words.shape[-1]
    columns = words.new_zeros((words.shape[0], 6, width))  # 16-bit column 2 i + k
    limbs = limbs.view(-1, 4, 1)
    torch.mul(words[:, :1], limbs, out=columns[:, :4])
    columns[:, 2:] += words[:, 1:] * limbs  # (addcmul_ is not integer on every device)
    odd = columns[:, 1::2]
    quarters = words.new_zeros((words.shape[0], 4, width))
    quarters[:, :3] = columns[:, 0::2] + ((odd & _LOW16) << 16)
    quarters[:, 1:] += odd >> 16
    for q in range(3):
        quarters[:, q + 1] += quarters[:, q] >> 32
    return quarters.bitwise_and_(_LOW32)


def philox_blocks(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """The four 64-bit outputs of Philox-4x64-10 for each block's counter and the key (seed, KEY_TAG):
    keyed_kernels._philox_block, a block per entry of the last dimension.

    `counter`: int64 (4, 2, N), words c0..c3 as 32-bit halves, low first; the result has the same layout. A
    round is c0, c1, c2, c3 = hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0): here with the
    products of c2 and c0 stacked in that order, so the new even words are their high words ^ (c1, c3) ^ (k0, k1)
    and the new odd words their low words."""
    device = counter.device
    limbs = torch.tensor([_limbs(_M1), _limbs(_M0)], dtype=torch.int64, device=device).view(2, 1, 4, 1)
    keys = torch.tensor(_round_keys(seed), dtype=torch.int64, device=device).unsqueeze(-1)  # (round, 2, 2, 1)
    state = counter
    for r in range(ROUNDS):
        products = mulhilo(state.flip(0)[1::2], limbs)  # (c2, c0) times (M1, M0)
        state = torch.cat([products[:, 2:] ^ state[1::2] ^ keys[r], products[:, :2]], dim=1).view(4, 2, -1)
    return state


def draws(seed: int, stream: int, start: int, count: int, chunk: int, device: torch.device | str) -> torch.Tensor:
    """The 32-bit draws start, ..., start + count - 1 of `stream` (keyed_random.MaskStream.draws, same bits) as an
    int64 tensor on `device`, values in [0, 2**32). `chunk` is keyed_random.CHUNK (a multiple of 8)."""
    device = torch.device(device)
    out = torch.empty(count, dtype=torch.int64, device=device)
    size = min(PIECE, CPU_PIECE) if device.type == "cpu" else PIECE
    for first in range(start, start + count, size):
        piece = min(size, start + count - first)
        out[first - start : first - start + piece] = _piece(seed, stream, first, piece, chunk, device)
    return out


def _piece(seed: int, stream: int, start: int, count: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Draws [start, start + count): block g (global, 8 draws each) is block g % (chunk / 8) of keyed chunk
    g // (chunk / 8), counter (1 + that, chunk, stream, 0)."""
    per_chunk = chunk // 8
    first, last = start // 8, (start + count - 1) // 8
    blocks = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    counter = blocks.new_zeros((4, 2, blocks.numel()))
    counter[0, 0] = blocks % per_chunk + 1  # < 2**13: the low half only
    counter[1, 0] = (blocks // per_chunk) & _LOW32
    counter[1, 1] = blocks // per_chunk >> 32
    counter[2, 0], counter[2, 1] = stream & _LOW32, (stream >> 32) & _LOW32
    halves = philox_blocks(counter, seed).permute(2, 0, 1)  # (block, word, half): a block's draws in order
    skip = start - 8 * first
    return halves.reshape(-1)[skip : skip + count]

