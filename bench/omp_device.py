"""Time one tool's batched OMP on a device at a tokenizer transplant's size; write its selections for comparison.

    python bench/omp_device.py --impl mergesmith --device cuda --out ms.pt            # in mergesmith's venv
    python bench/omp_device.py --impl mergekit --device cuda --out mk.pt --targets 2048  # in mergekit's venv

Used by bench/gpu_check.py, which runs it once in each tool's venv (the two venvs share the machine's torch, so
the seeded inputs are the same bytes) and compares the two selections. Inputs are Gaussian (OMP's cost does not
depend on the values): `--shared` atoms (the tokens both vocabularies have) of `--hidden` dimensions, and
`--targets` new tokens to approximate with `--k` atoms each. `--budget-s` lets the first run pick the largest
batch of targets that fits: it times a small warm-up batch (which also pays cuBLAS's start-up), then scales. The
seconds reported are the batch's alone, synchronised; the JSON line on stdout also gives the extrapolation to
`--full` targets (OMP's cost is linear in the number of targets).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

WARMUP_TARGETS = 64


def omp_function(impl: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The tool's batch_omp (imported here so each venv imports only its own tool)."""
    if impl == "mergesmith":
        from mergesmith.tokensurgeon.approximate import batch_omp
    else:
        from mergekit.tokensurgeon import batch_omp
    return batch_omp


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device):
    _sync(device)
    started = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - started


def targets_within(budget_s: float, warmup_s: float, most: int) -> int:
    """The largest batch (a multiple of the warm-up batch, at most `most`) whose time, scaled from the warm-up
    batch's, fits `budget_s`; at least the warm-up batch."""
    per_target = max(warmup_s, 1e-6) / WARMUP_TARGETS
    fit = int(budget_s / per_target) // WARMUP_TARGETS * WARMUP_TARGETS
    return max(WARMUP_TARGETS, min(most, fit))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=["mergesmith", "mergekit"], required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shared", type=int, default=50_000, help="atoms: tokens both vocabularies share")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--targets", type=int, default=2048, help="new tokens approximated in the timed batch (at most)")
    ap.add_argument("--full", type=int, default=50_000, help="new tokens of the whole transplant (extrapolated)")
    ap.add_argument("--budget-s", type=float, default=None, help="shrink --targets so the batch fits this time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the selections and coefficients here (torch.save)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    omp = omp_function(args.impl)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    atoms = torch.randn(args.shared, args.hidden, generator=gen, device=device)
    pool = torch.randn(args.targets, args.hidden, generator=gen, device=device)
    _, warmup_s = timed(lambda: omp(pool[:WARMUP_TARGETS], atoms, args.k), device)
    batch = args.targets
    if args.budget_s is not None:
        batch = targets_within(args.budget_s, warmup_s, args.targets)
    targets = pool[:batch]
    (indices, coeffs), seconds = timed(lambda: omp(targets, atoms, args.k), device)
    fit = torch.bmm(coeffs.unsqueeze(1).to(atoms.dtype), atoms[indices]).squeeze(1)
    residual = (targets - fit).norm(dim=1).mean().item()
    if args.out:
        torch.save({"indices": indices.cpu(), "coeffs": coeffs.float().cpu()}, args.out)
    print(json.dumps({
        "impl": args.impl, "device": str(device), "shared": args.shared, "hidden": args.hidden, "k": args.k,
        "targets": batch, "full": args.full, "seconds": seconds, "warmup_s": warmup_s,
        "full_s": seconds * args.full / batch, "residual": residual,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
