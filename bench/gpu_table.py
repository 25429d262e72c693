"""The GPU check's one table and its JSON (bench/gpu_check.py measures; this only formats, so it is unit-tested).

The result is a plain dict (what the JSON file holds), built by gpu_check.py:

    {"mode": "cuda" | "cpu-dry-run", "device": str, "torch": str, "size": "1b", "minutes": 5.0, "elapsed_s": float,
     "tests": {"passed": int, "failed": int, "skipped": int, "errors": int, "failures": [nodeid: message, ...],
               "seconds": float, "cut": bool} | None,
     "cases": [{"case": "linear", "floor_s": float | None, "verdict": str | None, "cut": str | None,
                "mergesmith": {"total_s", "cpu_s", "maxrss"} | None, "mergekit": {...} | None,
                "cpu_path": {"total_s", "cpu_s", "maxrss"} (the same machine without --cuda; optional),
                "cpu_path_threads": {"4": {"total_s", "cpu_s", "maxrss"}, ...} (the same with --threads N; optional)}],
     "omp": {"mergesmith": {omp_device.py's JSON}, "mergekit": {...} | None, "same_selections": float | None,
             "cut": str | None} | None,
     "commands": {bench/device_commands.py's JSON: "size", "spec", "device", "build_s", "runs": [{"command",
                  "device", "total_s", "cpu_s", "maxrss", "check": {"ok", "summary"} | None, "error", "cut"}]}
                 | {"cut": str} | None,
     "cut": [what was left out to keep to the minutes], "notes": [str]}

Why one table with the OMP and command rows in it: the check's output is pasted into an issue or a README as it
is; a reader compares each row's two tools, and every row that was cut says so in its own "outputs equal" cell.
"""

from __future__ import annotations

import json
import math
from typing import Any

from benchlib import fmt_bytes, fmt_ratio, fmt_s, table

Result = dict[str, Any]


def headers(mode: str) -> list[str]:
    flag = " --cuda" if mode == "cuda" else " (cpu)"
    return ["case", f"mergesmith{flag} s", f"mergekit{flag} s", "ratio", "floor s", "x floor", "CPU s ms/mk",
            "peak RSS ms/mk", "outputs equal"]


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _pair(ms: Any, mk: Any, fmt) -> str:
    return f"{fmt(_num(ms))} / {fmt(_num(mk))}" if mk is not None else fmt(_num(ms))


def _ratio(a: float, b: float) -> str:
    return fmt_ratio(a / b) if b and not math.isnan(a) and not math.isnan(b) else "-"


def case_row(case: Result) -> list[str]:
    """One merge case: both tools' wall+sync seconds, their ratio, the I/O floor, CPU seconds, peak RSS, verdict."""
    ms, mk = case.get("mergesmith"), case.get("mergekit")
    if ms is None:
        return [case["case"], "-", "-", "-", "-", "-", "-", "-", f"not run: {case.get('cut') or 'no result'}"]
    ms_t = _num(ms["total_s"])
    mk_t = _num(mk["total_s"]) if mk else float("nan")
    floor = _num(case.get("floor_s"))
    verdict = case.get("verdict") or ("mergekit not run" if mk is None else "not compared")
    return [
        case["case"],
        fmt_s(ms_t),
        fmt_s(mk_t),
        _ratio(ms_t, mk_t),
        fmt_s(floor),
        _ratio(ms_t, floor),
        _pair(ms.get("cpu_s"), mk.get("cpu_s") if mk else None, fmt_s),
        _pair(ms.get("maxrss"), mk.get("maxrss") if mk else None, fmt_bytes),
        verdict,
    ]


def omp_label(run: Result) -> str:
    return f"omp N={run['shared']} D={run['hidden']} k={run['k']} B={run['targets']}"


