"""Random keep-masks addressed by position: draw i of a tensor depends only on (seed, stream, i).

Why: DARE and DELLA draw one Bernoulli per task-vector entry. Drawn from one sequential generator (torch's
Mersenne Twister, as mergekit does) the mask of entry i depends on every draw before it, so a tensor must be
drawn whole, in order, on one thread, and torch's `bernoulli` costs ~15 ns an entry on this CPU. A
counter-based generator has no such chain: the draws of any row block are computed from the block's position
alone, so a tensor can be merged block by block (in any order, on any thread) and its mask is the same bytes
whatever the block size, the thread count, the `--max-memory` budget, a resume, or the compute device.

The generator is numpy's Philox-4x64 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"),
keyed by the recipe's per-tensor seed (itself derived from `--random-seed` and the tensor name) and a stream
number (one per task vector). Entries come in chunks of CHUNK: chunk c is the Philox stream whose counter
starts at (0, c, s, 0) for stream s, so chunks never share a counter value. numpy guarantees a bit generator's
output does not change across versions and platforms, so the bytes are the same on every machine. For tensors on
another device (a GPU) the same draws are computed there by keyed_random_torch (torch integer operations, the
same bits: tests/test_keyed_random_torch.py), so a mask is drawn where the arithmetic runs instead of on the CPU
and copied over. On the CPU numpy's generator (or keyed_kernels' compiled copy) stays: ~1.5 ns a draw against
~47 for the torch operations (`python bench/philox_torch.py`, 4M draws, one thread, AMD EPYC, shared 2-core
machine). Measured with `python bench/profile_task_vectors.py` (bench/README.md, one thread of a shared 2-core
machine): ~3.7 ns per entry for the draw and the compare, against ~15.7 ns for torch's CPU `bernoulli`.

Entry i is kept with probability p when u_i < p, u_i = (top 24 bits of the i-th 32-bit draw) / 2**24: the
same 24-bit grid a float32 uniform has. For a scalar p this is the integer test draw < ceil(p * 2**24) * 256.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from . import keyed_kernels, keyed_random_torch

STREAM_NAME = "philox4x64/chunk65536/top24"
"""Names this keying of the draws in a plan's options (so in its fingerprint): a change here is a new name."""

CHUNK = 1 << 16
"""Entries per keyed chunk: a block's draws cost one state change per chunk (~3 us) plus the draws."""

COMPILED = keyed_kernels.AVAILABLE
"""Draws by keyed_kernels' compiled Philox (tests switch it off to compare with numpy's generator)."""

_KEY_TAG = keyed_random_torch.KEY_TAG  # "mergesmt": the second key word, so these streams differ from any other use

WINDOW = 1 << 22
"""Draws computed at once on a device (draws_on): a call costs a few hundred kernel launches whatever its size,
so a device draws this many ahead and serves the next pieces of the tensor from them."""
_UNIT = float(1 << 24)
_LITTLE = sys.byteorder == "little"


def drawn_by_numpy(device: torch.device) -> bool:
    """Whether masks for tensors on `device` are drawn by numpy (or keyed_kernels) on the CPU: for CPU tensors,
    where that is the fastest exact path (keyed_random_torch's docstring); elsewhere they are drawn on the device."""
    return device.type == "cpu"


