"""How long `plan` says a merge will take, from measured rates: start-up, then the larger of its I/O and its compute.

Part of the report (the planners' layer, tests/test_layers.py): it asks the executor which compiled loops a merge
would start.

Why a model of its own: the estimate used to be the inputs' and output's bytes over the probed disk rates alone,
which said 0.5 s for a tiny merge that took 7 s of wall time (start-up is most of a small merge) and a fifth of a
TIES merge's time (TIES is CPU-bound, not disk-bound). Now:

    seconds = STARTUP_S + max(I/O, compute) + first compile

- I/O: bytes read over the probed read rate plus bytes written over the probed write rate (report.py's probes);
  the merge overlaps reading, computing and writing, so the larger of I/O and compute bounds it, not their sum.
- compute: for each merged tensor, its entries times its inputs times the method's rate, measured as wall time per
  input entry beyond start-up on the bench's 1b merges (3 inputs a tensor, bfloat16, 2 workers on the bench VM's
  2 cores), scaled by the workers this merge will have; plus, for the SVD-based methods (tsv, iso_c, iso_cts), their
  SVD work (MethodSpec.svd_work: about (T + 2) m n min(m, n) per m x n matrix for TSV) at SVD_SECONDS_PER_UNIT,
  one thread a worker. Their SVDs cost c m n min(m, n), not c m n: a 1b merge of two models by tsv does about
  7.6e12 units (iso_c 2.2e12, iso_cts 1.1e13), some 17 minutes on the 2-core VM (iso_c 5, iso_cts 25), against
  ties' half minute, and `plan` says so.
- first compile: where numba's cache lacks the compiled loops the merge will start
  (execution.kernel_warmup.kernel_groups), what compiling them beside the merge cost the first bench merge (the
  merge does not wait for them, but shares the cores with the compile and runs uncompiled meanwhile).

The constants come from bench/README.md's runs on the shared 2-core VM; another machine will differ, and
`python bench/plan_accuracy.py` prints estimate against measured wall time to check them (issue 29 asks for 2x).

On CUDA (`--device cuda`) the compute part is replaced by the device path's (device_seconds): the bytes copied
host to device and back over PCIe at PCIE_BYTES_PER_S, plus the SVD-based methods' and WUDI's work at the CPU
rates above (an upper bound); the elementwise arithmetic itself runs at the GPU's memory bandwidth, negligible
beside the copies. Those copies overlap the reads and writes (device_transfer.py), so the disk I/O stays the bound
of an elementwise merge. PCIE_BYTES_PER_S and CUDA_INIT_S are assumptions, not measurements: no GPU was available
when they were written; a GPU run of `bench/plan_accuracy.py` should replace them.
"""

from __future__ import annotations

import os
import statistics

from ..io.dtypes import dtype_size, to_torch
from ..kernels.introsort_replay import IDS_MAX_ENTRIES
from ..methods import get_method
from .execution.device_transfer import staging_dtype
from .execution.kernel_warmup import kernel_groups
from .plan import Plan, TensorRecipe

STARTUP_S = 2.2
"""Process start to the first tensor and last write to exit: python and torch imports, config, plan, card, fsync.
The quick start's tiny merges (examples/linear.yml, frankenmerge.yml, ties and dare_ties configs), nearly all
start-up, took 1.3-1.5 s of wall time on the 2-core bench VM at a load of 1-2 and up to 4.5 s at a load of 4-5
(other jobs), with and without numba's cache (`python bench/plan_accuracy.py --demo --runs 3 [--empty-cache]`);
bench/README.md's 1b runs show ~3.5 s before the first read at full rate (`vmstat 1`), and a cold torch import
alone takes 2.5-4 s. 2.2 s keeps 1.1-4.4 s within 2x."""

BENCH_WORKERS = 2
"""Workers of the runs that gave the rates below (the default: one per core of the 2-core bench VM)."""

BENCH_INPUTS = 3
"""Inputs per merged tensor in those runs (benchlib.make_config: base + 2 models, or 3 models)."""

BENCH_ENTRIES = 1_100_048_384
"""Entries of the 1b bench model (bench/make_models.py --size 1b: TinyLlama-1.1B's shape)."""