def omp_row(omp: Result) -> list[str]:
    """Tokensurgeon's batched OMP: the timed batch's seconds for each tool; the check compares their selections."""
    ms, mk = omp.get("mergesmith"), omp.get("mergekit")
    if ms is None:
        return ["omp", "-", "-", "-", "-", "-", "-", "-", f"not run: {omp.get('cut') or 'no result'}"]
    mk_s = _num(mk["seconds"]) if mk else float("nan")
    if mk is None:
        verdict = f"mergekit not run{': ' + omp['cut'] if omp.get('cut') else ''}"
    else:
        same = omp.get("same_selections")
        share = "-" if same is None else f"{100 * same:.0f}%"
        verdict = f"same selections {share}, residual {ms['residual']:.4g} / {mk['residual']:.4g}"
    return [omp_label(ms), f"{ms['seconds']:.2f}", "-" if mk is None else f"{mk_s:.2f}",
            _ratio(ms["seconds"], mk_s), "-", "-", "-", "-", verdict]


def commands_label(commands: Result) -> str:
    """What the commands step ran on: the transplant's vocabularies, the width, the LoRA rank, the device."""
    spec = commands["spec"]
    return (f"tokensurgeon {spec['base_vocab']}->{spec['donor_vocab']} tokens ({spec['donor_vocab'] - spec['shared']} "
            f"new, k={spec['k']}) and extract-lora (r={spec['lora_rank']}) at hidden {spec['hidden']}, "
            f"{spec['layers']} layer(s), size {commands['size']}, --device {commands['device']}")


def command_verdict(run: Result) -> str:
    """A run's last cell: not run (cut), failed (the command's error line), FAILED check, or ok (the check)."""
    if run.get("cut"):
        return f"not run: {run['cut']}"
    if run.get("error"):
        return f"failed: {run['error']}"
    check = run.get("check") or {}
    if not check:
        return "not checked"
    return f"{'ok' if check.get('ok') else 'FAILED check'}: {check.get('summary', '')}"


def command_rows(commands: Result) -> list[list[str]]:
    """The commands step's device runs as rows of the one table (mergekit's columns and the floor stay empty)."""
    if commands.get("runs") is None:
        return [["commands", "-", "-", "-", "-", "-", "-", "-", f"not run: {commands.get('cut') or 'no result'}"]]
    spec = commands["spec"]
    labels = {"tokensurgeon": f"tokensurgeon {spec['base_vocab']}->{spec['donor_vocab']} D={spec['hidden']}",
              "extract-lora": f"extract-lora D={spec['hidden']} r={spec['lora_rank']}"}
    rows = []
    for run in commands["runs"]:
        if run["device"] != commands["device"]:
            continue
        rows.append([labels.get(run["command"], run["command"]), fmt_s(_num(run.get("total_s"))), "-", "-", "-", "-",
                     fmt_s(_num(run.get("cpu_s"))), fmt_bytes(_num(run.get("maxrss"))), command_verdict(run)])
    return rows


def commands_cpu_line(commands: Result) -> str | None:
    """The --also-cpu runs, each against the device's time for the same command."""
    device = {r["command"]: r for r in commands.get("runs") or [] if r["device"] == commands.get("device")}
    parts = []
    for run in commands.get("runs") or []:
        if run["device"] != "cpu" or commands.get("device") == "cpu":
            continue
        if run.get("total_s") is None:
            parts.append(f"{run['command']} {command_verdict(run)}")
            continue
        there = _num((device.get(run["command"]) or {}).get("total_s"))
        parts.append(f"{run['command']} {run['total_s']:.1f} s ({_ratio(run['total_s'], there)} the device's)"
                     + ("" if run_passed(run) else f", {command_verdict(run)}"))
    return f"commands with --device cpu (--also-cpu): {', '.join(parts)}" if parts else None


def run_passed(run: Result) -> bool:
    """False for a run that failed or whose output failed its check; a cut run is not a failure."""
    return not run.get("error") and (run.get("check") or {}).get("ok", True)


def commands_failed(commands: Result | None) -> bool:
    """Whether the step makes the check fail: a command failed or its output is wrong."""
    if not commands:
        return False
    if str(commands.get("cut") or "").startswith("failed"):
        return True
    return not all(run_passed(r) for r in commands.get("runs") or [])


