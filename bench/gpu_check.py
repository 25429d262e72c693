"""The GPU check's measurements, within a deadline: bench models, the suite's CUDA tests, both tools' merges with
the I/O floor, tokensurgeon and extract-lora end to end, tokensurgeon's OMP; then one table (bench/gpu_table.py)
and its JSON.

Run by bench/gpu_check.sh (which makes the two venvs offline and checks that CUDA works) with mergesmith's venv
python; on its own, for example with this checkout's sources:

    PYTHONPATH=src python bench/gpu_check.py --mode cpu-dry-run --size tiny --minutes 2

Why a deadline rather than a fixed plan: the check must fit the minutes it is given on a machine whose speed is
not known beforehand (the 1b models take seconds to minutes to generate; mergekit's slowest case is several times
its fastest). Each step gets what is left after a reserve for the steps behind it, and a step that would not fit
is cut with a line saying so, rather than the whole check overrunning and reporting nothing:

- the CUDA tests run while the models are generated (they time nothing) and get a quarter of what is left after
  the reserves of OMP and the commands (at least 20 s, at most 120 s); pytest is stopped at the limit and the
  tests that finished are reported; the commands' checkpoints (bench/command_models.py) are built meanwhile too;
- a merge case runs when what is left, less those reserves, is at least 1.1x the longest case so far (the first
  case always runs); cases run in the order given, so the ones cut are the last;
- then the same machine's CPU path (mergesmith without --cuda) for --cpu-cases, each when 1.5x its --cuda time
  fits, for the line that says whether the GPU path is slower than the CPU path there (issue 33, item 4), then
  again with each of --cpu-threads workers, each when 1.5x the CPU path's time fits (how the CPU path's threads
  scale on a many-core machine);
- the commands (bench/device_commands.py: `mergesmith tokensurgeon` and `extract-lora` with the device option at
  `--commands-size`, outputs checked) run when what is left, less the OMP reserve, covers the size's expected
  time; their reserve is 1.25x that time (75 s at the realistic size); a command still running when the time is
  spent is stopped and reported as cut;
- OMP gets the rest (at most its reserve): mergesmith's run picks the largest batch of targets that fits, and
  mergekit's runs the same batch;
- the keyed Philox draws are timed on the device (bench/philox_torch.py, a few seconds), a note each;
- then, while time is left, `--sample` cases are merged again by mergesmith under bench/sample_stacks.py (where
  every thread spends its time, cache warm), each report written to WORK/sample-CASE.txt: what the next change
  to the GPU path needs to know, from a machine that is lent for minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib as bl
import compare_mergekit as cm
import gpu_table
from command_models import SIZES as COMMAND_SIZES
from make_models import DEFAULT_ROOT, SIZES, ensure_models

# the order cases are cut in, last first: linear (the floor's peer) and dare_ties (issue 33: within 1.2x of linear
# on the GPU) are the ones most worth having
DEFAULT_CASES = ("linear", "dare_ties", "ties", "della", "slerp")
OMP_RESERVE_S = 45.0
COMMANDS_RESERVE = 1.25  # the commands step's reserve: its size's expected seconds times this
# the CUDA tests: files that mention CUDA at all; bench/cuda_select.py keeps the device tests among their tests
CUDA_FILE = re.compile(r"cuda", re.IGNORECASE)


class Clock:
    """Seconds left before the deadline (an epoch time, so the shell's venv step counts against it too)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.time()


def device_name(mode: str) -> str:
    if mode == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return platform.processor() or "cpu"


# ------------------------------------------------------------------------------------------------ CUDA tests


def cuda_test_files(tests_dir: Path) -> list[Path]:
    return sorted(p for p in tests_dir.glob("test_*.py") if CUDA_FILE.search(p.read_text(errors="replace")))


def tally(lines: list[str]) -> dict[str, Any]:
    """Count bench/cuda_select.py's result lines: passed / failed / skipped / errors, and each failure's line."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []}
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("when") == "collect":
            counts["errors"] += 1
            counts["failures"].append(f"{rec['nodeid']} (collection): {rec.get('message', '')}")
            continue
        outcome = rec["outcome"]
        if outcome == "failed" and rec["when"] != "call":
            counts["errors"] += 1
        else:
            counts[outcome if outcome in counts else "failed"] += 1
        if outcome == "failed":
            counts["failures"].append(f"{rec['nodeid']}: {rec.get('message', '')}")
    return counts


class CudaTests:
    """The device tests of some files in one pytest, started in the background (they time nothing, so they run
    while the models are generated) and stopped, its whole process group, `limit_s` after the start."""

    def __init__(self, files: list[Path], limit_s: float, work: Path) -> None:
        self.limit_s = limit_s
        self.results = work / "cuda-tests.jsonl"
        self.results.unlink(missing_ok=True)
        self.log = work / "cuda-tests.log"  # a file, not a pipe: nobody reads while the models are made
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bl.BENCH_DIR), env.get("PYTHONPATH", "")]))
        env["GPU_CHECK_RESULTS"] = str(self.results)
        cmd = [sys.executable, "-m", "pytest", "-p", "cuda_select", "-p", "no:cacheprovider", "-q",
               *[str(f) for f in files]]
        bl.log(f"CUDA tests: {len(files)} files, at most {limit_s:.0f} s, in the background (log {self.log}) ...")
        self.started = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=bl.REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def finish(self) -> dict[str, Any]:
        """Wait for the rest of the time limit, stop pytest if it is still running, count what finished."""
        cut = False
        try:
            self.proc.wait(timeout=max(0.0, self.started + self.limit_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        counts = tally(self.results.read_text().splitlines() if self.results.exists() else [])
        counts["seconds"] = time.perf_counter() - self.started
        counts["cut"] = cut
        counts["exit_code"] = self.proc.returncode
        if not cut and self.proc.returncode not in (0, 1) and not counts["failures"]:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
            counts["errors"] += 1
            counts["failures"].append(f"pytest exited {self.proc.returncode}: {' '.join(tail)[:200]}")
        return counts


# ------------------------------------------------------------------------------------------------ merges


def tool_summary(s: bl.Summary) -> dict[str, Any]:
    return run_summary(s.runs[-1])


def run_summary(run: bl.RunResult) -> dict[str, Any]:
    return {"total_s": run.total_s, "wall_s": run.wall_s, "cpu_s": run.cpu_s, "maxrss": run.maxrss,
            "peak_anon": run.peak_anon}


def case_summary(r: cm.CaseResult) -> dict[str, Any]:
    ms, mk = r.tools.get("mergesmith"), r.tools.get("mergekit")
    return {"case": r.case, "floor_s": r.floor.total_s, "verdict": r.diff.verdict() if r.diff else None,
            "mergesmith": tool_summary(ms) if ms and ms.runs else None,
            "mergekit": tool_summary(mk) if mk and mk.runs else None, "cut": None}


def run_merges(args: argparse.Namespace, clock: Clock, models: list[Path], cold: bool,
               cut: list[str]) -> list[dict[str, Any]]:
    """Each case once per tool, alternating, through compare_mergekit's Runner (its floor, its output check)."""
    argv = ["--size", args.size, "--runs", "1", "--floor-runs", "1", "--out-root", str(args.work / "out")]
    if args.mode == "cuda":
        argv.append("--cuda")
    if args.mergekit_python is not None:
        argv += ["--mergekit-yaml", str(Path(args.mergekit_python).parent / "mergekit-yaml")]
    cm_args = cm.build_parser().parse_args(argv)
    runner = cm.Runner(cm_args, cm.Tools(cm_args), cold)
    available = set(bl.mergesmith_methods())
    cases: list[dict[str, Any]] = []
    longest = 0.0
    for case in args.cases:
        entry: dict[str, Any] = {"case": case, "mergesmith": None, "mergekit": None, "cut": None}
        left = left_before_commands(args, clock)
        if case not in available:
            entry["cut"] = "mergesmith has no such method in this checkout"
        elif cases and left < 1.1 * longest:
            entry["cut"] = f"out of time ({max(left, 0):.0f} s left, the longest case took {longest:.0f} s)"
            cut.append(f"{case}: {entry['cut']}")
        else:
            started = time.perf_counter()
            try:
                entry = case_summary(runner.run_case(args.size, case, models, 1))
            except (RuntimeError, OSError) as exc:  # one tool failed: the case's row says so, the check goes on
                entry["cut"] = "failed: " + (str(exc).strip().splitlines() or ["?"])[-1][:200]
            longest = max(longest, time.perf_counter() - started)
        cases.append(entry)
    return cases


def run_cpu_path(args: argparse.Namespace, clock: Clock, cases: list[dict[str, Any]], cold: bool,
                 cut: list[str]) -> None:
    """The same machine's CPU path for --cpu-cases (mergesmith without --cuda, one cold run each), into each case's
    "cpu_path": issue 33 asks that the GPU path is never slower than the CPU path on the same machine, and only
    the same machine, disk and start-up answer that (a CPU figure from another machine does not).

    Then, time allowing, the same case with each of --cpu-threads worker counts, into "cpu_path_threads": the CPU
    path's default is a worker a core, and its workers are Python threads that hand the GIL to each other after
    every compiled loop (~3,700 times a second each on the 2-core VM's dare_ties merge, bench/README.md, issue 33's
    sixth session). The H200 host's CPU path (16 workers, second session) took 4.92x its floor for dare_ties where
    the 2-core VM then took ~2x; whether fewer workers do better there is what these runs say."""
    if args.mode != "cuda":
        return
    for entry in cases:
        if entry["case"] not in args.cpu_cases or entry.get("mergesmith") is None:
            continue
        config = args.work / "out" / "configs" / f"{args.size}-{entry['case']}.yml"
        run = _cpu_path_run(args, clock, entry["case"], config, 1.5 * entry["mergesmith"]["total_s"], (), cold, cut)
        if run is None:
            continue
        entry["cpu_path"] = run
        for threads in args.cpu_threads:
            extra = ("--threads", str(threads))
            more = _cpu_path_run(args, clock, entry["case"], config, 1.5 * run["total_s"], extra, cold, cut)
            if more is not None:
                entry.setdefault("cpu_path_threads", {})[str(threads)] = more


def _cpu_path_run(args: argparse.Namespace, clock: Clock, case: str, config: Path, expected: float,
                  extra: Sequence[str], cold: bool, cut: list[str]) -> dict[str, Any] | None:
    """One cold CPU-path merge of `case` (with `extra` options) when `expected` seconds fit before the commands'
    and OMP's reserves; its summary, or None with a cut line."""
    what = f"{case} on the CPU path{' ' + ' '.join(extra) if extra else ''}"
    left = left_before_commands(args, clock)
    if left < expected:
        cut.append(f"{what}: out of time ({max(left, 0):.0f} s left, ~{expected:.0f} s)")
        return None
    out = args.work / "out" / f"cpu-path-{case}"
    bl.rm_out(out)
    bl.log(f"[{args.size} {case}] the CPU path (no --cuda{', ' + ' '.join(extra) if extra else ''}) ...")
    try:
        run = bl.run_timed(bl.mergesmith_cmd(config, out, "5B", extra), cold=cold, out_dir=out, timeout=2 * expected)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        cut.append(f"{what}: failed: {str(exc).strip()[-200:]}")
        return None
    finally:
        bl.rm_out(out)
    return run_summary(run)


# ------------------------------------------------------------------------------------------------ OMP


def run_omp_tool(python: str, impl: str, args: argparse.Namespace, timeout_s: float,
                 extra: list[str]) -> dict[str, Any]:
    out = args.work / f"omp-{impl}.pt"
    cmd = [python, str(bl.BENCH_DIR / "omp_device.py"), "--impl", impl, "--device",
           "cuda" if args.mode == "cuda" else "cpu", "--shared", str(args.omp_shared), "--hidden",
           str(args.omp_hidden), "--k", str(args.omp_k), "--full", str(args.omp_full), "--out", str(out), *extra]
    bl.log(f"OMP {impl}: {' '.join(cmd[2:])} (at most {timeout_s:.0f} s) ...")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["?"])[-1][:200])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "file": str(out)}


