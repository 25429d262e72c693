"""DARE and DELLA from the keyed stream, computed once in float32, a chunk at a time, in reused buffers.

Why a path of its own: the randomised task-vector methods cannot be bit-equal to mergekit (their masks come
from another generator), so nothing ties their arithmetic to mergekit's stepwise rounding in the compute dtype.
Done in bfloat16, every one of their ~20 torch operations converts to float32 and back, and every temporary
is a fresh block-sized allocation whose pages fault in; that was ~30-70 ns an entry (bench/README.md, issue 21).
Here each chunk (whole rows for DELLA, which ranks rows; a flat range for DARE, see `pieces`) is converted to
float32 once, drawn, masked, rescaled, sign-elected and summed with
in-place float32 operations on buffers reused from chunk to chunk (thread-local: the executor's workers are
threads), and rounded to the output dtype once at the end: faster, and closer to the exact result.

On the CPU, where numba is installed, a chunk's arithmetic is instead one compiled loop per pass
(keyed_kernels.py: the same operations in the same order, so the same bytes, without the GIL); these torch
operations compute it on other devices, and are the reference the tests compare the loops with.

What stays as it was: the keep mask of entry j is decided by the keyed draw of (seed, tensor, task vector,
flat position j) (keyed_random.MaskStream), so outputs do not depend on threads, order, blocks, the device
or a resume; the L1 norms of the rescale are invariant BlockedTotal sums, which do not depend on how rows are cut,
nor on the device.

The arithmetic (methods/task_arithmetic.py states the method): per task vector d = x - base (exact in float32 for
16-bit inputs), W = d * keep * (weight * |d|_1 / |d * keep|_1) (the rescale factor where `rescale` and both
norms are >= L1_EPS, folded with the weight into one float32 multiplier). With sign consensus, P = sum of the
positive W, N = sum of the negative W; the elected sign is + where the votes (P + N for `sum`, the sum of
signs for `count`) are >= 0, and the mix is P there, N elsewhere (zeros never count); with `normalize` it is
divided by the sum of the weights of the vectors on the elected side (1 where none). Without consensus the mix
is sum W (over sum of weights with `normalize`). out = base + lambda * mix.

DELLA ranks each row's entries by the exact float32 |d|, ties broken by column (a stable order: torch's
unstable CPU sort, used before, breaks ties in an implementation-defined way). Entry of rank r (0-based) of an
n-entry row is kept with probability density - epsilon + 2 epsilon r / (n - 1), in float32, as an integer
threshold on the 24-bit grid of the draw. The sort is numpy's on 64-bit keys (magnitude bits, column): one
value sort, ~10x cheaper than torch's argsort (bench/profile_task_vectors.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import keyed_kernels, keyed_random
from .compiled import CONSENSUS_CODES
from .keyed_random import MaskStream
from .reductions import BLOCK, BlockedTotal
from .work_buffers import WorkBuffers

F32 = torch.float32
L1_EPS = 1e-7
"""Below this L1 norm (before or after masking) a task vector is not rescaled (selection.L1_EPS)."""

CHUNK_ELEMENTS = 1 << 18
"""Entries computed at a time on the CPU: ~20 float32 operations per chunk run over buffers of 1 MB that stay in
the CPU's cache, while the Python overhead per operation (~5 us) stays small against the work."""

DEVICE_CHUNK_ELEMENTS = 1 << 20
"""Entries computed at a time on another device (a GPU): there each of a chunk's ~30 operations per task vector is a
kernel launch (~5-10 us of CPU, whatever its size), so the CPU's chunks made 4x the launches for nothing. 4 MB
float32 buffers, ~80 MB of them per worker thread on the device. Measured on an H200 (bench/README.md, issue 33),
1b dare_ties with --cuda: 59.5 s before, 49.3 s with these chunks and the device-independent norms (two machines of
that kind, one run each), against 26.3 s on the CPU; the draws past each row block (keyed_random.MaskStream's `end`,
found after) were not measured on a GPU."""


def chunk_elements(device: torch.device) -> int:
    """The chunk size for tensors on `device`."""
    return CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


_UNIT = 1 << 24


@dataclass(frozen=True)
class Vector:
    """One task vector: its input, stream number, weight and sparsification (density >= 1: kept whole)."""

    index: int
    stream: int
    weight: float
    density: float
    epsilon: float | None = None  # DELLA's spread of keep probabilities; None for DARE