def tests_line(tests: Result | None) -> str:
    if tests is None:
        return "CUDA tests: not run"
    parts = [f"{tests.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped")]
    line = f"CUDA tests: {', '.join(parts)} in {tests.get('seconds', 0):.0f} s"
    if tests.get("cut"):
        line += " (stopped at the time limit: the rest did not run)"
    for failure in tests.get("failures", []):
        line += f"\n  FAILED {failure}"
    return line


def cpu_path_lines(cases: list[Result]) -> list[str]:
    """The GPU path against the same machine's CPU path, per case that ran both (issue 33: never slower)."""
    lines = []
    for case in cases:
        cpu, gpu = case.get("cpu_path"), case.get("mergesmith")
        if cpu is None or gpu is None:
            continue
        ratio = _num(gpu["total_s"]) / _num(cpu["total_s"])
        verdict = "slower than" if ratio > 1.0 else "at least as fast as"
        line = (f"{case['case']}: --cuda {fmt_s(_num(gpu['total_s']))} s, this machine's CPU path "
                f"{fmt_s(_num(cpu['total_s']))} s ({fmt_ratio(ratio)}: the GPU path {verdict} the CPU path)")
        threads = case.get("cpu_path_threads") or {}
        if threads:
            line += "; the CPU path with " + ", ".join(
                f"--threads {count}: {fmt_s(_num(run['total_s']))} s ({_num(run['cpu_s']):.0f} CPU-s)"
                for count, run in sorted(threads.items(), key=lambda item: int(item[0]))
            ) + f", with its default: {_num(cpu['cpu_s']):.0f} CPU-s"
        lines.append(line)
    return lines


def render(result: Result) -> str:
    """The text the check prints: a header, the test summary, then the one table, then what was cut."""
    mode = result["mode"]
    head = (f"bench/gpu_check: {mode} on {result.get('device', '?')}, torch {result.get('torch', '?')}, "
            f"{result.get('size', '?')} bench models, {result.get('elapsed_s', 0):.0f} s of "
            f"{60 * result.get('minutes', 0):.0f} s; times are one run each, wall+sync, cache "
            f"{'dropped' if result.get('cold') else 'warm'}")
    lines = [head, tests_line(result.get("tests"))]
    lines += ["", table(headers(mode), all_rows(result)), ""]
    omp = result.get("omp") or {}
    if omp.get("mergesmith"):
        full = " / ".join(f"{t} {omp[t]['full_s']:.0f} s" for t in ("mergesmith", "mergekit") if omp.get(t))
        lines.append(f"omp extrapolated to the whole transplant ({omp['mergesmith']['full']} new tokens): {full}")
    commands = result.get("commands") or {}
    if commands.get("runs") is not None:
        lines.append(f"commands: {commands_label(commands)}; models built or found in {commands['build_s']:.0f} s")
        cpu = commands_cpu_line(commands)
        if cpu:
            lines.append(cpu)
    lines += cpu_path_lines(result.get("cases", []))
    lines += [f"cut: {c}" for c in result.get("cut", [])]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines).rstrip() + "\n"


def all_rows(result: Result) -> list[list[str]]:
    """The table's rows: the merge cases, then OMP, then the commands."""
    rows = [case_row(c) for c in result.get("cases", [])]
    if result.get("omp") is not None:
        rows.append(omp_row(result["omp"]))
    if result.get("commands") is not None:
        rows += command_rows(result["commands"])
    return rows


def to_json(result: Result) -> str:
    """The result as JSON, with the printed table's rows beside the raw figures (NaN written as null)."""
    out = {**result, "table": {"headers": headers(result["mode"]), "rows": all_rows(result)}}
    return json.dumps(clean(out), indent=1, allow_nan=False) + "\n"


def clean(x: Any) -> Any:
    """`x` with every NaN or infinity as None, so strict JSON can hold it."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x