def same_selections(a: str, b: str) -> float:
    import torch

    ia, ib = torch.load(a)["indices"], torch.load(b)["indices"]
    return (ia == ib).all(dim=1).float().mean().item()


def run_omp(args: argparse.Namespace, clock: Clock, cut: list[str]) -> dict[str, Any]:
    omp: dict[str, Any] = {"mergesmith": None, "mergekit": None, "same_selections": None, "cut": None}
    left = clock.left()
    if left < 10:
        omp["cut"] = f"out of time ({max(left, 0):.0f} s left)"
        cut.append(f"omp: {omp['cut']}")
        return omp
    tools = 2 if args.mergekit_python else 1
    share = left / tools  # each tool's process: start-up, inputs, warm-up and the batch
    budget = max(1.0, 0.4 * share - 5)
    try:
        omp["mergesmith"] = run_omp_tool(sys.executable, "mergesmith", args, share,
                                         ["--targets", str(args.omp_targets), "--budget-s", f"{budget:.1f}"])
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        omp["cut"] = f"mergesmith failed: {exc}"
        cut.append(f"omp: {omp['cut']}")
        return omp
    batch = omp["mergesmith"]["targets"]
    if batch < args.omp_targets:
        cut.append(f"omp: {batch} of {args.omp_targets} targets timed, to fit the time")
    if args.mergekit_python:
        try:
            omp["mergekit"] = run_omp_tool(args.mergekit_python, "mergekit", args, max(1.0, clock.left()),
                                           ["--targets", str(batch)])
            omp["same_selections"] = same_selections(omp["mergesmith"]["file"], omp["mergekit"]["file"])
        except subprocess.TimeoutExpired:
            omp["cut"] = "out of time"
            cut.append("omp: mergekit's run was stopped at the deadline")
        except (RuntimeError, ValueError) as exc:
            omp["cut"] = f"failed: {exc}"
    return omp


