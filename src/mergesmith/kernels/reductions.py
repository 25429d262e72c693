"""Sums, norms and dot products whose bits do not depend on torch's thread count.

torch reduces a whole tensor to one number by splitting it among its intra-op threads and adding the
partial results, so for tensors of 32768 entries or more (ATen's grain size) the rounding, and so the
merged bytes, change with the number of threads; MKL's dot product does so from a few thousand entries.
A reduction with several outputs is different: each output is reduced by one thread, whatever their
number. So a whole-tensor reduction here is done in fixed blocks of BLOCK entries (one output per block,
each reduced serially), then the block results are reduced the same way until few enough remain for a
serial pass.

Below the grain size (and for dot products below DOT_SERIAL_MAX entries) these are exactly torch's own
serial reductions, which is what mergekit 0.1.5 computes too, so small tensors stay bit-identical to
mergekit. For larger tensors mergekit's own result depends on its thread count; ours agrees with it to
float rounding and does not, and is not bit-equal to it: measured on float32 tensors of 1-4M entries
(`tests/reference/measure_differences.py`, README "Where outputs equal mergekit's"), the blocked
result is as close or closer to a float64 rerun than mergekit's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import keyed_kernels
from .work_buffers import WorkBuffers

SERIAL_LIMIT = 32768
"""ATen's grain size: reductions of fewer input entries run on one thread."""

BLOCK = 16384
"""Entries per block of a blocked reduction (< SERIAL_LIMIT, so a single block is also serial)."""

DOT_SERIAL_MAX = 4096
"""Up to this many entries MKL's dot product runs on one thread (checked for thread counts 1-8)."""


