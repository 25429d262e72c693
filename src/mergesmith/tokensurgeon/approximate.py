"""The math of tokenizer transplantation: rows for tokens the base model lacks (pure tensor functions).

Every method here sees the donor's embedding of each token to approximate (`targets`), the donor's
rows of the tokens both vocabularies share (`donor_shared`) and the base's rows of the same tokens
(`base_shared`, row i the same token as donor_shared's row i). OMP and common interpolation express a
target as a sparse combination of shared tokens in the donor's space and apply the same combination
to the base's rows: the coefficients carry over, the widths of the two spaces need not match.

Written by hand (no library does batched OMP over torch tensors; scikit-learn's
`orthogonal_mp_gram` is a per-target loop in NumPy): `batch_omp` runs the greedy selection for a
whole block of targets at once. Per step it costs one (block x hidden) @ (hidden x shared) product
for the correlations, and the least-squares coefficients come from a Cholesky factor of the selected
atoms' Gram matrix grown by one row per step (a triangular solve, never a refactorisation).
"""

from __future__ import annotations

import torch

from ..runtime.devices import min_norm_lstsq

WORK_DTYPES = (torch.float32, torch.float64)


def _work(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in WORK_DTYPES else t.to(torch.float32)


def omp_block_bytes(shared: int, hidden: int, k: int) -> int:
    """Working bytes per target of `batch_omp` (float32): correlations, selected atoms, factor, residual."""
    return 4 * (2 * shared + k * hidden + k * k + 4 * hidden + 4 * k)


def interpolation_block_bytes(shared: int, hidden: int, k: int) -> int:
    """Working bytes per target of `common_interpolation` (float32): its distances to every shared token (three
    rows of them with cosine), its k neighbours' rows twice (gathered, and the copy the least-squares solve
    takes to the CPU) and the barycentric system."""
    return 4 * (3 * shared + 2 * k * hidden + 2 * (k + 1) ** 2 + 4 * k + hidden)


def batch_omp(
    targets: torch.Tensor,
    atoms: torch.Tensor,
    k: int,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthogonal Matching Pursuit for every row of `targets` [B, D] over the rows of `atoms` [N, D].

    Returns (indices [B, k], coefficients [B, k]) such that `coefficients[b] @ atoms[indices[b]]`
    is the least-squares fit of `targets[b]` on the atoms OMP chose. Each step picks the atom with
    the largest |<residual, atom>| not chosen yet (the atoms are not normalised, as in the paper's
    and mergekit's implementation), then refits every coefficient. An atom that adds no new
    direction (the residual is already zero, e.g. once k exceeds the hidden size) keeps coefficient
    0 instead of blowing up the fit. `block` bounds how many targets are worked on at once (memory:
    `omp_block_bytes` per target); the result does not depend on it beyond float rounding.
    """
    if targets.ndim != 2 or atoms.ndim != 2 or targets.shape[1] != atoms.shape[1]:
        raise ValueError(
            f"OMP needs [B, D] targets and [N, D] atoms, got {list(targets.shape)} and {list(atoms.shape)}"
        )
    n = atoms.shape[0]
    if k > n:
        raise ValueError(f"cannot select k={k} atoms from {n}")
    b = targets.shape[0]
    atoms_w = _work(atoms)
    dtype = atoms_w.dtype
    indices = torch.zeros((b, k), dtype=torch.long, device=atoms.device)
    coeffs = torch.zeros((b, k), dtype=dtype, device=atoms.device)
    step = b if not block or block >= b else max(1, block)
    norms_sq = atoms_w.pow(2).sum(dim=1)
    for start in range(0, b, step):
        end = min(start + step, b)
        idx, coef = _omp_block(targets[start:end].to(dtype), atoms_w, norms_sq, k)
        indices[start:end] = idx
        coeffs[start:end] = coef
    return indices, coeffs


def _omp_block(
    y: torch.Tensor, atoms: torch.Tensor, norms_sq: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    b, d = y.shape
    dtype, device = y.dtype, y.device
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    chosen = torch.zeros((b, k), dtype=torch.long, device=device)
    picked = torch.zeros((b, k, d), dtype=dtype, device=device)  # the chosen atoms, in order
    factor = torch.zeros((b, k, k), dtype=dtype, device=device)  # lower Cholesky factor of their Gram
    rhs = torch.zeros((b, k), dtype=dtype, device=device)  # <target, atom> per chosen atom (0: dead slot)
    coef = torch.zeros((b, 0), dtype=dtype, device=device)
    residual = y.clone()
    for t in range(k):
        corr = residual @ atoms.T  # [b, n]
        corr.abs_()
        if t:
            corr.scatter_(1, chosen[:, :t], -1.0)  # |corr| >= 0, so -1 masks the chosen atoms
        new = corr.argmax(dim=1)
        del corr
        chosen[:, t] = new
        atom = atoms[new]  # [b, d]
        picked[:, t] = atom
        a_sq = norms_sq[new]
        if t:
            cross = torch.bmm(picked[:, :t], atom.unsqueeze(-1))  # [b, t, 1]
            w = torch.linalg.solve_triangular(factor[:, :t, :t], cross, upper=False).squeeze(-1)
            d_sq = a_sq - w.pow(2).sum(dim=1)
        else:
            w = None
            d_sq = a_sq
        live = d_sq > tol * a_sq.clamp(min=torch.finfo(dtype).tiny)
        if w is not None:
            factor[:, t, :t] = torch.where(live.unsqueeze(1), w, torch.zeros_like(w))
        factor[:, t, t] = torch.where(live, d_sq.clamp(min=0).sqrt(), torch.ones_like(d_sq))
        rhs[:, t] = torch.where(live, (y * atom).sum(dim=1), torch.zeros_like(d_sq))
        lower = factor[:, : t + 1, : t + 1]
        coef = torch.cholesky_solve(rhs[:, : t + 1].unsqueeze(-1), lower, upper=False).squeeze(-1)
        if t + 1 < k:
            residual = y - torch.bmm(coef.unsqueeze(1), picked[:, : t + 1]).squeeze(1)
    return chosen, coef


def apply_coefficients(indices: torch.Tensor, coeffs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`coeffs[b] @ rows[indices[b]]` for every b, in float32 (or float64 when coeffs are)."""
    out = torch.empty((indices.shape[0], rows.shape[1]), dtype=coeffs.dtype, device=coeffs.device)
    step = 4096
    for start in range(0, indices.shape[0], step):
        end = min(start + step, indices.shape[0])
        gathered = rows[indices[start:end]].to(coeffs.dtype)  # [s, k, h]
        out[start:end] = torch.bmm(coeffs[start:end].unsqueeze(1), gathered).squeeze(1)
    return out


def common_interpolation(
    targets: torch.Tensor,
    atoms: torch.Tensor,
    k: int,
    scheme: str = "distance_proportional",
    cosine: bool = False,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k shared tokens nearest each target (Euclidean, or cosine distance) and their weights.

    Weights (mergekit's `--weight-scheme`): `distance_proportional` 1/d (1-d for cosine) normalised to
    sum 1; `least_squares` the least-squares fit on the k neighbours; `barycentric` the least-squares
    fit whose weights sum to 1. Both are the minimum-norm fit when the neighbours are linearly dependent
    (repeated embeddings, k above the hidden size): runtime.devices.min_norm_lstsq, the same on every device.
    """
    n = atoms.shape[0]
    if k > n:
        raise ValueError(f"cannot select k={k} neighbours from {n}")
    atoms_w = _work(atoms)
    b = targets.shape[0]
    indices = torch.zeros((b, k), dtype=torch.long, device=atoms.device)
    weights = torch.zeros((b, k), dtype=atoms_w.dtype, device=atoms.device)
    step = b if not block or block >= b else max(1, block)
    for start in range(0, b, step):
        end = min(start + step, b)
        y = targets[start:end].to(atoms_w.dtype)
        if cosine:
            num = y @ atoms_w.T
            den = y.norm(dim=1, keepdim=True) * atoms_w.norm(dim=1).unsqueeze(0)
            dist = 1 - num / den.clamp(min=1e-6)
        else:
            dist = torch.cdist(y, atoms_w, p=2)
        near_d, near = torch.topk(dist, k=k, dim=1, largest=False)
        indices[start:end] = near
        points = atoms_w[near]  # [s, k, d]
        if scheme == "distance_proportional":
            w = (1 - near_d) if cosine else 1 / near_d.clamp(min=1e-6)
            w = w / w.sum(dim=1, keepdim=True).clamp(min=1e-6)
        elif scheme == "least_squares":
            w = min_norm_lstsq(points.transpose(1, 2), y.unsqueeze(-1)).squeeze(-1)
        elif scheme == "barycentric":
            w = _barycentric(y, points)
        else:
            raise ValueError(f"unknown weight scheme {scheme!r}")
        weights[start:end] = w
    return indices, weights


def _barycentric(y: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Least-squares weights constrained to sum to 1 (the KKT system of the constrained fit)."""
    s, k, _ = points.shape
    gram = torch.bmm(points, points.transpose(1, 2))
    system = torch.zeros((s, k + 1, k + 1), dtype=y.dtype, device=y.device)
    system[:, :k, :k] = gram
    system[:, :k, k] = 1
    system[:, k, :k] = 1
    rhs = torch.ones((s, k + 1), dtype=y.dtype, device=y.device)
    rhs[:, :k] = torch.bmm(points, y.unsqueeze(-1)).squeeze(-1)
    return min_norm_lstsq(system, rhs.unsqueeze(-1)).squeeze(-1)[:, :k]