# ------------------------------------------------------------------------------------------------ commands


def left_before_commands(args: argparse.Namespace, clock: Clock) -> float:
    """Seconds the steps before the commands and OMP may use: what is left less both reserves."""
    return clock.left() - OMP_RESERVE_S - commands_reserve(args)


def commands_reserve(args: argparse.Namespace) -> float:
    """Seconds kept for the commands step by the steps before it (0 without the step)."""
    if args.commands_size == "none":
        return 0.0
    return COMMANDS_RESERVE * COMMAND_SIZES[args.commands_size].expected_s


def _commands_cmd(args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, str(bl.BENCH_DIR / "device_commands.py"), "--size", args.commands_size, "--work",
            str(args.work / "commands"), *extra]


def start_command_models(args: argparse.Namespace) -> subprocess.Popen | None:
    """The commands' checkpoints built in the background (cached: instant when present), while the bench models
    are generated and the CUDA tests run; the step then finds them made."""
    if args.commands_size == "none":
        return None
    log = args.work / "commands-build.log"
    with open(log, "wb") as out:
        return subprocess.Popen(_commands_cmd(args, "--build-only"), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_commands(args: argparse.Namespace, clock: Clock, cold: bool, cut: list[str]) -> dict[str, Any] | None:
    """bench/device_commands.py with the device option, within what is left less the OMP reserve; its JSON, or
    {"cut": why} when the step did not run or gave no result."""
    if args.commands_size == "none":
        return None
    budget = clock.left() - OMP_RESERVE_S
    need = COMMAND_SIZES[args.commands_size].expected_s
    if budget < need:
        why = f"out of time ({max(budget, 0):.0f} s left, the {args.commands_size} size needs about {need:.0f} s)"
        cut.append(f"commands: {why}")
        return {"cut": why}
    out = args.work / "commands.json"
    out.unlink(missing_ok=True)
    cmd = _commands_cmd(args, "--device", "cuda" if args.mode == "cuda" else "cpu", "--budget-s", f"{budget:.0f}",
                        "--json", str(out), *(["--cold"] if cold else []),
                        *(["--also-cpu"] if args.commands_also_cpu else []), *args.commands_args)
    bl.log(f"commands: {' '.join(cmd[2:])} ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget + 30)
    except subprocess.TimeoutExpired:
        cut.append("commands: stopped at the deadline")
        return {"cut": "stopped at the deadline"}
    if not out.exists():  # it crashed before writing its result
        why = f"failed: {(proc.stderr.strip().splitlines() or ['exit code ' + str(proc.returncode)])[-1][:200]}"
        cut.append(f"commands: {why}")
        return {"cut": why}
    commands = json.loads(out.read_text())
    cut += [f"{r['command']} --device {r['device']}: {r['cut']}" for r in commands["runs"] if r.get("cut")]
    return commands


# ------------------------------------------------------------------------------------------------ keyed draws


def run_philox(args: argparse.Namespace, clock: Clock, cut: list[str]) -> list[str]:
    """bench/philox_torch.py on the device (1M draws): what a DARE/DELLA mask costs there against the CPU's compiled
    generator, the figure that decides where the GPU path should draw them. A note per timed generator."""
    if clock.left() < OMP_RESERVE_S + commands_reserve(args) + 30:
        cut.append(f"philox: out of time ({max(clock.left(), 0):.0f} s left)")
        return []
    device = "cuda" if args.mode == "cuda" else "cpu"
    cmd = [sys.executable, str(bl.BENCH_DIR / "philox_torch.py"), "--draws", str(1 << 20), "--reps", "3",
           "--device", device]
    bl.log(f"philox: {' '.join(cmd[2:])} ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
        cut.append(f"philox: {type(exc).__name__}")
        return []
    return [f"keyed draws ({device}): {line.strip()}" for line in proc.stdout.splitlines() if "ns/draw" in line]


# ------------------------------------------------------------------------------------------------ stack samples


def run_samples(args: argparse.Namespace, clock: Clock, cases: list[dict[str, Any]], cut: list[str]) -> list[str]:
    """Each --sample case merged once more by mergesmith under sample_stacks.py, while 1.5x its merge time is left;
    the notes naming the reports."""
    timed = {c["case"]: (c.get("mergesmith") or {}).get("total_s") for c in cases}
    notes = []
    for case in args.sample:
        if case not in args.cases:  # not asked for in this check
            continue
        config = args.work / "out" / "configs" / f"{args.size}-{case}.yml"
        took = timed.get(case)
        if took is None or not config.exists():
            cut.append(f"sample {case}: the case was not merged")
            continue
        if clock.left() < 1.5 * took + 5:
            cut.append(f"sample {case}: out of time ({max(clock.left(), 0):.0f} s left, the merge took {took:.0f} s)")
            continue
        report = args.work / f"sample-{case}.txt"
        merge = bl.mergesmith_cmd(config, args.work / "out" / f"sample-{case}", "5B")
        cmd = [sys.executable, str(bl.BENCH_DIR / "sample_stacks.py"), "--top", "45", "--out", str(report), "-m",
               "mergesmith.cli", *merge[merge.index("merge"):], "--overwrite",
               *(["--cuda"] if args.mode == "cuda" else [])]
        bl.log(f"sample {case}: {' '.join(cmd[2:])} ...")
        try:
            subprocess.run(cmd, capture_output=True, timeout=max(1.0, clock.left()), check=True)
            notes.append(f"stack sample of {case}: {report}")
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
            cut.append(f"sample {case}: {type(exc).__name__}")
    return notes


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["cuda", "cpu-dry-run"], default="cuda")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds to finish by (default: --minutes)")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), type=lambda s: [c for c in s.split(",") if c])
    ap.add_argument("--mergekit-python", default=None, help="mergekit's venv python (none: mergesmith alone)")
    ap.add_argument("--models-root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/mergesmith/gpu-check")
    ap.add_argument("--test-files", default=None,
                    help="comma-separated test files (default: every tests/test_*.py that mentions CUDA); '' for none")
    ap.add_argument("--omp-shared", type=int, default=50_000)
    ap.add_argument("--omp-hidden", type=int, default=4096)
    ap.add_argument("--omp-k", type=int, default=64)
    ap.add_argument("--omp-targets", type=int, default=2048)
    ap.add_argument("--omp-full", type=int, default=50_000)
    ap.add_argument("--json", type=Path, default=None, help="write the result here (default WORK/gpu_check.json)")
    ap.add_argument("--header", action="append", default=[], help="a note for the table (repeatable)")
    ap.add_argument("--commands-size", choices=[*sorted(COMMAND_SIZES), "none"], default="realistic",
                    help="bench/device_commands.py's size ('none': no commands step)")
    ap.add_argument("--commands-also-cpu", action="store_true",
                    help="the commands with --device cpu too, in the step's time (the realistic transplant's CPU "
                         "run does not fit five minutes: it is stopped and reported as cut)")
    ap.add_argument("--commands-args", default="", type=shlex.split,
                    help="more bench/device_commands.py options, e.g. '--k 32' or '--commands extract-lora'")
    ap.add_argument("--cpu-cases", default="linear,dare_ties", type=lambda s: [c for c in s.split(",") if c],
                    help="cases also merged on the CPU path of the same machine, for the cuda/cpu line (default "
                         "linear,dare_ties; '' for none)")
    ap.add_argument("--cpu-threads", default="4", type=lambda s: [int(c) for c in s.split(",") if c],
                    help="worker counts the --cpu-cases also run with on the CPU path, after its default of one a "
                         "core, time allowing (default 4; '' for none)")
    ap.add_argument("--sample", default="dare_ties", type=lambda s: [c for c in s.split(",") if c],
                    help="cases merged again under bench/sample_stacks.py at the end, time allowing ('' for none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.time()
    clock = Clock(args.deadline if args.deadline is not None else started + 60 * args.minutes)
    minutes = args.minutes  # with --deadline, the shell's minutes: the check began 60 * minutes before it
    origin = clock.deadline - 60 * minutes
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    cold = args.mode == "cuda" and bl.can_drop_caches()
    result: dict[str, Any] = {"mode": args.mode, "device": device_name(args.mode), "torch": torch.__version__,
                              "size": args.size, "minutes": minutes, "cold": cold, "tests": None, "cases": [],
                              "omp": None, "commands": None, "cut": [], "notes": list(args.header)}
    if args.mergekit_python is None:
        result["notes"].append("mergekit not run (no mergekit wheels): mergesmith figures only")
    if args.test_files is None:
        files = cuda_test_files(bl.REPO / "tests")
    else:
        files = [bl.REPO / f for f in args.test_files.split(",") if f]
    tests = None
    if files:
        tests = CudaTests(files, min(120.0, max(20.0, 0.25 * left_before_commands(args, clock))), args.work)
    prebuild = start_command_models(args)
    t0 = time.perf_counter()
    bl.log(f"models: {args.size} under {args.models_root} ...")
    try:
        models = ensure_models(args.size, args.models_root)
    except BaseException:
        for proc in (tests.proc if tests is not None else None, prebuild):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):  # it may have ended already
                    os.killpg(proc.pid, signal.SIGKILL)
        raise
    result["models_s"] = time.perf_counter() - t0
    if tests is not None:
        result["tests"] = tests.finish()
        if result["tests"]["cut"]:
            result["cut"].append(f"CUDA tests: stopped after {tests.limit_s:.0f} s")
    if prebuild is not None:  # before any timing: the build would share the machine with the merges
        try:
            prebuild.wait(timeout=max(1.0, clock.left()))
        except subprocess.TimeoutExpired:  # no time left for anything: the step will say so
            os.killpg(prebuild.pid, signal.SIGKILL)
            prebuild.wait()

    result["cases"] = run_merges(args, clock, models, cold, result["cut"])
    run_cpu_path(args, clock, result["cases"], cold, result["cut"])
    result["notes"] += run_philox(args, clock, result["cut"])
    result["commands"] = run_commands(args, clock, cold, result["cut"])
    result["omp"] = run_omp(args, clock, result["cut"])
    result["notes"] += run_samples(args, clock, result["cases"], result["cut"])
    result["elapsed_s"] = time.time() - origin
    if clock.left() < 0:
        result["notes"].append(f"overran the deadline by {-clock.left():.0f} s")
    print(gpu_table.render(result), end="")
    path = args.json or args.work / "gpu_check.json"
    path.write_text(gpu_table.to_json(result))
    bl.log(f"JSON: {path}")
    counts = result["tests"] or {}
    bad = counts.get("failed", 0) or counts.get("errors", 0) or any(
        (c.get("verdict") or "").startswith("DIFFERENT") or (c.get("cut") or "").startswith("failed")
        for c in result["cases"]) or gpu_table.commands_failed(result["commands"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
