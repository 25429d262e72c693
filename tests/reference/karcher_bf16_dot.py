"""Karcher on bf16 tensors of 1,048,576 entries: mergekit 0.1.5's against mergesmith's, with the dot
product accumulated in float32 (now) and with every product rounded to bf16 (before issue 16).

    PYTHONPATH=src ~/.cache/mergesmith/mergekit-venv/bin/python tests/reference/karcher_bf16_dot.py

Runs in the mergekit venv (`scripts/mergekit_venv.sh`), importing mergesmith's methods from src/.
Measured (torch 2.13 CPU): both mergesmith variants differ from mergekit in the same 8,075 of 1,048,576
entries (the blocked norms, README "Where outputs equal mergekit's") and are slightly closer to a
float64 rerun (mean error 4.56e-5 against 4.59e-5). Here cos(theta) is near 1, where the dot product
rounded to bf16 comes out the same either way; the float32 accumulation matters where the products
cancel (tests/test_mergekit_differences.py::test_bf16_dot_accumulates_in_float32_like_torch_dot).
"""

from __future__ import annotations

import torch
from mergekit.merge_methods.karcher import karcher_merge_tensors

from mergesmith.kernels import reductions
from mergesmith.methods import karcher


def _dot_rounding_each_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The dot product before the fix: bf16 products, bf16 block sums."""
    if a.numel() <= reductions.DOT_SERIAL_MAX:
        return torch.dot(a.reshape(-1), b.reshape(-1))
    return reductions.total(a * b)


def main() -> None:
    g = torch.Generator().manual_seed(5)
    n = 1 << 20
    base = torch.randn(n, generator=g) * 0.02
    xs = [(base + 0.3 * torch.randn(n, generator=g) * 0.02).bfloat16().reshape(1024, 1024) for _ in range(3)]
    alphas = [1 / 3] * 3
    mk = karcher_merge_tensors(xs, alphas, max_iter=20, tol=1e-7)
    f64 = karcher_merge_tensors([x.double() for x in xs], alphas, max_iter=20, tol=1e-7)
    new = karcher.karcher_mean(xs, alphas, max_iter=20, tol=1e-7)
    fixed = karcher.dot
    karcher.dot = _dot_rounding_each_product
    try:
        old = karcher.karcher_mean(xs, alphas, max_iter=20, tol=1e-7)
    finally:
        karcher.dot = fixed
    for name, t in (("mergekit", mk), ("mergesmith (float32 dot)", new), ("mergesmith (bf16 products)", old)):
        err = (t.double() - f64).abs()
        print(
            f"{name}: {int((t != mk).sum())}/{n} entries differ from mergekit; "
            f"|x - float64| max {err.max().item():.3e}, "
            f"mean {err.mean().item():.3e}"
        )


if __name__ == "__main__":
    main()
