"""Isotropic merging: the summed task matrix with a flat spectrum (Iso-C), widened by task subspaces (Iso-CTS).

Marczak et al., ICML 2025, "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces" (arXiv:2502.04959). With T task matrices Delta_i = w_i (x_i - base) of shape m x n, r = min(m, n):

Iso-C (isotropic merging in the common subspace). The task-arithmetic sum Delta = sum_i Delta_i = U S V^T has a
few dominant directions; Iso-C keeps its singular vectors and replaces every singular value by their mean:

    out = base + alpha * sigma_bar U V^T,        sigma_bar = (1/r) sum_j s_j

Iso-CTS (common and task-specific subspaces). The top c = r - T k directions of Delta form the common subspace
(c about `common_space_fraction` of r, rounded so that T k is a whole number of task blocks); each task then
adds the top k = (r - c) / T singular directions of its part outside that subspace,
Delta_i - U_c U_c^T Delta_i = U_i S_i V_i^T. The common and task directions are concatenated,
U = [U_1[:, :k] ... U_T[:, :k] U_c], V likewise, orthonormalised by their nearest orthonormal matrices
(U = P S' Q^T -> P Q^T, as in TSV-M: methods/task_singular.py), and given one flat spectrum, the mean of all
r singular values gathered (those of U_c from Delta, those of each task's block from its residual):

    out = base + alpha * sigma_bar U_perp V_perp^T

Where the paper leaves a choice, the authors' code (danielm1405/iso-merging, src/utils/iso.py, which FusionBench's
isotropic_merging reproduces) decides: a tensor that is not 2-D gets the mean of its task vectors,
sum_i w_i d_i / T, scaled by alpha; 2-D embeddings and output heads are matrices like any other; the common size
is c0 = floor(r * common_space_fraction), then T k = round((r - c0) / T) T (Python's round, halves to even) and
c = r - T k. Made definite where that code is not (nothing changes on matrices of full numerical rank, which
tests/test_svd_methods.py compares with an independent float64 reference):
- numerically zero singular values (at or below s_max * max(m, n) * eps, s_max the sum's largest for the common
  subspace and a task's Frobenius norm for its residual) and their directions are left out, and sigma_bar is the
  mean of the singular values kept, i.e. over the sum's numerical rank (the reference's min(m, n) on the
  full-rank matrices of the paper): the reference code's directions for a zero singular value are an arbitrary
  basis LAPACK picks, which a flat spectrum would raise to full weight (a sum of exactly low rank, e.g. of
  fine-tunes that trained only a few rows, would gain min(m, n) - rank arbitrary directions);
- where round() asks for more task directions than r holds (common_space_fraction near 0: r = 7, T = 2 gives
  T k = 8 and a negative c in the reference, which fails), one block fewer is taken.
A model's `weight` scales its task vector before the sum (an extension: the paper weighs the tasks equally).

Defaults: `scaling_factor` 1.0 and `common_space_fraction` 0.8 are FusionBench's (config/method/
isotropic_merging/iso_c.yaml, iso_cts.yaml); 0.8 is also the authors' README command for Iso-CTS. The authors'
code tunes alpha on validation data over (0, 3] (`np.linspace(0, 3, n)` in their eval.py): tune it per merge.

Reproducibility is TSV-M's: LAPACK's SVDs round by library, device and thread count (methods/task_singular.py).

Cost: Iso-C one thin SVD of the m x n sum; Iso-CTS that one, T of the task residuals and two of the
concatenations (r columns): about (T + 3) m n min(m, n) units of SVD work (`svd_work`, priced by `plan`). Working
memory: the sum and its SVD, then (Iso-CTS) one task residual and its SVD at a time and the concatenations;
measured in tests/test_svd_methods.py like TSV's, and covered by task_singular.SVD_MEMORY.
"""

from __future__ import annotations

import torch

from .common import require_base
from .registry import MergeInputs, MethodSpec, ParamSpec, within
from .task_singular import (
    SVD_MEMORY,
    finish,
    matrix_rank_tolerance,
    orthonormal_factor,
    prepared_base,
    task_matrices,
    task_mean,
    thin_svd,
)

__all__ = ["METHODS", "common_size", "iso_c_matrix", "iso_cts_matrix"]


def _summed(inputs: MergeInputs, base: torch.Tensor, dtype: torch.dtype, release: bool) -> torch.Tensor:
    total = torch.zeros_like(base)
    for delta in task_matrices(inputs, base, dtype, release=release):
        total += delta
    return total


def iso_c_matrix(total: torch.Tensor) -> torch.Tensor:
    """sigma_bar U V^T of the summed task matrix, over its numerically nonzero singular values."""
    u, s, vh = thin_svd(total)
    keep = int((s > matrix_rank_tolerance(s[0].item(), tuple(total.shape), s.dtype)).sum().item())
    if keep == 0:
        return torch.zeros_like(total)
    u = u[:, :keep]
    return (u * s[:keep].mean()) @ vh[:keep]