BENCH_LARGE_ENTRIES = 2 * 32_000 * 2048
"""Entries of the 1b model's tensors over IDS_MAX_ENTRIES: its embedding and its (untied) output matrix."""

SELECTION_TABLE_EXTRA = (26.1 - 20.3) / (BENCH_LARGE_ENTRIES * BENCH_INPUTS)
"""Seconds more per input entry of TIES' selection on tensors over introsort_replay.IDS_MAX_ENTRIES, which follow
their cut keys through a table rather than by ids: single cold runs of `mergesmith merge 1b-ties.yml` took 20.3 s
with ids for every tensor and 26.1 s with the cap (bench/README.md, "Fifth round"). A small model's embedding is
a larger share of it (0.25b: a quarter of the entries, 1b: an eighth), so one rate per entry would not serve both."""


def _rate(wall_s: float, large_extra: float = 0.0) -> float:
    """Seconds per input entry of a 1b bench merge that took `wall_s` (wall+sync) in all, less the extra its large
    tensors cost at `large_extra` an input entry."""
    return (wall_s - STARTUP_S - large_extra * BENCH_LARGE_ENTRIES * BENCH_INPUTS) / (BENCH_ENTRIES * BENCH_INPUTS)


SECONDS_PER_INPUT_ENTRY = {
    # `python bench/compare_mergekit.py --with-mergekit --size 1b --methods linear,ties --runs 3 --mergekit-runs 1
    # --floor-runs 2`, commit e47f56d, idle machine (bench/README.md, "Fifth round"): linear 9.0 s, ties 28.4 s
    "linear": _rate(9.0),
    "ties": _rate(28.4, SELECTION_TABLE_EXTRA),
    # the same command with `--methods dare_ties` on commit 4d2dc51 (bench/README.md, "Fifth round"): 15.3 s
    "dare_ties": _rate(15.3),
    # `python bench/compare_mergekit.py --with-mergekit --size 1b --methods ...,dare_linear,della --runs 3
    # --mergekit-runs 1 --floor-runs 2` (bench/README.md, "Fourth round"): dare_linear 15.4 s, della 27.6 s
    "dare_linear": _rate(15.4),
    "della": _rate(27.6),
}
"""Wall seconds per input entry beyond start-up, by method, at BENCH_WORKERS workers."""

FIRST_COMPILE_S = {"bf16_mix": 1.0, "introsort_replay": 9.6, "keyed_kernels": 2.2}
"""What an empty numba cache added to a merge, by kernel group: `python bench/first_run.py --size 0.25b --rounds 1
--old` (2026-11-26 19:47 UTC, load 0.5) timed the first merge with an empty cache against one with the cache
filled: ties 18.2 against 7.6 s (+10.6 s: bf16_mix and introsort_replay, split by their compile times, 1.9 and
17.2 s timed ad hoc by their `warm()`), dare_ties 6.3 against 4.1 s (+2.2 s: keyed_kernels). The compile runs
beside the merge, so a smaller merge (which ends first) pays less of it: an upper bound there."""

LIKE = {
    "breadcrumbs_ties": "ties",  # the same magnitude selection and sign consensus
    "breadcrumbs": "ties",
    "della_linear": "della",
    "consensus_ties": "ties",  # TIES' trim and election, then per-entry masks
}
"""Methods not benched, and the benched method whose work they share."""


SVD_SECONDS_PER_UNIT = 2.7e-10
"""Wall seconds per unit of SVD work (m n min(m, n) per thin SVD of an m x n float32 matrix) of the SVD-based
methods' merge calls, on one torch thread. `python bench/svd_rate.py` on the 2-core VM (torch 2.13 CPU, load 0.5,
2026-11-27 00:28 UTC, 2 task vectors, shapes of the 1b model divided by 4) printed, in s/unit:

    method         shape  seconds      units     s/unit
    tsv          512x512    0.160   5.37e+08   2.99e-10
    tsv           64x512    0.004   6.55e+06   5.42e-10
    tsv         1408x512    0.254   1.24e+09   2.04e-10
    tsv         512x1408    0.381   1.24e+09   3.07e-10
    tsv         8000x512    0.769   6.43e+09    1.2e-10
    iso_c        512x512    0.040   1.34e+08   2.98e-10
    iso_cts      512x512    0.180   6.71e+08   2.68e-10
    iso_cts     8000x512    1.079   1.05e+10   1.03e-10
    ...
    median seconds per unit: 2.68e-10 (min 1.03e-10, max 5.56e-10)

and with `--scale 2` (1024x1024 ... 16000x1024) a median of 2.55e-10 (min 9.97e-11, max 3.91e-10): the rate holds
across sizes within 2x either way (tall matrices are faster per unit, wide ones and tiny ones slower). A CPU rate:
for a merge on a GPU (`--device cuda`, cuSOLVER) it is an upper bound."""


