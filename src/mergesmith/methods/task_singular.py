"""Task Singular Vectors merge (TSV-M): per weight matrix, each task's top singular directions, decorrelated.

Gargiulo et al., CVPR 2025, "Task Singular Vectors: Reducing Task Interference in Model Merging"
(arXiv:2412.00081), TSV-Merge. With T task matrices Delta_i = w_i (x_i - base) of shape m x n and
r = min(m, n), each task keeps its top k = floor(r / T) singular triplets:

    Delta_i ~ U_i[:, :k] diag(s_i[:k]) V_i[:, :k]^T                      (thin SVD, torch.linalg.svd)

The kept factors are concatenated across the tasks, U = [U_1[:, :k] ... U_T[:, :k]] (m x Tk),
S = diag(s_1[:k], ..., s_T[:k]), V = [V_1[:, :k] ... V_T[:, :k]] (n x Tk). Directions of different tasks
overlap (the paper's task interference); they are whitened by the nearest matrices with orthonormal
columns (orthogonal Procrustes), from the SVDs of the concatenations:

    U = P_U S_U Q_U^T  ->  U_perp = P_U Q_U^T,        V = P_V S_V Q_V^T  ->  V_perp = P_V Q_V^T

and the merged task matrix is U_perp S V_perp^T, so that

    out = base + alpha * U_perp S V_perp^T.

Where the paper leaves a choice, the authors' code (AntoAndGar/task_singular_vectors,
`compute_and_sum_svd_mem_reduction`, which FusionBench's TaskSingularVectorMerging reproduces) decides:
- a tensor that is not 2-D (norms, biases, 3-D expert stacks) gets the mean of its task vectors,
  sum_i w_i d_i / T, scaled by alpha like the matrices; 2-D embeddings and output heads are matrices like any
  other (the authors' code exempts only CLIP's `text_projection`, which LLMs do not have);
- `alpha` scales the merged task vector; a model's `weight` scales its task vector before the SVD (FusionBench's
  `alpha` given as a list does the same).

Two cases the reference code leaves to chance are made definite (on task matrices of full numerical rank
nothing changes, and tests/test_svd_methods.py checks the equality against an independent float64 reference):
- singular triplets with a numerically zero singular value (s <= s_max * max(m, n) * eps of the compute dtype: a
  zero task vector, or an exactly low-rank one, e.g. of a fine-tune that trained only a few rows such as new
  tokens' embeddings) are dropped before the whitening: their
  singular vectors are an arbitrary basis that LAPACK chooses, and whitening them with the others would bend the
  real directions toward it;
- a matrix of rank smaller than T (k = 0, e.g. a 2 x n tensor merged from four models), where the reference
  returns a zero task vector, gets the mean of the task vectors like a non-matrix tensor, so that no task's change
  is lost without a word.

Defaults: `alpha` 1.0 is FusionBench's default (config/method/task_singular_vector/TaskSingularVectorMerging.yaml)
and the untuned value of the authors' code; both papers' code tune it on validation data over (0, 3] (a grid of
`np.linspace(0, 3, n)` in their eval.py): tune it per merge.

Reproducibility: the SVDs are LAPACK's (MKL's gesdd on x86 CPUs, cuSOLVER on CUDA), whose last bits depend on
the library, the device and the intra-op thread count (runtime/intra_op_threads.py gives each worker
cores // workers), so a merge gives the same bytes again with the same `--threads` on the same machine, and
otherwise outputs that differ by float32 rounding (tests/test_svd_methods.py).

Cost: T thin SVDs of m x n and two of (m x Tk), (Tk x n): about (T + 2) m n min(m, n) units of SVD work
per matrix (`svd_work`), which `plan` prices at the measured rate of engine.time_estimate.SVD_SECONDS_PER_UNIT.
Working memory: one task matrix and its thin SVD at a time (the T truncated factors total about one matrix), then
the concatenations and their SVDs, whatever T: at most about 6 copies of the matrix in the work dtype besides the
inputs, measured with the torch profiler (SVD_MEMORY below says how). No buffer is larger than the tensor's own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .common import check_same_shape, require_base, work_dtype
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory

__all__ = [
    "METHODS",
    "SVD_MEMORY",
    "finish",
    "matrix_rank_tolerance",
    "orthonormal_factor",
    "prepared_base",
    "task_matrices",
    "task_mean",
    "tsv_task_matrix",
]


def task_matrices(
    inputs: MergeInputs, base: torch.Tensor, dtype: torch.dtype, release: bool = True
) -> Iterator[torch.Tensor]:
    """Each non-base model's weighted task vector w_i (x_i - base) in `dtype`, one at a time (so a method that
    folds them holds one at a time); with `release`, the executor is told that each input will not be read again
    (see MergeInputs.done_with)."""
    for i in inputs.others():
        weight = float(inputs.model_params[i].get("weight", 1.0))
        delta = inputs.tensors[i].to(dtype) - base
        if release:
            inputs.done_with(i)
        if weight != 1.0:
            delta.mul_(weight)
        yield delta
        del delta  # before the next one is made


def task_mean(inputs: MergeInputs, base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_i w_i d_i / T: the reference codes' rule for tensors that are not matrices."""
    total = torch.zeros_like(base)
    count = 0
    for delta in task_matrices(inputs, base, dtype):
        total += delta
        count += 1
    return total / max(count, 1)