def common_size(r: int, tasks: int, fraction: float) -> tuple[int, int]:
    """(c, k): the common subspace's size and each task's block, c + tasks * k = r (the reference's rounding)."""
    c0 = int(r * fraction)
    blocks = round((r - c0) / tasks) * tasks
    if blocks > r:
        blocks -= tasks
    return r - blocks, blocks // tasks


def iso_cts_matrix(inputs: MergeInputs, base: torch.Tensor, dtype: torch.dtype, fraction: float) -> torch.Tensor:
    """sigma_bar U_perp V_perp^T over the common subspace of the sum and each task's top residual directions."""
    shape = tuple(base.shape)
    tasks = len(inputs.others())
    c, k = common_size(min(shape), tasks, fraction)
    total = _summed(inputs, base, dtype, release=False)  # the task vectors are read again below
    u, s, vh = thin_svd(total)
    del total
    keep = int((s[:c] > matrix_rank_tolerance(s[0].item(), shape, s.dtype)).sum().item())
    u_c, s_c, vh_c = u[:, :keep].clone(), s[:keep].clone(), vh[:keep].clone()
    del u, s, vh
    us, ss, vhs = [], [], []
    if k:
        for delta in task_matrices(inputs, base, dtype, release=True):
            tol = matrix_rank_tolerance(torch.linalg.vector_norm(delta).item(), shape, dtype)
            delta -= u_c @ (u_c.T @ delta)  # the part outside the common subspace
            u_t, s_t, vh_t = thin_svd(delta)
            del delta
            kept = int((s_t[:k] > tol).sum().item())
            us.append(u_t[:, :kept].clone())
            ss.append(s_t[:kept].clone())
            vhs.append(vh_t[:kept].clone())
            del u_t, s_t, vh_t
    else:
        for i in inputs.others():
            inputs.done_with(i)
    us.append(u_c)
    ss.append(s_c)
    vhs.append(vh_c)
    values = torch.cat(ss)
    if values.numel() == 0:
        return torch.zeros_like(base)
    u_perp = orthonormal_factor(torch.cat(us, dim=1))
    del us, u_c
    vh_perp = orthonormal_factor(torch.cat(vhs, dim=0))
    del vhs, vh_c
    return (u_perp * values.mean()) @ vh_perp


def _merge_iso_c(inputs: MergeInputs) -> torch.Tensor:
    prepared = prepared_base(inputs, "iso_c")
    if prepared is None:
        return inputs.tensors[require_base(inputs, "iso_c")]
    base_in, base, dtype = prepared
    if base.dim() == 2:
        merged = iso_c_matrix(_summed(inputs, base, dtype, release=True))
    else:
        merged = task_mean(inputs, base, dtype)
    return finish(base, merged, float(inputs.params["scaling_factor"]), base_in.dtype)


def _merge_iso_cts(inputs: MergeInputs) -> torch.Tensor:
    prepared = prepared_base(inputs, "iso_cts")
    if prepared is None:
        return inputs.tensors[require_base(inputs, "iso_cts")]
    base_in, base, dtype = prepared
    fraction = float(inputs.params["common_space_fraction"])  # in [0, 1]: checked at plan time
    if base.dim() == 2:
        merged = iso_cts_matrix(inputs, base, dtype, fraction)
    else:
        merged = task_mean(inputs, base, dtype)
    return finish(base, merged, float(inputs.params["scaling_factor"]), base_in.dtype)


def iso_c_svd_work(shape: tuple[int, ...], tasks: int) -> float:
    """Units of SVD work (m n min(m, n)) of one Iso-C call: the sum's SVD."""
    if len(shape) != 2 or tasks < 1:
        return 0.0
    m, n = shape
    return float(m * n * min(m, n))


def iso_cts_svd_work(shape: tuple[int, ...], tasks: int) -> float:
    """Units of SVD work of one Iso-CTS call: the sum's SVD, the T residuals' and the two concatenations' (r
    columns each, so one m x n SVD's work each)."""
    return iso_c_svd_work(shape, tasks) * (3 + tasks) if len(shape) == 2 and tasks >= 1 else 0.0


_WEIGHT = ParamSpec("weight", 1.0, non_base=True)
_SCALING = ParamSpec("scaling_factor", 1.0)

METHODS = (
    MethodSpec(
        name="iso_c",
        description="Iso-C: the summed task matrix with a flat spectrum (Marczak et al. 2025)",
        merge=_merge_iso_c,
        params=(_SCALING,),
        model_params=(_WEIGHT,),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        memory=SVD_MEMORY,
        svd_work=iso_c_svd_work,
    ),
    MethodSpec(
        name="iso_cts",
        description="Iso-CTS: common and task-specific subspaces with a flat spectrum (Marczak et al. 2025)",
        merge=_merge_iso_cts,
        params=(_SCALING, ParamSpec("common_space_fraction", 0.8, check=within(0.0, 1.0))),
        model_params=(_WEIGHT,),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        memory=SVD_MEMORY,
        svd_work=iso_cts_svd_work,
    ),
)
