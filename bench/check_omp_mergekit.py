"""mergesmith's batch_omp against mergekit 0.1.5's on random problems: same selections, same coefficients
while k is below the hidden size; what happens beyond it.

    PYTHONPATH=src ~/.cache/mergesmith/mergekit-venv/bin/python bench/check_omp_mergekit.py

Prints, per (targets B, atoms N, hidden D, k): the share of targets whose k selections are identical, the
mean residual norm of each, the largest coefficient difference (when the selections agree), the largest
|coefficient| of each, and the seconds each took.
"""

from __future__ import annotations

import time

import torch
from mergekit.tokensurgeon import batch_omp as mk_omp

from mergesmith.tokensurgeon.approximate import batch_omp

torch.manual_seed(0)
for b, n, d, k in [(200, 1000, 64, 16), (100, 500, 48, 64), (300, 3000, 128, 64)]:
    atoms, targets = torch.randn(n, d), torch.randn(b, d)
    started = time.perf_counter()
    i1, c1 = batch_omp(targets, atoms, k)
    t1 = time.perf_counter() - started
    started = time.perf_counter()
    i2, c2 = mk_omp(targets, atoms, k)
    t2 = time.perf_counter() - started
    same = (i1 == i2).all(dim=1).float().mean().item()
    r1 = (targets - torch.bmm(c1.unsqueeze(1), atoms[i1]).squeeze(1)).norm(dim=1).mean().item()
    r2 = (targets - torch.bmm(c2.unsqueeze(1), atoms[i2]).squeeze(1)).norm(dim=1).mean().item()
    diff = f"{(c1 - c2).abs().max().item():.2g}" if same == 1 else "-"
    print(
        f"B={b} N={n} D={d} k={k}: same selections {same:.2f}, residual {r1:.3g} (ours) {r2:.3g} (mergekit), "
        f"coefficient diff {diff}, max |coef| {c1.abs().max().item():.3g} / {c2.abs().max().item():.3g}, "
        f"{t1:.2f}s / {t2:.2f}s"
    )