def matrix_rank_tolerance(s_max: float, shape: tuple[int, ...], dtype: torch.dtype) -> float:
    """The singular value at or below which a direction is numerical noise: s_max * max(m, n) * eps (numpy's and
    torch's matrix_rank rule)."""
    return float(s_max) * max(shape) * torch.finfo(dtype).eps


def thin_svd(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.linalg.svd(a, full_matrices=False), made to always converge.

    LAPACK's divide-and-conquer driver (gesdd, what torch calls on the CPU) can fail to converge on matrices with
    many repeated singular values, such as a task matrix projected off a common subspace (a block of exact zeros):
    measured on the 1 B bench merge with iso_cts, which stopped after minutes of work. Then the same SVD is
    retried in float64, and if that fails too, computed from the eigendecomposition of the float64 Gram matrix
    (symmetric eigensolvers always converge): sigma_i^2 and V from eigh(a^T a) (a a^T for a wide `a`), U = a V /
    sigma, with the directions whose sigma is at most the rank tolerance (which every caller drops) set to zero.
    Results come back in `a`'s dtype; the fallbacks cost more but only run where the fast path failed."""
    try:
        return torch.linalg.svd(a, full_matrices=False)
    except torch.linalg.LinAlgError:
        pass
    wide = a.to(torch.float64)
    try:
        u, s, vh = torch.linalg.svd(wide, full_matrices=False)
    except torch.linalg.LinAlgError:
        u, s, vh = _svd_by_eigh(wide)
    return u.to(a.dtype), s.to(a.dtype), vh.to(a.dtype)


def _svd_by_eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of a float64 matrix from the symmetric eigendecomposition of its smaller Gram matrix."""
    if a.shape[0] < a.shape[1]:
        v, s, uh = _svd_by_eigh(a.mT)
        return uh.mT, s, v.mT
    values, vectors = torch.linalg.eigh(a.mT @ a)  # ascending
    s = values.flip(0).clamp_min(0).sqrt()
    v = vectors.flip(1)
    tol = matrix_rank_tolerance(s[0].item() if s.numel() else 0.0, tuple(a.shape), torch.float32)
    kept = s > tol
    u = torch.zeros((a.shape[0], s.numel()), dtype=a.dtype, device=a.device)
    u[:, kept] = (a @ v[:, kept]) / s[kept]
    return u, torch.where(kept, s, torch.zeros_like(s)), v.mT


def orthonormal_factor(a: torch.Tensor) -> torch.Tensor:
    """The matrix with orthonormal columns (rows, for a wide `a`) nearest to `a` (orthogonal Procrustes):
    P Q^T from a = P S Q^T."""
    p, _s, qh = thin_svd(a)
    return p @ qh


def tsv_task_matrix(deltas: Iterator[torch.Tensor], count: int, like: torch.Tensor) -> torch.Tensor | None:
    """U_perp S V_perp^T from the T = `count` task matrices (of `like`'s shape, dtype and device), or None where
    k = floor(r / T) is 0 (rank smaller than T: the caller uses the mean)."""
    shape = tuple(like.shape)
    k = min(shape) // count
    if k == 0:
        return None
    us, ss, vhs = [], [], []
    for delta in deltas:
        u, s, vh = thin_svd(delta)
        del delta
        keep = int((s[:k] > matrix_rank_tolerance(s[0].item(), shape, s.dtype)).sum().item()) if s.numel() else 0
        if keep:  # s is sorted: the kept triplets are a prefix
            us.append(u[:, :keep].clone())
            ss.append(s[:keep].clone())
            vhs.append(vh[:keep].clone())
        del u, s, vh
    if not ss:  # every task vector is zero
        return torch.zeros_like(like)
    u_cat = torch.cat(us, dim=1)
    del us
    u_perp = orthonormal_factor(u_cat)
    del u_cat
    vh_cat = torch.cat(vhs, dim=0)
    del vhs
    vh_perp = orthonormal_factor(vh_cat)
    del vh_cat
    u_perp.mul_(torch.cat(ss))
    return u_perp @ vh_perp


def finish(base: torch.Tensor, merged: torch.Tensor, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """base + scale * merged, rounded once to the output dtype."""
    if scale != 1.0:
        merged = merged.mul_(scale)
    return merged.add_(base).to(out_dtype)


def prepared_base(inputs: MergeInputs, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.dtype] | None:
    """(the base as given, the base in the work dtype, the work dtype) after the shape and base checks, or None
    when no model besides the base contributes (the base is then the output): how every SVD method starts."""
    check_same_shape(inputs, method)
    base_in = inputs.tensors[require_base(inputs, method)]
    if not inputs.others():
        return None
    dtype = work_dtype(base_in)
    return base_in, base_in.to(dtype), dtype


def _merge(inputs: MergeInputs) -> torch.Tensor:
    prepared = prepared_base(inputs, "tsv")
    if prepared is None:
        return inputs.tensors[require_base(inputs, "tsv")]
    base_in, base, dtype = prepared
    merged = None
    if base.dim() == 2:
        merged = tsv_task_matrix(task_matrices(inputs, base, dtype), len(inputs.others()), base)
    if merged is None:
        merged = task_mean(inputs, base, dtype)
    return finish(base, merged, float(inputs.params["alpha"]), base_in.dtype)


def tsv_svd_work(shape: tuple[int, ...], tasks: int) -> float:
    """Units of SVD work (sum of m n min(m, n) over the SVDs) one TSV call makes on a tensor of `shape`."""
    if len(shape) != 2 or tasks < 1 or min(shape) // tasks == 0:
        return 0.0
    m, n = shape
    r = min(m, n)
    cat = tasks * (r // tasks)
    return tasks * m * n * r + m * cat * min(m, cat) + cat * n * min(cat, n)


SVD_MEMORY = WorkingMemory(per_input=1.0, fixed=4.0, bytes=28)
"""One call's working memory for the SVD methods (tsv, iso_c, iso_cts). Measured (torch profiler's peak of the
allocator's total during one call, tests/test_svd_methods.py::test_working_memory_covers_the_measured_peak, on
96x64 ... 768x768, 4096x64 and 64x4096 matrices with 2-8 task vectors): at most 6.1 copies of the matrix in the
work dtype (float32; float64 for float64 inputs) besides the inputs, square matrices the worst (a task matrix,
its thin SVD's U and V^T, LAPACK's work arrays, the concatenations); bf16 inputs add one float32 copy (the
converted base): 7.1. In the formula's terms: the inputs at the compute width (per_input 1), plus 4 copies at the
compute width and 28 bytes an entry, which covers 7.1 float32 copies of bf16 inputs by 27%, 6.1 float64 copies
by 23%, float32 by 80%."""


METHODS = (
    MethodSpec(
        name="tsv",
        description="TSV-M: each task's top singular vectors, whitened together (Gargiulo et al. 2025)",
        merge=_merge,
        params=(ParamSpec("alpha", 1.0),),
        model_params=(ParamSpec("weight", 1.0, non_base=True),),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        memory=SVD_MEMORY,
        svd_work=tsv_svd_work,
    ),
)