class MaskStream:
    """Uniform draws for the entries of one tensor, by flat (C-order) position, for `streams` task vectors.

    Not thread-safe (it reuses one bit generator): the executor makes one per recipe computation, that is per row
    block of a tensor merged in blocks, with `end` the flat position where the block ends: draws_on draws ahead
    up to there and no further."""

    def __init__(self, seed: int, end: int | None = None) -> None:
        self.seed = int(seed) & ((1 << 64) - 1)
        self.end = end
        self._bits: np.random.Philox | None = None  # numpy's generator, made on first use (_chunk): the compiled
        # draws never need it, and making it (10 us a row block, and ~60 ms for the import of numpy.random the
        # first time) held the GIL
        self._state: dict = {}  # its state, read once and changed in place by every _chunk
        self._ahead: dict[tuple[int, torch.device], tuple[int, torch.Tensor]] = {}

    @property
    def key(self) -> tuple[np.uint64, np.uint64]:
        """The Philox key of these streams, as the compiled draws take it (keyed_kernels.philox_draws)."""
        return np.uint64(self.seed), np.uint64(_KEY_TAG)

    def draws_on(self, stream: int, start: int, count: int, device: torch.device) -> torch.Tensor:
        """The draws of `draws` as an int64 tensor on `device` (values in [0, 2**32)): on the CPU numpy's (or the
        compiled) ones, elsewhere computed there by keyed_random_torch, WINDOW at a time: later calls for the
        entries that follow (the next pieces of a tensor) are slices of the same window."""
        device = torch.device(device)
        if drawn_by_numpy(device):
            return torch.from_numpy(self.draws(stream, start, count).astype(np.int64))
        held = self._ahead.get((stream, device))
        if held is None or not (held[0] <= start and start + count <= held[0] + held[1].numel()):
            ahead = max(count, min(WINDOW, 16 * count))  # a small tensor's window stays small
            if self.end is not None:  # never past the block: the stream is made afresh for the next one, and
                # a window of WINDOW for each 1M-entry block drew 4x the draws it used (the 1b dare_ties merge
                # took 49 s with --cuda on an H200, 26 s on its CPU)
                ahead = max(count, min(ahead, self.end - start))
            drawn = keyed_random_torch.draws(self.seed, stream, start, ahead, CHUNK, device)
            held = self._ahead[(stream, device)] = (start, drawn)
        first, drawn = held
        return drawn[start - first : start - first + count]

    def draws(self, stream: int, start: int, count: int) -> np.ndarray:
        """The 32-bit draws of entries [start, start + count) of stream `stream`, as a uint32 array (computed by
        keyed_kernels.philox_draws where numba is there: the same bits, faster)."""
        out = np.empty(count, dtype=np.uint32)
        if COMPILED and keyed_kernels.KERNELS.ready(count):
            keyed_kernels.philox_draws(*self.key, stream, start, CHUNK, out)
            return out
        first = start // CHUNK
        last = (start + count - 1) // CHUNK if count else first - 1
        done = 0
        for chunk in range(first, last + 1):
            lo = max(start, chunk * CHUNK) - chunk * CHUNK
            hi = min(start + count, (chunk + 1) * CHUNK) - chunk * CHUNK
            out[done : done + hi - lo] = self._chunk(stream, chunk, lo, hi)
            done += hi - lo
        return out

    def _chunk(self, stream: int, chunk: int, lo: int, hi: int) -> np.ndarray:
        """Draws [lo, hi) of one chunk. Draws come in pairs, one 64-bit output each, and Philox computes outputs
        in blocks of four from its counter: output j of the chunk is word j % 4 of the block whose counter
        starts (1 + j // 4, chunk, stream, 0) (numpy increments the counter before each block). So the bit
        generator is set just before the block holding draw lo: a piece starting mid-chunk (row blocks of a
        width that does not divide CHUNK) costs its own draws only, not the chunk's prefix again."""
        first_output = lo // 2
        skip = first_output % 4
        if self._bits is None:
            self._bits = np.random.Philox(key=np.array([self.seed, _KEY_TAG], dtype=np.uint64))
            self._state = self._bits.state
        state = self._state
        state["state"]["counter"] = np.array([first_output // 4, chunk, stream, 0], dtype=np.uint64)
        state["buffer_pos"] = 4  # no buffered outputs: the next one is computed from the counter
        state["has_uint32"] = 0
        self._bits.state = state
        raw = self._bits.random_raw(skip + (hi + 1) // 2 - first_output)[skip:]
        if _LITTLE:
            halves = raw.view(np.uint32)  # low then high half of each 64-bit output
        else:
            halves = np.empty(raw.size * 2, dtype=np.uint32)
            halves[0::2], halves[1::2] = raw & 0xFFFFFFFF, raw >> 32
        first = lo - 2 * first_output  # 1 when lo is the high half of its output
        return halves[first : first + hi - lo]

    def keep(
        self, stream: int, start: int, shape: tuple[int, ...], p: float, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Bool mask of `shape` (entries start, start+1, ... in C order) on `device`: True with probability p each."""
        count = math.prod(shape)
        threshold = min(1 << 32, math.ceil(p * _UNIT) * 256)
        if drawn_by_numpy(torch.device(device)):
            return torch.from_numpy(self.draws(stream, start, count) < threshold).reshape(shape)
        return (self.draws_on(stream, start, count, torch.device(device)) < threshold).reshape(shape)

    def keep_with(self, stream: int, start: int, probs: torch.Tensor) -> torch.Tensor:
        """Bool mask shaped like `probs`, on its device: entry j kept when u_j < probs[j] (compared in float32,
        exact: u_j is on the 24-bit grid and probs * 2**24 only shifts the exponent)."""
        if not drawn_by_numpy(probs.device):
            draws = self.draws_on(stream, start, probs.numel(), probs.device)
            grid = (draws >> 8).to(torch.float32).reshape(probs.shape)
            return grid < probs.to(torch.float32) * _UNIT
        draws = self.draws(stream, start, probs.numel())
        grid = torch.from_numpy((draws >> 8).astype(np.float32)).reshape(probs.shape)
        return grid < probs.to(torch.float32) * _UNIT
