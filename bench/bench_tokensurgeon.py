"""How long batched OMP takes, and how it scales with the shared vocabulary, the hidden size and k.

    PYTHONPATH=src python bench/bench_tokensurgeon.py [--quick] [--mergekit]

Generated embeddings (Gaussian; OMP's cost does not depend on the values). Each step of OMP is one
(targets x hidden) @ (hidden x shared) product plus small batched triangular work, so the time should be
about `k` such products: the script times one product alone beside each OMP run to show how close it
gets, fits seconds per (targets * shared * hidden * k) and extrapolates to a 150k-token vocabulary with
hidden size 4096 (100k shared tokens, 50k to approximate, k=64). `--mergekit` also times mergekit 0.1.5's
batch_omp on the same inputs (run it with the mergekit venv's python and this repo's src on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import time

import torch

from mergesmith.tokensurgeon.approximate import batch_omp


def _time(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, smaller points")
    parser.add_argument("--mergekit", action="store_true", help="also time mergekit's batch_omp")
    parser.add_argument("--targets", type=int, default=256)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    b = args.targets
    points = [  # (shared, hidden, k)
        (4000, 1024, 32),
        (8000, 1024, 32),
        (16000, 1024, 32),
        (8000, 1024, 16),
        (8000, 1024, 64),
        (8000, 2048, 32),
        (8000, 4096, 32),
    ]
    if args.quick:
        points = points[:2]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {b} targets per run")
    print("| shared N | hidden D | k | OMP s | k x one GEMM s | OMP / (k x GEMM) | ns per B*N*D*k | mergekit s |")
    print("|---|---|---|---|---|---|---|---|")
    rates = []
    for n, d, k in points:
        atoms = torch.randn(n, d, generator=g)
        targets = torch.randn(b, d, generator=g)
        omp_s = _time(lambda: batch_omp(targets, atoms, k))  # noqa: B023
        gemm_s = _time(lambda: targets @ atoms.T, repeat=3)  # noqa: B023
        unit = b * n * d * k
        rates.append(omp_s / unit)
        mk = "-"
        if args.mergekit:
            from mergekit.tokensurgeon import batch_omp as mk_omp

            mk = f"{_time(lambda: mk_omp(targets, atoms, k)):.2f}"  # noqa: B023
        print(
            f"| {n} | {d} | {k} | {omp_s:.2f} | {k * gemm_s:.2f} | {omp_s / (k * gemm_s):.2f} | "
            f"{omp_s / unit * 1e9:.4f} | {mk} |",
            flush=True,
        )
    rate = sorted(rates)[len(rates) // 2]
    big = 50_000 * 100_000 * 4096 * 64
    print(
        f"\nmedian {rate * 1e9:.4f} ns per B*N*D*k -> 50k targets x 100k shared x 4096 hidden x k=64: "
        f"{rate * big:.0f} s ({rate * big / 3600:.1f} h) on this machine"
    )


if __name__ == "__main__":
    main()