def _blocks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (n // BLOCK, BLOCK) view of a 1-D tensor and the remainder (None when empty)."""
    full = flat.numel() // BLOCK * BLOCK
    rest = flat[full:] if full < flat.numel() else None
    return flat[:full].view(-1, BLOCK), rest


def total(x: torch.Tensor) -> torch.Tensor:
    """Sum of all entries, as a 0-dim tensor of x's dtype."""
    flat = x.reshape(-1)
    if flat.numel() < SERIAL_LIMIT:
        return flat.sum()
    rows, rest = _blocks(flat)
    parts = rows.sum(dim=1)
    if rest is not None:
        parts = torch.cat([parts, rest.sum().reshape(1)])
    return total(parts)


def l2(x: torch.Tensor) -> torch.Tensor:
    """2-norm of all entries, as a 0-dim tensor (blocks combine as the norm of their norms)."""
    flat = x.reshape(-1)
    if flat.numel() < SERIAL_LIMIT:
        return torch.linalg.vector_norm(flat)
    rows, rest = _blocks(flat)
    parts = torch.linalg.vector_norm(rows, dim=1)
    if rest is not None:
        parts = torch.cat([parts, torch.linalg.vector_norm(rest).reshape(1)])
    return l2(parts)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> over all entries, as a 0-dim tensor of a's dtype.

    Like torch.dot, half-precision inputs (bf16, f16) are multiplied and summed in float32 and rounded
    once at the end: rounding every product and every block sum to bf16 instead (as `total(a * b)` in
    bf16 did) loses about two decimal digits on a million entries."""
    if a.numel() <= DOT_SERIAL_MAX:
        return torch.dot(a.reshape(-1), b.reshape(-1))
    if a.dtype in (torch.float32, torch.float64):
        return total(a * b)
    return total(a.float() * b.float()).to(a.dtype)


def _single_output(x: torch.Tensor, dim: int) -> bool:
    return x.numel() // max(1, x.shape[dim]) == 1 if x.dim() else True


def _reduced_shape(x: torch.Tensor, dim: int, keepdim: bool) -> list[int]:
    """The shape of x reduced along `dim` (kept as 1 with `keepdim`)."""
    shape = list(x.shape)
    if keepdim:
        shape[dim] = 1
    else:
        del shape[dim]
    return shape


def sum_along(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """x.sum(dim), made thread-count independent when there is only one output."""
    if x.dim() and _single_output(x, dim):
        return total(x).reshape(_reduced_shape(x, dim, keepdim))
    return x.sum(dim=dim, keepdim=keepdim)


def norm_along(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """vector_norm(x, dim), made thread-count independent when there is only one output."""
    if x.dim() and _single_output(x, dim):
        return l2(x).reshape(_reduced_shape(x, dim, keepdim))
    return torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim)


class BlockedTotal:
    """`total()` of a tensor handed over in consecutive pieces (row blocks, in order), with the same bits.

    Why: a method that rescales by a whole-tensor norm (DARE, DELLA) but otherwise works row by row needs that
    norm before its first block is written. Fed the blocks in order, this keeps the partial sums `total` would
    make (one per BLOCK entries of the flattened tensor, wherever the pieces are cut) and a carry of fewer
    than BLOCK entries between pieces, so the result does not depend on how the tensor was cut.

    `invariant=True` makes the bits independent of the device too, for the keyed methods whose merged bytes must
    be the same on a GPU (issue 33): a GPU adds a block's entries in another order than the CPU, which moved DARE's
    L1 norms, and so its rescale and the merged bytes, in their last bits (seen on an H200). Invariant, each block
    is summed pairwise in a fixed order (tree_block_sums: every step one float32 addition, the same on any device,
    by a compiled loop on the CPU and torch operations elsewhere), the last block zero-padded, and the block sums
    are added by math.fsum (correctly rounded, so in any order); the result is a float64 0-dim tensor. Block sums
    of pieces on a GPU stay there until `result` (one copy to the host, not one synchronisation per piece).
    """

    def __init__(self, invariant: bool = False) -> None:
        # The partial sums as Python floats (exact: a double holds any float32/16 value), not as one small tensor
        # per piece: those, long-lived between a worker's block-sized temporaries, kept the C heap from reusing
        # its freed blocks (+8 MB of RSS per row block of a 1b embedding's totals pass, bench/README.md).
        self._parts: list[float] = []
        self._on_device: list[torch.Tensor] = []  # block sums not yet copied from a GPU
        self._like: torch.Tensor | None = None  # an empty tensor of the pieces' dtype and device
        self._carry: torch.Tensor | None = None
        self._carry_array: np.ndarray | None = None  # the carry of _add_array
        self._invariant = invariant

    def add(self, piece: torch.Tensor | np.ndarray) -> None:
        if isinstance(piece, np.ndarray):
            self._add_array(piece)
            return
        flat = piece.reshape(-1)
        if self._like is None:
            self._like = flat.new_empty(0)
        if self._carry is not None and self._carry.numel():
            flat = torch.cat([self._carry, flat])
        if not self._parts and not self._on_device and flat.numel() < SERIAL_LIMIT:
            self._carry = flat.clone() if flat.data_ptr() == piece.data_ptr() else flat
            return  # the whole tensor may still be small enough for one serial sum
        full = flat.numel() // BLOCK * BLOCK
        if full:
            sums = tree_block_sums(flat[:full]) if self._invariant else flat[:full].view(-1, BLOCK).sum(dim=1)
            if sums.device.type == "cpu":
                self._parts.extend(sums.tolist())
            else:
                self._on_device.append(sums)
        self._carry = flat[full:].clone() if full < flat.numel() else None

    def at_block_start(self) -> bool:
        """Whether what was added so far is a whole number of blocks (no carry): the next piece's blocks start at its
        first entry (add_block_sums)."""
        return self._invariant and self._carry_array is None and (self._carry is None or not self._carry.numel())

    def add_block_sums(self, sums: np.ndarray) -> None:
        """Add the next whole blocks by their sums (tree_block_sums' bits, as keyed_kernels.dare_totals makes them
        while the blocks are in the cache); only at_block_start."""
        assert self.at_block_start()
        self._parts.extend(sums.tolist())

    def _add_array(self, piece: np.ndarray) -> None:
        """`add` for a contiguous float32 numpy array (keyed_merge's compiled chunks, invariant sums only): the
        same block sums by keyed_kernels' loop, with no torch call (see work_buffers on why that matters); the
        carry stays a numpy array, which `result` takes as it takes a tensor."""
        assert self._invariant and piece.dtype == np.float32
        flat = piece.reshape(-1)
        carry = self._carry_array
        if carry is not None:  # the carry's block, completed from the piece's head (the rest is not copied: a row
            # block whose start is not on a BLOCK boundary used to copy each of its chunks whole, ~0.3 CPU-s of the 1b
            # dare_ties merge in memmove)
            head = min(BLOCK - carry.size, flat.size)
            carry = np.concatenate([carry, flat[:head]])
            flat = flat[head:]
            if carry.size < BLOCK:
                self._carry_array = carry
                return
            self._sum_blocks(carry)
        full = flat.size // BLOCK * BLOCK
        if full:
            self._sum_blocks(flat[:full])
        self._carry_array = flat[full:].copy() if full < flat.size else None

    def _sum_blocks(self, flat: np.ndarray) -> None:
        """Append the block sums of `flat` (a whole number of blocks) by keyed_kernels' loop."""
        sums = np.empty(flat.size // BLOCK, dtype=np.float32)
        scratch = _SCRATCH.array("tree", BLOCK // 2, np.float32)
        keyed_kernels.tree_block_sums(flat, BLOCK, scratch, sums)
        self._parts.extend(sums.tolist())

    def result(self) -> torch.Tensor:
        carry = self._carry if self._carry_array is None else torch.from_numpy(self._carry_array)
        if self._on_device:
            self._parts.extend(torch.cat(self._on_device).tolist())
            self._on_device.clear()
        if self._invariant:
            rest: list[float] = []
            if carry is not None and carry.numel():
                padded = carry.new_zeros(-(-carry.numel() // BLOCK) * BLOCK)
                padded[: carry.numel()] = carry
                rest = tree_block_sums(padded).tolist()
            return torch.tensor(math.fsum(self._parts + rest), dtype=torch.float64)
        if not self._parts:
            return carry.sum() if carry is not None else torch.zeros(())
        assert self._like is not None
        parts = [self._like.new_tensor(self._parts)]
        if carry is not None and carry.numel():
            parts.append(carry.sum().reshape(1))
        return total(torch.cat(parts))


_SCRATCH = WorkBuffers()
"""tree_block_sums' first level, per thread."""

COMPILED_TREE = True
"""tree_block_sums by keyed_kernels' loop on the CPU once it is compiled (bench/profile_compiled.py switches it off
to time the torch operations, which give the same bits)."""


def tree_block_sums(flat: torch.Tensor) -> torch.Tensor:
    """The pairwise sums of the BLOCK-entry blocks of `flat` (its length a multiple of BLOCK), in its dtype: the
    two halves of each block added entry by entry, then the halves of that, down to one entry. Every step is one
    addition per entry, whose result IEEE arithmetic fixes, so these bits are the same on every device and with
    any vector width: keyed_kernels.tree_block_sums computes them on the CPU (one pass, about as fast as torch's own
    float32 sum: `python bench/profile_compiled.py --only "block sums"`; a float64 sum, the first
    device-independent version, cost ~0.2 ns an entry, +0.9 s on the 1b dare_ties merge), these torch operations
    elsewhere (a dozen kernel launches a piece)."""
    rows = flat.numel() // BLOCK
    half = BLOCK // 2
    if flat.device.type == "cpu" and flat.is_contiguous() and flat.dtype == torch.float32 and _compiled(flat):
        out = torch.empty(rows, dtype=flat.dtype)
        scratch = _SCRATCH.get("tree", (half,), flat.dtype, flat.device)
        keyed_kernels.tree_block_sums(flat.numpy(), BLOCK, scratch.numpy(), out.numpy())
        return out
    blocks = flat.view(rows, BLOCK)
    level = _SCRATCH.get("tree", (rows, half), flat.dtype, flat.device)
    torch.add(blocks[:, :half], blocks[:, half:], out=level)
    width = half
    while width > 1:
        width //= 2
        level[:, :width].add_(level[:, width : 2 * width])
    return level[:, 0].clone()


def _compiled(flat: torch.Tensor) -> bool:
    """Whether keyed_kernels' loop may add `flat`'s blocks now (the torch operations give the same bits)."""
    return COMPILED_TREE and keyed_kernels.KERNELS.ready(flat.numel())