def svd_seconds(recipe: TensorRecipe) -> float:
    """One-thread seconds of the SVDs a merge recipe makes (0 for methods without `svd_work`)."""
    spec = get_method(recipe.method) if recipe.method else None
    if spec is None or spec.svd_work is None:
        return 0.0
    tasks = len(recipe.inputs) - (recipe.base_index is not None)
    return spec.svd_work(tuple(recipe.shape), tasks) * SVD_SECONDS_PER_UNIT


def seconds_per_input_entry(method: str | None) -> float:
    """The rate of `method`: its own, a like method's, or linear's (the plain elementwise methods, I/O-bound)."""
    name = LIKE.get(method or "", method or "")
    return SECONDS_PER_INPUT_ENTRY.get(name, SECONDS_PER_INPUT_ENTRY["linear"])


def _recipe_seconds(method: str | None, entries: int, inputs: int) -> float:
    rate = seconds_per_input_entry(method)
    if LIKE.get(method or "", method) == "ties" and entries > IDS_MAX_ENTRIES:
        rate += SELECTION_TABLE_EXTRA
    return entries * inputs * rate


WUDI_FLOPS_PER_S = 5.1e10
"""WUDI's matrix products on the CPU: 20 Adam steps on a 2048 x 2048 matrix of 3 task vectors (2 x 2048^3 flops
each, methods/wudi.py's step_flops) took 6.7 s with 2 threads on the 2-core dev VM while other jobs ran."""


def wudi_seconds(recipe: TensorRecipe) -> float:
    """The Adam steps of a WUDI recipe at WUDI_FLOPS_PER_S (0 for the tensors it averages): iterative, so its cost
    is steps x products, not entries x inputs (300 steps on a 1.1 B model are hours on a CPU)."""
    from ..methods.wudi import optimised, step_flops

    if recipe.method != "wudi" or not optimised(recipe.name, recipe.shape):
        return 0.0
    iters = int(dict(recipe.params).get("iter_num", 300))
    tasks = len(recipe.inputs) - int(recipe.base_index is not None)
    return iters * step_flops(recipe.shape, tasks) / WUDI_FLOPS_PER_S


def recipe_seconds(recipe: TensorRecipe) -> float:
    """One recipe's work at the bench's rates, on the footing of compute_seconds (wall time at BENCH_WORKERS
    workers): its entries at its method's rate, its SVDs, its WUDI steps; 0 for a copy or an op."""
    if recipe.op != "merge":
        return 0.0
    work = _recipe_seconds(recipe.method, recipe.numel(), len(recipe.inputs))
    return work + svd_seconds(recipe) / BENCH_WORKERS + wudi_seconds(recipe)


def compute_seconds(plan: Plan, threads: int) -> float:
    """The merged tensors' work at the bench's rates, for `threads` workers (no more than this machine's cores).

    The per-entry rates are wall time at BENCH_WORKERS workers; the SVDs' one-thread seconds are divided by them to
    be on that footing, so that the whole is then divided among this merge's workers."""
    work = sum(recipe_seconds(r) for r in plan.recipes)
    return work * BENCH_WORKERS / _workers(threads)


def _workers(threads: int) -> int:
    return max(1, min(threads, os.cpu_count() or 1))


LONG_POLE_SHARE = 0.1
"""A recipe is a long pole when its own work is at least this share of one worker's share of the whole merge..."""
LONG_POLE_TYPICAL = 4.0
"""... and this many times the median recipe's: in a model of alike tensors none is (each is a fair share)."""


