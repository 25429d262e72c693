"""The `plan` report: what a merge will write and cost, from headers and a quick throughput probe."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..io.checkpoint import Checkpoint
from ..sizes import human_size
from .plan import Plan
from .planning.shared import MergeOptions
from .time_estimate import PCIE_BYTES_PER_S, estimate_seconds

PROBE_BYTES = 256 << 20
SEED_DRAWN_TEXT = "drawn at merge time (pass --random-seed N to fix it)"
"""What `plan` says of the seed of a randomised merge given none (and none to resume): the merge draws its own."""


def probe_read_throughput(checkpoints: dict[str, Checkpoint], limit: int = PROBE_BYTES) -> float:
    """Bytes/s reading the inputs' weight files (up to `limit` bytes): what bounds merge speed."""
    read = 0
    started = time.perf_counter()
    for ck in checkpoints.values():
        for file in ck.files:
            with open(file, "rb", buffering=0) as f:
                while read < limit:
                    chunk = f.read(16 << 20)
                    if not chunk:
                        break
                    read += len(chunk)
            if read >= limit:
                break
    elapsed = time.perf_counter() - started
    return read / elapsed if elapsed > 0 and read else 0.0


PROBE_WRITE_BYTES = 64_000_000


def probe_write_throughput(directory: Path, size: int = PROBE_WRITE_BYTES) -> tuple[float | None, str | None]:
    """(bytes/s, None) writing and fsyncing a scratch file in `directory` (an existing directory where
    the output will go), or (None, why) when it cannot be measured there: read-only, full, or too
    little free space to write the scratch file without crowding the merge itself."""
    if not os.access(directory, os.W_OK):
        return None, "not writable"
    try:
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        return None, f"cannot read free space ({exc.strerror or exc})"
    if free < 2 * size:
        return None, f"less than {human_size(2 * size)} free"
    block = os.urandom(1_000_000)
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".mergesmith-probe-")
    except OSError as exc:
        return None, _write_failure(exc)
    try:
        started = time.perf_counter()
        for _ in range(size // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        elapsed = time.perf_counter() - started
    except OSError as exc:
        return None, _write_failure(exc)
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass
    return (size / elapsed if elapsed > 0 else None), (None if elapsed > 0 else "too fast to time")


def _write_failure(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "not writable"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left for the 64 MB probe"
    return f"probe write failed ({exc.strerror or exc})"


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def check_plan_out_dir(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is a file, or lies under one, in one line (as `merge` does)."""
    where = _existing_parent(out_dir)
    if not where.is_dir():
        if where == out_dir.resolve():
            raise OutputError(f"{out_dir}: output path exists and is not a directory")
        raise OutputError(f"{out_dir}: {where} is a file, not a directory")


def plan_report(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    out_dir: Path | None,
    options: MergeOptions,
    downloads: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything `mergesmith plan` shows, as plain data (the same dict is printed as JSON): with the hub
    downloads the merge needs first, and what a feature's planner recorded in the plan's options (an MoE
    assembly, a `transplant:` vocabulary)."""
    est = plan.estimate
    assert est is not None
    read_rate = probe_read_throughput(checkpoints)
    where = None
    if out_dir is not None:
        check_plan_out_dir(out_dir)
        where = _existing_parent(out_dir)
    write_rate: float | None = None
    write_note: str | None = "no OUT_DIR given"
    if where is not None:
        write_rate, write_note = probe_write_throughput(where)
    # an unmeasured write speed is estimated as the read speed (and said so), never reported as measured
    assumed_write_rate = write_rate if write_rate else read_rate
    timing = estimate_seconds(plan, read_rate, assumed_write_rate, est.concurrency, options.device)
    disk: dict[str, Any] | None = None
    if where is not None:
        free = shutil.disk_usage(where).free
        disk = {
            "path": str(where),
            "free_bytes": free,
            "needed_bytes": est.bytes_written,
            "enough": free >= est.bytes_written,
            "writable": write_note != "not writable",
        }
    too_big = None
    if options.max_memory and est.largest_tensor_bytes > options.max_memory:
        too_big = {"tensor": est.largest_tensor, "bytes": est.largest_tensor_bytes, "budget": options.max_memory}
    report = {
        "method": plan.recipes[0].method if plan.recipes and plan.recipes[0].method else "passthrough",
        "tensors": [
            {
                "name": r.name,
                "shape": list(r.shape),
                "dtype": r.dtype,
                "op": r.op,
                "method": r.method,
                "inputs": [[i.model, i.tensor] for i in r.inputs],
                "params": dict(r.params),
                "model_params": [dict(p) for p in r.model_params],
                "shard": s.filename,
                # written quantized (engine/planning/quantization.py): the tensors it is stored as
                **({"stored": [[n, d, list(sh)] for n, d, sh in r.stored()]} if r.quantize else {}),
            }
            for s in plan.shards
            for r in s.recipes
        ],
        "shards": [{"file": s.filename, "tensors": len(s.recipes), "bytes": s.data_bytes} for s in plan.shards],
        "out_dtype": plan.out_dtype,
        "compute_dtype": plan.compute_dtype,
        "bytes_read": est.bytes_read,
        "bytes_written": est.bytes_written,
        "peak_memory_bytes": est.peak_memory,
        "read_ahead_bytes": est.read_ahead,
        "threads": est.concurrency,
        "max_memory": options.max_memory,
        "largest_tensor": {"name": est.largest_tensor, "working_bytes": est.largest_tensor_bytes},
        "over_budget": too_big,
        "disk": disk,
        "read_throughput_bytes_per_s": read_rate,
        "write_throughput_bytes_per_s": write_rate,
        "write_not_measured": write_note if write_rate is None else None,
        "estimated_seconds": timing["total"],
        "estimated_seconds_parts": timing,
        # a seed planning drew is this plan's only: the merge draws its own, so it is not shown as the merge's
        "random_seed": None if options.seed_drawn else plan.random_seed,
        "random_seed_drawn_at_merge": plan.random_seed is not None and options.seed_drawn,
        "files_to_copy": [name for _src, name in plan.files_to_copy],
        "output_layers": plan.output_config.get("num_hidden_layers"),
        "warnings": list(plan.warnings),
        "memory": _memory(est),
        "gpu": gpu_report(plan, options, timing, est.concurrency),
    }
    report["inputs"] = [input_summary(ref, ck) for ref, ck in checkpoints.items()]
    if downloads:
        report["downloads"] = downloads
    if plan.options.get("moe"):
        report["method"] = "moe"
        report["moe"] = plan.options["moe"]
    if plan.options.get("tokensurgeon"):
        report["tokensurgeon"] = plan.options["tokensurgeon"]
    # data steps run before the merge (engine/extensions.py), each with what it records under its own name
    prepare = [{"step": name, **(plan.options.get(name) or {})} for name in plan.options.get("prepare") or []]
    if prepare:
        report["prepare"] = prepare
    return report


_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def input_summary(ref: str, ckpt: Checkpoint) -> dict[str, Any]:
    """What `plan` says of one input model: architecture, layer count, whether it is a mixture of experts, and
    how it is stored (quantized or not), from its config.json and tensor headers."""
    from .planning.architecture import find_layer_stack
    from .planning.quantization import describe

    config = ckpt.config or {}
    scopes = [config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}]
    archs = config.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type") or "unknown")
    stack = find_layer_stack(ckpt.tensors, ckpt.config)
    experts = max((int(s[k]) for s in scopes for k in _EXPERT_COUNT_KEYS if isinstance(s.get(k), int)), default=0)
    moe = experts > 1 or any(".experts." in name for name in ckpt.tensors)
    return {
        "model": ref,
        "architecture": arch,
        "layers": stack.count if stack is not None else None,
        "moe": moe,
        "experts": experts or None,
        "quantization": describe(ckpt),
    }


def _memory(est: Any) -> dict[str, Any]:
    """What this process may use (cgroup limit, available memory) against the estimate (memory_limits)."""
    from ..runtime.memory_limits import memory_report

    return memory_report(est.peak_memory, est.largest_tensor_bytes, est.read_ahead)


def gpu_report(plan: Plan, options: MergeOptions, timing: dict[str, float], threads: int) -> dict[str, Any] | None:
    """What `plan --device cuda` says of the device (None off CUDA): its memory at peak with `threads` recipes in
    flight against the device budget (runtime/device_memory.py; not read for Ray, whose workers hold the GPUs), the
    largest recipe's, the pinned staging buffers, and the PCIe copies at the assumed rate (time_estimate.py).
    Refuses (ConfigError) a tensor whose device working set alone exceeds the budget, as the merge would."""
    if not options.device.startswith("cuda"):
        return None
    from ..runtime.device_memory import device_limit
    from .execution.device_transfer import PINNED_BYTES_PER_THREAD
    from .planning.device_memory import check_device_budget, device_estimate, staging_bytes

    limit = device_limit(options.device, options.max_gpu_memory) if options.executor != "ray" else None
    check_device_budget(plan.recipes, plan.compute_dtype, limit)
    est = device_estimate(plan.recipes, plan.compute_dtype, threads, limit)
    return {
        "device": options.device,
        "peak_memory_bytes": est.peak,
        "largest_tensor": {"name": est.largest_tensor, "working_bytes": est.largest_bytes},
        "budget_bytes": limit.limit if limit is not None else None,
        "budget": limit.describe() if limit is not None else None,
        "pinned_bytes": threads * staging_bytes(plan.recipes, plan.compute_dtype, PINNED_BYTES_PER_THREAD),
        "pcie_bytes_per_s": PCIE_BYTES_PER_S,
        "rates_assumed": True,  # not measured: no GPU was available when they were set (time_estimate.py)
        "to_device_bytes": int(timing.get("to_device_bytes", 0)),
        "to_host_bytes": int(timing.get("to_host_bytes", 0)),
        "transfer_seconds": timing.get("transfer", 0.0),
    }


def _gpu_lines(gpu: dict[str, Any], threads: int) -> list[str]:
    within = f", within {gpu['budget']}" if gpu.get("budget") else ""
    largest = gpu["largest_tensor"]
    return [
        f"GPU memory (estimate, {threads} threads) on {gpu['device']}: {human_size(gpu['peak_memory_bytes'])} at peak"
        f"{within}; largest: {largest['name']} ({human_size(largest['working_bytes'])}); pinned staging buffers "
        f"up to {human_size(gpu['pinned_bytes'])} on the host",
        f"GPU copies (estimate): {human_size(gpu['to_device_bytes'])} to the device, "
        f"{human_size(gpu['to_host_bytes'])} back, at an assumed {human_size(gpu['pcie_bytes_per_s'])}/s PCIe: "
        f"{gpu['transfer_seconds']:.1f} s, overlapped with the reads and writes",
    ]


def _over_budget_text(tensor: str, needed: int, budget: int) -> str:
    return (
        f"tensor {tensor} alone needs {human_size(needed)}, over the --max-memory budget of {human_size(budget)}; "
        "it will run by itself"
    )


def over_budget_warning(plan: Plan, max_memory: int | None) -> str | None:
    """The warning `plan` prints when the largest recipe's working set exceeds --max-memory (None when it fits),
    for `merge` to print at its start too (without the `warning: ` prefix, as plan warnings are kept)."""
    est = plan.estimate
    if not max_memory or est is None or est.largest_tensor_bytes <= max_memory:
        return None
    return _over_budget_text(est.largest_tensor, est.largest_tensor_bytes, max_memory)



def render_plan_text(report: dict[str, Any], show_tensors: bool = False) -> str:
    lines = [
        f"method: {report['method']}    output dtype: {report['out_dtype']}    "
        f"compute dtype: {report['compute_dtype']}",
        f"tensors: {len(report['tensors'])}    shards: {len(report['shards'])}",
    ]
    for i in report.get("inputs") or []:
        moe = f"MoE ({i['experts']} experts)" if i["moe"] and i["experts"] else "MoE" if i["moe"] else "dense"
        layers = f"{i['layers']} layers" if i["layers"] is not None else "no layer stack"
        lines.append(f"input {i['model']}: {i['architecture']}, {layers}, {moe}, quantization: {i['quantization']}")
    for s in report["shards"]:
        lines.append(f"  {s['file']}: {s['tensors']} tensors, {human_size(s['bytes'])}")
    for step in report.get("prepare") or []:
        lines.append(f"before merging ({step['step']}): {step.get('description', 'a data step')}")
    lines.append(f"read: {human_size(report['bytes_read'])}    write: {human_size(report['bytes_written'])}")
    lines.append(
        f"peak memory (estimate, {report['threads']} threads): {human_size(report['peak_memory_bytes'])}"
        f" (read-ahead buffers {human_size(report['read_ahead_bytes'])})"
    )
    largest = report["largest_tensor"]
    lines.append(f"largest working set: {largest['name']} ({human_size(largest['working_bytes'])})")
    if report["over_budget"]:
        o = report["over_budget"]
        lines.append("warning: " + _over_budget_text(o["tensor"], o["bytes"], o["budget"]))
    if report.get("gpu"):
        lines += _gpu_lines(report["gpu"], report["threads"])
    memory = report.get("memory")
    if memory:
        lines.append(f"memory this process may use now: {memory['description']}")
        if memory.get("warning"):
            lines.append(f"warning: {memory['warning']}")
    for warning in report.get("warnings") or []:
        lines.append(f"warning: {warning}")
    if report["disk"]:
        d = report["disk"]
        verdict = "not writable" if not d.get("writable", True) else "ok" if d["enough"] else "NOT ENOUGH"
        free, needed = human_size(d["free_bytes"]), human_size(d["needed_bytes"])
        lines.append(f"disk at {d['path']}: {free} free, {needed} needed ({verdict})")
    probe = f"throughput probe: read {human_size(report['read_throughput_bytes_per_s'])}/s, "
    if report["write_throughput_bytes_per_s"]:
        probe += f"write {human_size(report['write_throughput_bytes_per_s'])}/s"
    else:
        why = report.get("write_not_measured") or "not measured"
        probe += f"write speed not measured ({why}; the estimate assumes the read speed)"
    lines.append(probe)
    parts = report.get("estimated_seconds_parts")
    work = "GPU copies and compute" if parts and "transfer" in parts else "compute"
    detail = (
        f" (start-up {parts['startup']:.1f} s, then {work if parts['compute'] >= parts['io'] else 'I/O'} "
        f"{max(parts['compute'], parts['io']):.1f} s"
        + (f", first compile of its kernels {parts['first_compile']:.1f} s" if parts.get("first_compile") else "")
        + ")"
        if parts
        else ""
    )
    lines.append(f"estimated time: {report['estimated_seconds']:.1f} s{detail}")
    if report["random_seed"] is not None:
        lines.append(f"random seed: {report['random_seed']}")
    elif report.get("random_seed_drawn_at_merge"):
        lines.append(f"random seed: {SEED_DRAWN_TEXT}")
    if show_tensors:
        lines.append("")
        for t in report["tensors"]:
            dtype = "+".join(d for _n, d, _s in t["stored"]) if t.get("stored") else t["dtype"]
            line = f"{t['name']} {t['shape']} {dtype} {t['op']} <- " + ", ".join(
                f"{m}:{n}" for m, n in t["inputs"]
            )
            summary = _param_summary(t)
            lines.append(f"{line}  [{summary}]" if summary else line)
    return "\n".join(lines)


def _value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def _param_summary(t: dict[str, Any]) -> str:
    """`method k=v ... k=[per input]`: the method's parameters for this tensor, then each per-model
    parameter as a list in input order (`-` where an input has none)."""
    parts = [t["method"]] if t.get("method") else []
    parts += [f"{k}={_value(v)}" for k, v in t.get("params", {}).items()]
    per_model = t.get("model_params") or []
    keys: list[str] = []
    for p in per_model:
        keys += [k for k in p if k not in keys]
    for k in keys:
        parts.append(f"{k}=[" + ", ".join(_value(p[k]) if k in p else "-" for p in per_model) + "]")
    return " ".join(parts)