@dataclass(frozen=True)
class Mix:
    """How the task vectors are combined (methods/task_arithmetic.py's switches, resolved)."""

    consensus: str | None
    normalize: bool
    rescale: bool
    lam: float


_BUFFERS = WorkBuffers()
"""Per-thread float32 (and other) work buffers, reused across chunks and blocks (see _buffer)."""


def _buffer(
    name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, chunks: int = 1
) -> torch.Tensor:
    """A work buffer of `shape`, kept for the next chunk up to `chunks` chunks' worth of entries (a one-row tensor
    may be larger than a chunk: its buffer is not kept)."""
    return _BUFFERS.get(name, shape, dtype, device, keep_up_to=chunk_elements(device) * chunks)


def row_chunks(shape: Sequence[int], chunk: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) ranges of dim 0 of about `chunk` entries each (whole rows: DELLA ranks rows)."""
    if len(shape) <= 1:
        return [(0, shape[0] if shape else 1)]  # 0-D, or 1-D: one row to DELLA; small anyway (norms, biases)
    rows, per_row = shape[0], max(1, math.prod(shape[1:]))
    step = max(1, chunk // per_row)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)] or [(0, 0)]


@dataclass(frozen=True)
class Piece:
    """One chunk of a block: flat entries [start, end) of the block, whole rows [start // width, end // width)
    when `rows` (DELLA ranks rows), else a flat range."""

    start: int
    end: int
    rows: bool

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of `t` (rows of it, or a 1-D view of its flat range; a 0-D tensor as a 1-D view)."""
        if t.dim() == 0:
            return t.reshape(1)
        if not self.rows:
            return t.reshape(-1)[self.start : self.end]
        if t.dim() == 1:
            return t
        width = math.prod(t.shape[1:])
        return t[self.start // width : self.end // width]


def pieces(shape: Sequence[int], offset: int, by_rows: bool, chunk: int = CHUNK_ELEMENTS) -> list[Piece]:
    """The chunks a block of `shape` (flat position `offset` of its tensor) is computed in: whole rows when
    `by_rows`; otherwise flat ranges cut where the tensor's flat position is a multiple of `chunk` (chunk_elements
    of the device), so that every chunk but a block's first and last is a full `chunk` (whole rows of 5632 entries make
    chunks of 259072, more of them, each paying the per-operation overhead) and asks the stream for whole
    keyed chunks of draws (keyed_random.CHUNK). A 0-D or 1-D tensor is one chunk."""
    width = math.prod(shape[1:]) if len(shape) > 1 else 0
    if width == 0:
        return [Piece(0, math.prod(shape), True)]
    if by_rows:
        return [Piece(r0 * width, r1 * width, True) for r0, r1 in row_chunks(shape, chunk)]
    numel = math.prod(shape)
    cuts = [0]
    first = (-offset) % chunk or chunk
    cuts.extend(range(first, numel, chunk))
    cuts.append(numel)
    return [Piece(a, b, False) for a, b in zip(cuts, cuts[1:]) if b > a] or [Piece(0, 0, False)]


# ----- masks ------------------------------------------------------------------------------------------------------


def _dare_cut(vec: Vector) -> int | None:
    """DARE's keep test on a 32-bit draw: an entry is kept where its draw is below this, p = density in float32 on
    the draw's top 24 bits (ceil(p * 2**24) << 8); None where p rounds to 1 on that grid and every entry is kept.
    The one place the test is made, for numpy's draws, the compiled totals loop and a device's draws alike."""
    threshold = math.ceil(float(np.float32(vec.density)) * _UNIT)
    return None if threshold >= _UNIT else threshold << 8


def _dare_keep(stream: MaskStream, vec: Vector, offset: int, numel: int) -> np.ndarray:
    """Bool keep flags (flat) of `numel` entries from flat position `offset`: draw < p on the 24-bit grid,
    p = density in float32 (_dare_cut)."""
    cut = _dare_cut(vec)
    if cut is None:
        return np.ones(numel, dtype=np.bool_)
    return stream.draws(vec.stream, offset, numel) < np.uint32(cut)


def della_thresholds(n: int, density: float, epsilon: float) -> np.ndarray:
    """Per rank r of an n-entry row (0 = smallest |d|), the keep threshold on the 24-bit grid:
    ceil(p_r * 2**24) with p_r = density - epsilon + 2 epsilon r / (n - 1) in float32 (density for n = 1)."""
    if n == 1:
        p = np.array([density], dtype=np.float32)
    else:
        p = np.float32(density - epsilon) + np.arange(n, dtype=np.float32) / np.float32(n - 1) * np.float32(
            2 * epsilon
        )
    return np.minimum(np.ceil(p.astype(np.float64) * _UNIT), _UNIT).astype(np.int32)


def _della_thresholds_of(vec: Vector, delta: torch.Tensor) -> torch.Tensor:
    """The keep threshold (24-bit grid, int32, on `delta`'s device) of each entry of `delta`, in its C order: that
    of the entry's rank in its row; ranks run along dim 1 (the only dim of a 1-D tensor). Equal magnitudes rank
    by column on every device (_row_order_on_cpu, _row_order_on_device)."""
    assert vec.epsilon is not None
    moved = delta.reshape(1, -1) if delta.dim() <= 1 else delta.movedim(1, -1)
    width = moved.shape[-1]
    rows = moved.abs().contiguous().reshape(-1, width)  # rows of |d|, ranked along their length
    order = _row_order_on_cpu(rows) if keyed_random.drawn_by_numpy(delta.device) else _row_order_on_device(rows)
    ranks_thresholds = torch.from_numpy(della_thresholds(width, vec.density, vec.epsilon)).to(order.device)
    thresholds = torch.empty(order.shape, dtype=torch.int32, device=order.device)
    thresholds.scatter_(1, order, ranks_thresholds.expand(order.shape))  # threshold of each entry, in place
    if delta.dim() > 2:  # back to the tensor's own order of entries
        thresholds = thresholds.view(*moved.shape).movedim(-1, 1).contiguous()
    return thresholds.reshape(-1)


def _row_order_on_cpu(rows: torch.Tensor) -> torch.Tensor:
    """Each row's ascending order (int64), ties by column, from one numpy sort of (magnitude bits, column) keys."""
    width = rows.shape[-1]
    keys = rows.cpu().numpy().view(np.uint32).astype(np.uint64)
    keys <<= np.uint64(32)
    keys |= np.arange(width, dtype=np.uint64)  # ties by column: every key distinct, so a value sort is an order
    keys.sort(axis=1)
    order = torch.from_numpy(keys.view(np.uint32)[:, 0 :: 2] if _LITTLE else keys.view(np.uint32)[:, 1 :: 2])
    return order.to(torch.int64)


def _row_order_on_device(rows: torch.Tensor) -> torch.Tensor:
    """_row_order_on_cpu's order on the rows' device: a stable sort of each row's |d| orders equal magnitudes by
    column, as the CPU's keys do (|d| >= 0, so the float order is the bits' order; NaNs come last in both, though
    the CPU orders NaNs of different payloads by payload)."""
    return torch.sort(rows, dim=1, stable=True).indices


def _della_keep(stream: MaskStream, vec: Vector, offset: int, delta: torch.Tensor) -> np.ndarray:
    """Bool keep flags (flat, C order of `delta`) of DELLA's rank-dependent draw: the draw's top 24 bits below
    the threshold of the entry's rank."""
    thresholds = _della_thresholds_of(vec, delta)
    draws = stream.draws(vec.stream, offset, delta.numel())
    draws >>= np.uint32(8)
    return draws.view(np.int32) < thresholds.numpy()


_LITTLE = np.little_endian


def keep_array(stream: MaskStream, vec: Vector, offset: int, delta: torch.Tensor) -> np.ndarray | None:
    """The keep flags of `delta` (entries from flat position `offset` of the tensor) as a flat numpy bool array
    in C order, or None where everything is kept."""
    if vec.density >= 1:
        return None
    if vec.epsilon is None:
        return _dare_keep(stream, vec, offset, delta.numel())
    if vec.density <= 0:
        return np.zeros(delta.numel(), dtype=np.bool_)
    return _della_keep(stream, vec, offset, delta)


def keep_mask(stream: MaskStream, vec: Vector, offset: int, delta: torch.Tensor) -> torch.Tensor | None:
    """keep_array's flags as a flat bool tensor on `delta`'s device, drawn there (MaskStream.draws_on: the same
    bits) when it is not the CPU, so a GPU merge neither waits on the CPU's draws nor copies masks over (DELLA's
    ranks too: _della_thresholds_of)."""
    if keyed_random.drawn_by_numpy(delta.device):
        flags = keep_array(stream, vec, offset, delta)
        return None if flags is None else torch.from_numpy(flags)
    if vec.density >= 1:
        return None
    numel, device = delta.numel(), delta.device
    if vec.epsilon is None:
        cut = _dare_cut(vec)
        if cut is None:
            return torch.ones(numel, dtype=torch.bool, device=device)
        return stream.draws_on(vec.stream, offset, numel, device) < cut
    if vec.density <= 0:
        return torch.zeros(numel, dtype=torch.bool, device=device)
    return (stream.draws_on(vec.stream, offset, numel, device) >> 8) < _della_thresholds_of(vec, delta)


def keep_flags(stream: MaskStream, vec: Vector, offset: int, delta: torch.Tensor) -> torch.Tensor | None:
    """The keep mask of `delta` (see keep_array) as a bool tensor of its shape on its device."""
    flags = keep_mask(stream, vec, offset, delta)
    return None if flags is None else flags.view(delta.shape)


def _as_factors(flags: np.ndarray | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The flags as 0/1 float32 in a work buffer shaped like `like`: a float32 mask multiplies ~5x faster than
    a bool one (torch casts bool operands entry by entry), and uint8 converts to float32 ~7x faster than bool
    (bench/README.md, issue 21)."""
    keep = _buffer("keep", like.shape, F32, like.device)
    if isinstance(flags, torch.Tensor):  # drawn on the device (keep_mask)
        return keep.copy_(flags.view(torch.uint8).view(like.shape))
    return keep.copy_(torch.from_numpy(flags.view(np.uint8)).view(like.shape))


# ----- passes -----------------------------------------------------------------------------------------------------


def _task_vector(name: str, x: torch.Tensor, base32: torch.Tensor) -> torch.Tensor:
    d = _buffer(name, base32.shape, F32, base32.device)
    d.copy_(x)
    return d.sub_(base32)


def _base32(base: torch.Tensor) -> torch.Tensor:
    b = _buffer("base", base.shape, F32, base.device)
    return b.copy_(base)


@dataclass
class Totals:
    """The totals pass's state, then its result: per task vector (|d|_1, |d * keep|_1) (BlockedTotal while
    gathering, floats once finished), and the keep flags packed a bit an entry by (vector, first entry of the
    chunk): packing and unpacking cost ~0.06 ns an entry against ~1.4 for a Philox draw and ~7 for DELLA's
    ranking, so the merge pass unpacks them instead of drawing again (1/8 byte an entry per task vector, kept
    for the tensor between the passes)."""

    norms: list
    masks: dict[tuple[int, int], np.ndarray]


def gather(
    state: Totals | None,
    tensors: Sequence[torch.Tensor],
    base_index: int,
    vectors: Sequence[Vector],
    stream: MaskStream,
    offset: int,
) -> Totals:
    """Fold the rows of `tensors` (flat position `offset` on) into each vector's (|d|_1, |d * keep|_1)."""
    if state is None:
        state = Totals([(BlockedTotal(invariant=True), BlockedTotal(invariant=True)) for _ in vectors], {})
    by_rows = _by_rows(vectors)
    shape = tuple(tensors[base_index].shape)
    block = _ArrayBlock(_flat_arrays(tensors), base_index, vectors, stream, offset, shape) if _fused(tensors) else None
    for piece in pieces(shape, offset, by_rows, chunk_elements(tensors[base_index].device)):
        if block is not None:  # |d| and |d * keep| by one compiled loop
            _gather_arrays(state, piece, block)
            continue
        base32 = _base32(piece.of(tensors[base_index]))
        for k, (vec, (before, after)) in enumerate(zip(vectors, state.norms)):
            if vec.density >= 1:
                continue
            start = offset + piece.start
            mags = _buffer("abs", base32.shape, F32, base32.device)
            d = _task_vector("d0", piece.of(tensors[vec.index]), base32)
            flags = keep_mask(stream, vec, start, d)
            assert flags is not None
            packed = np.packbits(flags.numpy()) if keyed_random.drawn_by_numpy(d.device) else flags
            before.add(torch.abs(d, out=mags))
            after.add(mags.mul_(_as_factors(flags, mags)))
            state.masks[(k, start)] = packed
    return state


@dataclass(frozen=True)
class _ArrayBlock:
    """A block's inputs as flat numpy views (_flat_arrays) and what its compiled chunks share."""

    arrays: list[np.ndarray]
    base_index: int
    vectors: Sequence[Vector]
    stream: MaskStream
    offset: int  # the block's flat position in its tensor
    shape: tuple[int, ...]

    def float32(self, name: str, index: int, piece: Piece) -> np.ndarray:
        """Input `index`'s entries of the piece, in float32, in the work buffer `name`."""
        out = _array(name, piece.end - piece.start)
        _into_float32(self.arrays[index][piece.start : piece.end], out)
        return out


def _gather_arrays(state: Totals, piece: Piece, block: _ArrayBlock) -> None:
    """One chunk of `gather` by keyed_kernels' loops on numpy arrays (_flat_arrays), with no torch call."""
    n = piece.end - piece.start
    base32 = block.float32("base", block.base_index, piece)
    for k, (vec, (before, after)) in enumerate(zip(block.vectors, state.norms)):
        if vec.density >= 1:
            continue
        start = block.offset + piece.start
        mags, kept = _array("abs", n), _array("kept", n)
        bits = block.arrays[vec.index][piece.start : piece.end]
        threshold = _dare_threshold(vec)
        summed = 0  # entries whose block sums the compiled loop added
        if threshold is not None and bits.dtype == np.uint16:  # bfloat16: one compiled call for all of it
            packed = np.empty(-(-n // 8), dtype=np.uint8)
            draws = _array("draws", keyed_kernels.STEP, np.uint32)
            flags = _array("step_flags", keyed_kernels.STEP, np.uint8)
            seed, tag = block.stream.key
            # the loop adds the sums of the whole blocks where the chunk starts on one
            whole = n // BLOCK if before.at_block_start() and after.at_block_start() else 0
            sums = _array("block_sums", 2 * whole, np.float32).reshape(2, whole)
            tree = _array("tree", BLOCK // 2, np.float32)
            keyed_kernels.dare_totals(base32, bits, seed, tag, vec.stream, start, keyed_random.CHUNK,
                                      threshold, draws, flags, mags, kept, packed, sums, BLOCK, tree)
            if whole:
                before.add_block_sums(sums[0])
                after.add_block_sums(sums[1])
                summed = whole * BLOCK
        else:
            x = block.float32("x", vec.index, piece)
            keep = _keep_of(block.stream, vec, start, x, base32, _piece_shape(piece, block.shape))
            keyed_kernels.magnitudes(base32, x, keep.view(np.uint8), mags, kept)
            packed = np.packbits(keep)
        before.add(mags[summed:])
        after.add(kept[summed:])
        state.masks[(k, start)] = packed


TOTALS_IN_ONE_LOOP = True
"""bf16 DARE vectors' totals chunks by keyed_kernels.dare_totals (bench/profile_compiled.py switches it off to time
the separate steps it replaced, which give the same bytes)."""


def _dare_threshold(vec: Vector) -> np.uint32 | None:
    """_dare_cut as the uint32 the compiled totals loop compares with (keyed_kernels.dare_totals, with the compiled
    draws); None for DELLA, for a vector kept whole and where the draws are numpy's."""
    if not TOTALS_IN_ONE_LOOP or vec.epsilon is not None or not 0 <= vec.density < 1 or not keyed_random.COMPILED:
        return None
    cut = _dare_cut(vec)
    return None if cut is None else np.uint32(cut)


def _piece_shape(piece: Piece, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `piece.of` gives a tensor of `shape`: its rows, or a flat range."""
    if len(shape) == 0:
        return (1,)
    if not piece.rows:
        return (piece.end - piece.start,)
    if len(shape) == 1:
        return shape
    return ((piece.end - piece.start) // math.prod(shape[1:]), *shape[1:])


def _fused(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a block's chunks are computed by keyed_kernels' compiled loops: on the CPU, where numba is there, for
    inputs numpy can view (_ARRAY_VIEWS)."""
    return (
        FUSED
        and all(t.device.type == "cpu" and t.dtype in _ARRAY_VIEWS for t in tensors)
        and keyed_kernels.KERNELS.ready(tensors[0].numel())
    )


FUSED = keyed_kernels.AVAILABLE
"""keyed_kernels' loops compute CPU chunks (same bytes as the torch operations: tests switch this off to compare)."""

_ARRAY_VIEWS = {
    torch.bfloat16: lambda t: t.view(torch.int16).numpy().view(np.uint16),  # its bit patterns: numpy has no bf16
    torch.float16: lambda t: t.numpy(),
    torch.float32: lambda t: t.numpy(),
    torch.float64: lambda t: t.numpy(),
}
"""The flat numpy view the compiled chunks read a tensor of each dtype through (_into_float32 converts it)."""


def _flat_arrays(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Flat numpy views of a block's inputs, made once per block so that its chunks cost no torch call (each
    passes the GIL between the worker threads: work_buffers); a tensor that is not contiguous is copied first."""
    return [_ARRAY_VIEWS[t.dtype](t.contiguous().reshape(-1)) for t in tensors]


def _into_float32(values: np.ndarray, out: np.ndarray) -> None:
    """out = values in float32, exactly as torch's copy_ converts (bfloat16 bits widened; float64 rounded to
    nearest-even, as C's cast both use)."""
    if values.dtype == np.uint16:
        keyed_kernels.widen_into(values, out)
    else:
        np.copyto(out, values, casting="same_kind")


def _array(name: str, numel: int, dtype: type = np.float32, chunks: int = 1) -> np.ndarray:
    """A numpy work buffer of the compiled chunks, kept as _buffer keeps the torch ones."""
    return _BUFFERS.array(name, numel, dtype, keep_up_to=CHUNK_ELEMENTS * chunks)


def _keep_of(
    stream: MaskStream, vec: Vector, start: int, x32: np.ndarray, base32: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    """The keep flags of the task vector x32 - base32, of `shape` (keep_array; DELLA ranks the task vector itself,
    made here in a work buffer, DARE needs only its size)."""
    like = torch.from_numpy(x32)
    if vec.epsilon is not None and 0 < vec.density < 1:
        d = np.subtract(x32, base32, out=_array("d0", x32.size))
        like = torch.from_numpy(d).view(shape)
    flags = keep_array(stream, vec, start, like)
    assert flags is not None
    return flags


def _by_rows(vectors: Sequence[Vector]) -> bool:
    """Whether the chunks must be whole rows: DELLA ranks the entries of each row."""
    return any(v.epsilon is not None and 0 < v.density < 1 for v in vectors)


def finish(state: Totals) -> Totals:
    return Totals([(float(before.result()), float(after.result())) for before, after in state.norms], state.masks)


def _factor(vec: Vector, mix: Mix, norms: tuple[float, float] | None) -> float:
    """The multiplier of a kept entry: the weight, times the rescale |d|_1 / |d * keep|_1 where it applies."""
    if vec.density >= 1 or not mix.rescale or norms is None:
        return vec.weight
    before, after = norms
    if before < L1_EPS or after < L1_EPS:
        return vec.weight
    return vec.weight * (before / after)


def merge(
    tensors: Sequence[torch.Tensor],
    base_index: int,
    vectors: Sequence[Vector],
    mix: Mix,
    stream: MaskStream,
    offset: int,
    totals: Totals | None,
) -> torch.Tensor:
    """The merged rows, in the base's dtype: `totals` from a totals pass over the whole tensor (finish), or None
    to gather them here from these rows (the whole tensor) first, where the rescale needs them."""
    base = tensors[base_index]
    if totals is None and mix.rescale and any(v.density < 1 for v in vectors):
        totals = finish(gather(None, tensors, base_index, vectors, stream, offset))
    norms = None if totals is None else totals.norms
    kept = {} if totals is None else totals.masks
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    factors = [_factor(v, mix, None if norms is None else norms[k]) for k, v in enumerate(vectors)]
    shape = tuple(base.shape)
    block = _ArrayBlock(_flat_arrays(tensors), base_index, vectors, stream, offset, shape) if _fused(tensors) else None
    constants = _mix_constants(vectors, mix, factors) if block is not None else ()
    out_array = _flat_arrays([out])[0] if block is not None and out.dtype in _ARRAY_VIEWS else None
    bits_out = (  # bfloat16 in and out: _merge_bits
        MERGE_BITS and block is not None and out_array is not None and out.dtype == torch.bfloat16
        and all(array.dtype == np.uint16 for array in block.arrays)
    )
    for piece in pieces(shape, offset, _by_rows(vectors), chunk_elements(base.device)):
        if block is not None:
            if not (bits_out and _merge_bits(piece, block, kept, constants, out_array)):
                _round_into(out, out_array, piece, _merge_arrays(piece, block, kept, constants))
            continue
        base32 = _base32(piece.of(base))
        target = piece.of(out)
        weighted = []
        for k, vec in enumerate(vectors):
            d = _task_vector(f"d{k}", piece.of(tensors[vec.index]), base32)
            packed = kept.get((k, offset + piece.start))
            if isinstance(packed, np.ndarray):
                flags = np.unpackbits(packed, count=d.numel()).view(np.bool_)
            elif packed is not None:
                flags = packed
            else:
                flags = keep_mask(stream, vec, offset + piece.start, d)
            if flags is not None:
                d.mul_(_as_factors(flags, d))
            weighted.append(d.mul_(factors[k]))
        mixed = _mix(weighted, [v.weight for v in vectors], mix)
        if mix.lam != 1:
            mixed.mul_(mix.lam)
        target.copy_(mixed.add_(base32).view(target.shape))  # the one rounding
    return out


def _mix_constants(vectors: Sequence[Vector], mix: Mix, factors: list[float]) -> tuple:
    """keyed_kernels.mix's arguments that are the same for every chunk of a tensor: the multipliers, the weights,
    the consensus code, normalize, the no-consensus divisor, lambda and whether it multiplies."""
    if mix.consensus not in CONSENSUS_CODES:
        raise ValueError(f"consensus_method must be one of sum, count, got {mix.consensus!r}")
    weights = [v.weight for v in vectors]
    return (
        np.array(factors, dtype=np.float32),
        np.array(weights, dtype=np.float32),
        CONSENSUS_CODES[mix.consensus],
        mix.normalize,
        np.float32(_plain_divisor(weights)),
        np.float32(mix.lam),
        mix.lam != 1,
    )


def _merge_arrays(
    piece: Piece, block: _ArrayBlock, kept: dict[tuple[int, int], np.ndarray], constants: tuple
) -> np.ndarray:
    """One chunk of `merge` by keyed_kernels.mix, in float32, on numpy arrays (_flat_arrays): the inputs converted
    to float32 rows of one buffer, the keep flags one byte an entry in another, then one compiled pass
    (`constants`: _mix_constants); _round_into rounds the result to the output dtype."""
    n = piece.end - piece.start
    start = block.offset + piece.start
    vectors = block.vectors
    base32 = block.float32("base", block.base_index, piece)
    xs = _array("xs", len(vectors) * n, chunks=len(vectors)).reshape(len(vectors), n)
    flags = _array("flags", len(vectors) * n, np.uint8, chunks=len(vectors)).reshape(len(vectors), n)
    masked = np.zeros(len(vectors), dtype=np.bool_)
    for k, vec in enumerate(vectors):
        _into_float32(block.arrays[vec.index][piece.start : piece.end], xs[k])
        packed = kept.get((k, start))
        if packed is not None:
            flags[k], masked[k] = np.unpackbits(packed, count=n), True
        elif vec.density < 1:
            shape = _piece_shape(piece, block.shape)
            flags[k], masked[k] = _keep_of(block.stream, vec, start, xs[k], base32, shape), True
    result = _array("out", n)
    keyed_kernels.mix(base32, xs, flags, masked, *constants, result)
    return result


MERGE_BITS = True
"""bf16 chunks of the merge pass by keyed_kernels.mix_bf16 (tests and benches switch it off to compare with
_merge_arrays' steps, which give the same bytes)."""


def _merge_bits(
    piece: Piece, block: _ArrayBlock, kept: dict[tuple[int, int], np.ndarray], constants: tuple, out: np.ndarray
) -> bool:
    """One chunk of `merge` by keyed_kernels.mix_bf16, from the bfloat16 inputs' bits and the totals pass's packed
    flags straight into the output's bits (`out`: its _flat_arrays view), for bfloat16 inputs; False, with nothing
    written that counts, where that does not apply (a masked vector without packed flags: DELLA's or a pass without
    totals) or where a result is nan (_merge_arrays and _round_into then do the chunk)."""
    n = piece.end - piece.start
    start = block.offset + piece.start
    vectors = block.vectors
    count = len(vectors)
    packed = _array("packed", count * -(-n // 8), np.uint8, chunks=count).reshape(count, -(-n // 8))
    masked = np.zeros(count, dtype=np.bool_)
    for k, vec in enumerate(vectors):
        flags = kept.get((k, start))
        if flags is not None:
            packed[k], masked[k] = flags, True
        elif vec.density < 1:
            return False
    xs = _array("x_bits", count * n, np.uint16, chunks=count).reshape(count, n)
    for k, vec in enumerate(vectors):
        xs[k] = block.arrays[vec.index][piece.start : piece.end]
    base = block.arrays[block.base_index][piece.start : piece.end]
    return keyed_kernels.mix_bf16(base, xs, packed, masked, *constants, out[piece.start : piece.end]) == 0


def _round_into(out: torch.Tensor, out_array: np.ndarray | None, piece: Piece, result: np.ndarray) -> None:
    """Write a chunk's float32 result into its place in `out` (`out_array`: its _flat_arrays view), rounded to out's
    dtype as torch's copy_ rounds (the one rounding): bfloat16 by keyed_kernels.narrow_into unless a nan is there
    (torch gives nans bits of its own), float32 as it is, other dtypes by torch."""
    if out_array is not None and out.dtype == torch.bfloat16:
        if not keyed_kernels.narrow_into(result, out_array[piece.start : piece.end]):
            return
    elif out_array is not None and out.dtype == torch.float32:
        out_array[piece.start : piece.end] = result
        return
    target = piece.of(out)
    target.copy_(torch.from_numpy(result).view(target.shape))


def _plain_divisor(weights: Sequence[float]) -> float:
    """The normaliser without sign consensus: the sum of the weights, 1 where it is ~0."""
    total = sum(weights)
    return total if abs(total) >= 1e-8 else 1.0


def _mix(weighted: list[torch.Tensor], weights: list[float], mix: Mix) -> torch.Tensor:
    """The mix of the weighted task vectors of one chunk (written over a work buffer)."""
    shape, device = weighted[0].shape, weighted[0].device
    if mix.consensus is None:
        acc = weighted[0]
        for w in weighted[1:]:
            acc.add_(w)
        if mix.normalize:
            acc.div_(_plain_divisor(weights))
        return acc
    tmp = _buffer("tmp", shape, F32, device)
    pos = _buffer("pos", shape, F32, device)
    neg = _buffer("neg", shape, F32, device)
    torch.clamp_min(weighted[0], 0, out=pos)
    torch.clamp_max(weighted[0], 0, out=neg)
    for w in weighted[1:]:
        pos.add_(torch.clamp_min(w, 0, out=tmp))
        neg.add_(torch.clamp_max(w, 0, out=tmp))
    votes = _buffer("votes", shape, F32, device)
    if mix.consensus == "sum":
        torch.add(pos, neg, out=votes)
    elif mix.consensus == "count":
        torch.sign(weighted[0], out=votes)
        for w in weighted[1:]:
            votes.add_(torch.sign(w, out=tmp))
    else:
        raise ValueError(f"consensus_method must be one of sum, count, got {mix.consensus!r}")
    # 1 where votes >= 0, else 0: sign + 1 is 2, 1 or 0, capped at 1 (torch.heaviside is ~20x slower on the CPU)
    elected = torch.sign(votes, out=_buffer("elected", shape, F32, device)).add_(1).clamp_max_(1)
    divisor = None
    if mix.normalize:  # the weights of the vectors on the elected side, 1 where there are none
        pos_w = _buffer("pos_w", shape, F32, device).zero_()
        neg_w = _buffer("neg_w", shape, F32, device).zero_()
        for w, weight in zip(weighted, weights):
            sign = torch.sign(w, out=tmp)
            pos_w.add_(torch.clamp_min(sign, 0, out=votes), alpha=weight)  # weight where w > 0
            neg_w.add_(sign.clamp_max_(0), alpha=-weight)  # weight where w < 0
        divisor = torch.lerp(neg_w, pos_w, elected, out=neg_w)
        divisor.add_(torch.sign(divisor, out=tmp).abs_().sub_(1).neg_())  # + 1 where the divisor is 0
    out = weighted[0]  # no longer needed: pos and neg hold what the mix reads
    torch.lerp(neg, pos, elected, out=out)  # exact for weights 0 and 1: neg or pos
    if divisor is not None:
        out.div_(divisor)
    return out