def long_poles(recipes: list[TensorRecipe], threads: int) -> frozenset[str]:
    """The recipes to start before the others: those whose own work is a large part of what each worker has to do.

    Why: workers take recipes in plan order, and a plan ends with the output's last tensors; where one of those is
    long (TIES' selection over a 65 M-entry lm_head takes ~4 s of one core on the 1b bench, where every other
    tensor takes a fraction of a second), it ran alone at the end while the other cores idled (a CPU timeline of the
    1b ties merge: 4 s at one busy core after the last read). Started first, it overlaps the rest (the longest-
    processing-time-first rule). A model of alike tensors has none."""
    seconds = {r.name: recipe_seconds(r) for r in recipes}
    share = sum(seconds.values()) / _workers(threads)
    if share <= 0:
        return frozenset()
    typical = statistics.median(seconds.values())
    return frozenset(
        name for name, s in seconds.items() if s >= LONG_POLE_SHARE * share and s >= LONG_POLE_TYPICAL * typical
    )


def first_compile_seconds(plan: Plan, device: str) -> float:
    """The extra time of the kernel groups this merge would compile (on the CPU, with numba's cache lacking them)."""
    if device != "cpu":
        return 0.0
    return sum(FIRST_COMPILE_S.get(g.name, 0.0) for g in kernel_groups(plan.recipes) if not g.cached())


PCIE_BYTES_PER_S = 12e9
"""Assumed rate of a pinned host-to-device (and device-to-host) copy: PCIe 4.0 x16 peaks near 25 GB/s and pinned
copies commonly reach about half of it in practice. An assumption, not a measurement (no GPU was available)."""

CUDA_INIT_S = 1.5
"""Assumed extra start-up on CUDA: creating the context and loading the kernels the merge uses. An assumption, not
a measurement (no GPU was available)."""


def device_transfer_bytes(plan: Plan) -> tuple[int, int]:
    """(host to device, device to host) bytes of a merge on CUDA: each merged tensor's inputs in the dtype they
    cross the bus in (device_transfer.staging_dtype: bf16 inputs of an fp32 merge cross as bf16; the recipe's
    output dtype stands for its inputs' stored one), and its output. Copies stay on the CPU."""
    compute = to_torch(plan.compute_dtype)
    to_device = to_host = 0
    for recipe in plan.recipes:
        if recipe.op != "merge":
            continue
        wire = staging_dtype(to_torch(recipe.dtype), compute)
        to_device += recipe.numel() * len(recipe.inputs) * wire.itemsize
        to_host += recipe.numel() * dtype_size(recipe.dtype)
    return to_device, to_host


def device_seconds(plan: Plan, threads: int) -> dict[str, float]:
    """The device path's work (`transfer`: the PCIe copies at PCIE_BYTES_PER_S; `compute`: those plus the SVD and
    WUDI work at the CPU rates, an upper bound) and the bytes it copies each way."""
    to_device, to_host = device_transfer_bytes(plan)
    transfer = (to_device + to_host) / PCIE_BYTES_PER_S
    merges = [r for r in plan.recipes if r.op == "merge"]
    heavy = sum(svd_seconds(r) for r in merges) / _workers(threads)
    heavy += sum(wudi_seconds(r) for r in merges)
    return {
        "transfer": transfer,
        "compute": transfer + heavy,
        "to_device_bytes": float(to_device),
        "to_host_bytes": float(to_host),
    }


def estimate_seconds(
    plan: Plan, read_rate: float, write_rate: float, threads: int, device: str = "cpu"
) -> dict[str, float]:
    """The estimate and its parts (`startup`, `io`, `compute`, `first_compile`, `total`; on CUDA also `transfer`
    and the bytes each way, see device_seconds), rates in bytes/s (0: unknown)."""
    est = plan.estimate
    assert est is not None
    io = (est.bytes_read / read_rate if read_rate > 0 else 0.0) + (
        est.bytes_written / write_rate if write_rate > 0 else 0.0
    )
    if device.startswith("cuda"):
        parts = device_seconds(plan, threads)
        startup = STARTUP_S + CUDA_INIT_S
        total = startup + max(io, parts["compute"])
        return {"startup": startup, "io": io, "first_compile": 0.0, "total": total, **parts}
    compute = compute_seconds(plan, threads)
    first = first_compile_seconds(plan, device)
    total = STARTUP_S + max(io, compute) + first
    return {"startup": STARTUP_S, "io": io, "compute": compute, "first_compile": first, "total": total}
