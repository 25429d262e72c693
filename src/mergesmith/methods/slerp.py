"""SLERP: spherical linear interpolation between the base model and one other model.

Shoemake 1985, "Animating rotation with quaternion curves"; https://en.wikipedia.org/wiki/Slerp.
With each tensor flattened to a vector p0 (the base) and p1 (the other model) and
cos(omega) = <p0, p1> / (|p0| |p1|):

    slerp(p0, p1; t) = sin((1 - t) omega) / sin(omega) * p0 + sin(t omega) / sin(omega) * p1

so t = 0 gives the base and t = 1 the other model (mergekit's docs: "`t=0` yields the `base_model`,
`t=1` yields the other model"). The coefficients multiply the raw, unnormalised tensors, so the
result's norm interpolates the two norms along the arc. When the vectors are nearly collinear
(|cos omega| > 0.9995) sin(omega) is ~0 and the formula is ill-conditioned, so the plain linear
interpolation (1 - t) p0 + t p1 is used instead, as mergekit does.

Numerics follow mergekit 0.1.5's steps: float32 work (float64 stays float64), norms and the dot
product reduced over blocks of 2**20 elements (the norm of the per-block norms; the sum of per-block
dots of the normalised vectors), and `t` rounded to the work dtype before `1 - t` is taken. Results
are bit-identical to mergekit's on tensors under 32,768 entries (the reference fixtures). Within a
block the reductions here are thread-count independent (reductions.py), where mergekit's are not
for 32,768 entries or more, so larger tensors differ by rounding: on 1M-entry float32 tensors 9 of 12
differ by up to 5e-6 relative, and these are the closer to a float64 rerun (1.6e-7 against
mergekit's 5.1e-6; `python tests/reference/measure_differences.py --cases slerp`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..kernels.reductions import norm_along, sum_along
from .common import base_and_other, work_dtype
from .registry import MergeInputs, MethodSpec, ModelCount, ParamSpec, WorkingMemory

BLOCK_ELEMENTS = 1 << 20
"""Elements per reduction block; mergekit reduces norms and dots in blocks of this size."""

DOT_THRESHOLD = 0.9995
"""Above this |cos omega| the vectors count as collinear and interpolation is linear."""


def _blocks(row: torch.Tensor) -> Iterator[torch.Tensor]:
    """Column blocks of a (1, n) row, each of at most BLOCK_ELEMENTS."""
    for start in range(0, row.shape[1], BLOCK_ELEMENTS):
        yield row[:, start : start + BLOCK_ELEMENTS]


class _Scratch:
    """Block-sized work buffers reused across a tensor's blocks: fresh temporaries for every block (a
    conversion, two quotients, a product, two scaled terms) cost more in page faults than in arithmetic."""

    def __init__(self, a: torch.Tensor, dtype: torch.dtype) -> None:
        size = min(BLOCK_ELEMENTS, a.shape[1])
        self.buffers = [torch.empty((1, size), dtype=dtype, device=a.device) for _ in range(2)]

    def pair(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[0][:, :width], self.buffers[1][:, :width]


def _blockwise_norm(row: torch.Tensor, dtype: torch.dtype, scratch: _Scratch) -> torch.Tensor:
    """|row| as the 2-norm of the per-block 2-norms, shape (1, 1)."""
    parts = []
    for block in _blocks(row):
        work = block if block.dtype == dtype else scratch.pair(block.shape[1])[0].copy_(block)
        parts.append(norm_along(work, dim=1, keepdim=True))
    return torch.linalg.vector_norm(torch.stack(parts), dim=0)


def slerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = DOT_THRESHOLD, eps: float = 1e-8
) -> torch.Tensor:
    """Spherical interpolation from v0 (t = 0) to v1 (t = 1) of two same-shaped tensors.

    Each step is the same float operation, in the same order, as the plain expression in the module
    docstring (x / |x| before the product, each coefficient times its term before the sum); the steps
    just write into reused block buffers.
    """
    dtype = work_dtype(v0)
    a = v0.reshape(1, -1)
    b = v1.reshape(1, -1)
    t_w = torch.tensor([[t]], dtype=dtype, device=v0.device)
    if a.shape[1] == 0:
        return ((1 - t_w) * a + t_w * b).reshape(v0.shape).to(v0.dtype)

    scratch = _Scratch(a, dtype)
    norm_a = _blockwise_norm(a, dtype, scratch)
    norm_b = _blockwise_norm(b, dtype, scratch)
    norm_a = torch.where(norm_a > eps, norm_a, 1)  # a zero vector has no direction: leave it unscaled
    norm_b = torch.where(norm_b > eps, norm_b, 1)
    dots = []
    for x, y in _pairs(a, b):
        unit_x, unit_y = scratch.pair(x.shape[1])
        unit_x.copy_(x).div_(norm_a)  # converted into the buffer, then divided there: no temporaries
        unit_y.copy_(y).div_(norm_b)
        dots.append(sum_along(unit_x.mul_(unit_y), dim=1, keepdim=True))
    cos_omega = torch.stack(dots).sum(dim=0).clamp(-1, 1)

    collinear = cos_omega.abs() > dot_threshold
    omega = torch.acos(torch.where(collinear, 0, cos_omega))
    sin_omega = torch.sin(omega)
    coef_0 = torch.where(collinear, 1 - t_w, torch.sin((1 - t_w) * omega) / sin_omega)
    coef_1 = torch.where(collinear, t_w, torch.sin(t_w * omega) / sin_omega)

    out = torch.empty_like(a)
    for start in range(0, a.shape[1], BLOCK_ELEMENTS):
        stop = start + BLOCK_ELEMENTS
        x, y = a[:, start:stop], b[:, start:stop]
        term_0, term_1 = scratch.pair(x.shape[1])
        term_0.copy_(x).mul_(coef_0)
        term_1.copy_(y).mul_(coef_1)
        if out.dtype == dtype:
            torch.add(term_0, term_1, out=out[:, start:stop])
        else:  # the sum in the work dtype, then rounded to the tensor's, as the plain expression does
            out[:, start:stop] = term_0.add_(term_1)
    return out.reshape(v0.shape)


def _pairs(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from zip(_blocks(a), _blocks(b))


def _merge(inputs: MergeInputs) -> torch.Tensor:
    base, other = base_and_other(inputs, "slerp")
    if not base.is_floating_point():
        raise ValueError(f"slerp: tensor {inputs.tensor_name!r}: needs floating-point tensors")
    return slerp(float(inputs.params["t"]), base, other)


METHODS = (
    MethodSpec(
        name="slerp",
        description="spherical interpolation from the base (t=0) to the other model (t=1)",
        merge=_merge,
        params=(ParamSpec("t", required=True),),
        requires_base=True,
        models=ModelCount(min_models=2, max_models=2),
        elementwise=False,
        memory=WorkingMemory(per_input=2, fixed=1, bytes=16),
    ),
)
