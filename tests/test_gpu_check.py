"""bench/gpu_check.sh (issue 33, item 6) on a machine without a GPU: its table and JSON, its refusals, its plumbing.

The check itself is a measurement for a CUDA machine with no network. What can rot without one is tested here:
the table and JSON formatting (bench/gpu_table.py) on a made-up result, the counting of the CUDA tests' results,
OMP's batch sizing, the one-line refusals of both scripts (a bad argument, no CUDA), and, marked slow, the whole
pipeline in `--cpu-dry-run` mode: a mergesmith wheel built from this checkout, a venv made offline from it on this
interpreter's torch, tiny bench models, one CUDA test file (skipped here), a linear merge with its floor, the
OMP timing and the commands step at its quick size, down to the printed table and the JSON file. (The commands
step's own tests, at the tiny size: tests/test_gpu_check_commands.py.)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers import bench_module

ROOT = Path(__file__).resolve().parents[1]


def _result() -> dict:
    """A made-up CUDA result: one merge case with both tools, one cut, one where mergekit failed, and OMP."""
    ms = {"total_s": 15.0, "wall_s": 14.9, "cpu_s": 20.0, "maxrss": 1.08e9, "peak_anon": 5e8}
    mk = {"total_s": 30.0, "wall_s": 29.9, "cpu_s": 25.0, "maxrss": 6.69e9, "peak_anon": 6e9}
    omp_ms = {"shared": 50000, "hidden": 4096, "k": 64, "targets": 2048, "full": 50000, "seconds": 1.5,
              "full_s": 36.6, "residual": 12.3456, "peak_device_bytes": 0}
    return {
        "mode": "cuda", "device": "NVIDIA H100", "torch": "2.13.0+cu128", "size": "1b", "minutes": 5.0,
        "elapsed_s": 290.0, "cold": True,
        "tests": {"passed": 27, "failed": 1, "skipped": 0, "errors": 0, "seconds": 40.0, "cut": False,
                  "failures": ["tests/test_methods_math.py::test_methods_run_on_cuda[arcee_fusion]: assert"]},
        "cases": [
            {"case": "linear", "floor_s": 10.0, "verdict": "bit-equal", "mergesmith": ms, "mergekit": mk, "cut": None},
            {"case": "della", "mergesmith": None, "mergekit": None, "cut": "out of time (20 s left)"},
            {"case": "slerp", "floor_s": float("nan"), "verdict": None, "mergesmith": ms, "mergekit": None,
             "cut": None},
        ],
        "omp": {"mergesmith": omp_ms, "mergekit": {**omp_ms, "seconds": 3.0, "full_s": 73.2, "residual": 12.3},
                "same_selections": 0.995, "cut": None},
        "cut": ["della: out of time (20 s left)"], "notes": ["venvs ready after 30 s"],
    }


def test_the_table_has_one_row_per_case_and_omp_with_ratios_floor_and_cuts() -> None:
    table = bench_module("gpu_table")
    text = table.render(_result())
    lines = text.splitlines()
    assert lines[0].startswith("bench/gpu_check: cuda on NVIDIA H100, torch 2.13.0+cu128, 1b bench models, "
                               "290 s of 300 s")
    assert lines[1] == "CUDA tests: 27 passed, 1 failed, 0 errors, 0 skipped in 40 s"
    assert "FAILED tests/test_methods_math.py::test_methods_run_on_cuda[arcee_fusion]" in lines[2]
    header = next(line for line in lines if line.startswith("case"))
    for column in ("mergesmith --cuda s", "mergekit --cuda s", "ratio", "floor s", "x floor", "CPU s ms/mk",
                   "peak RSS ms/mk", "outputs equal"):
        assert column in header
    table_lines = lines[lines.index(header) + 2:]
    table_lines = table_lines[:table_lines.index("")]
    rows = {line.split()[0]: line for line in table_lines}
    assert list(rows) == ["linear", "della", "slerp", "omp"]
    assert rows["linear"].split()[1:6] == ["15.0", "30.0", "0.50x", "10.0", "1.50x"]
    assert "20.0 / 25.0" in rows["linear"] and "1.08 GB / 6.69 GB" in rows["linear"]
    assert rows["linear"].rstrip().endswith("bit-equal")
    assert rows["della"].rstrip().endswith("not run: out of time (20 s left)")
    assert rows["slerp"].split()[1:6] == ["15.0", "-", "-", "-", "-"]  # no mergekit, no floor: no ratios
    assert rows["slerp"].rstrip().endswith("mergekit not run")
    assert rows["omp"].startswith("omp N=50000 D=4096 k=64 B=2048")
    assert "1.50" in rows["omp"] and "3.00" in rows["omp"] and "0.50x" in rows["omp"]
    assert "same selections 100%, residual 12.35 / 12.3" in rows["omp"]  # 99.5% rounds to 100
    assert "omp extrapolated to the whole transplant (50000 new tokens): mergesmith 37 s / mergekit 73 s" in text
    assert "cut: della: out of time (20 s left)" in lines and "note: venvs ready after 30 s" in lines


def test_the_json_holds_the_figures_and_the_printed_rows_with_nan_as_null() -> None:
    table = bench_module("gpu_table")
    result = _result()
    data = json.loads(table.to_json(result))  # allow_nan=False inside: a NaN left in would raise
    assert data["cases"][2]["floor_s"] is None
    assert data["cases"][0]["mergesmith"]["total_s"] == 15.0
    assert data["table"]["headers"] == table.headers("cuda")
    assert [r[0] for r in data["table"]["rows"]] == ["linear", "della", "slerp", "omp N=50000 D=4096 k=64 B=2048"]
    assert data["table"]["rows"][0] == table.case_row(result["cases"][0])
    assert table.headers("cpu-dry-run")[1] == "mergesmith (cpu) s"


def test_omp_and_tests_rows_say_what_did_not_run() -> None:
    table = bench_module("gpu_table")
    assert table.omp_row({"mergesmith": None, "cut": "out of time (3 s left)"})[-1] == "not run: out of time (3 s left)"
    assert table.tests_line(None) == "CUDA tests: not run"
    cut = table.tests_line({"passed": 3, "seconds": 20.0, "cut": True})
    assert cut.endswith("(stopped at the time limit: the rest did not run)")


def test_test_results_are_counted_by_outcome_and_phase() -> None:
    check = bench_module("gpu_check")
    lines = [
        json.dumps({"nodeid": "t.py::a", "when": "call", "outcome": "passed"}),
        json.dumps({"nodeid": "t.py::b", "when": "setup", "outcome": "skipped"}),
        json.dumps({"nodeid": "t.py::c", "when": "call", "outcome": "failed", "message": "AssertionError: 0.107"}),
        json.dumps({"nodeid": "t.py::d", "when": "setup", "outcome": "failed", "message": "fixture"}),
        json.dumps({"nodeid": "u.py", "when": "collect", "outcome": "failed", "message": "No module named 'x'"}),
        "",
    ]
    counts = check.tally(lines)
    assert {k: counts[k] for k in ("passed", "failed", "skipped", "errors")} == {
        "passed": 1, "failed": 1, "skipped": 1, "errors": 2}
    assert counts["failures"] == ["t.py::c: AssertionError: 0.107", "t.py::d: fixture",
                                  "u.py (collection): No module named 'x'"]


def test_device_tests_are_selected_and_stopped_at_their_limit_with_what_finished_counted(tmp_path: Path) -> None:
    """bench/cuda_select.py keeps the device tests only; a pytest still running at the limit is killed, and the
    tests it finished are reported, not lost."""
    check = bench_module("gpu_check")
    (tmp_path / "test_fake.py").write_text(
        "import time\n\nimport pytest\n\n\n"
        "def test_on_cuda_quick():\n    pass\n\n\n"
        "def test_not_a_device_test():\n    raise AssertionError('must not run')\n\n\n"
        "@pytest.mark.skipif(False, reason='needs a CUDA device')\n"
        "def test_hangs():\n    time.sleep(120)\n"
    )
    run = check.CudaTests([tmp_path / "test_fake.py"], 8.0, tmp_path)
    counts = run.finish()
    assert counts["cut"] and counts["seconds"] < 30
    assert (counts["passed"], counts["failed"], counts["errors"]) == (1, 0, 0)
    assert run.proc.returncode != 0  # killed


def test_the_device_test_files_are_found_by_what_they_say() -> None:
    files = {p.name for p in bench_module("gpu_check").cuda_test_files(ROOT / "tests")}
    assert {"test_methods_math.py", "test_keyed_masks.py", "test_python_api.py"} <= files
    assert "test_layers.py" not in files


def test_omp_batch_fits_the_budget_in_whole_warmup_batches() -> None:
    omp = bench_module("omp_device")
    assert omp.targets_within(10.0, 0.1, 2048) == 2048  # 64 targets in 0.1 s: 6,400 fit, capped at 2,048
    assert omp.targets_within(1.0, 0.1, 2048) == 640
    assert omp.targets_within(0.01, 5.0, 2048) == 64  # never below the warm-up batch
    assert omp.targets_within(1.0, 0.0, 100) == 100


def test_compare_mergekit_passes_the_device_flag_to_both_tools(tmp_path: Path) -> None:
    """gpu_check.py runs its cases through compare_mergekit.py with `--cuda` and a mergekit venv made offline."""
    cm = bench_module("compare_mergekit")
    yaml_exe = tmp_path / "venv" / "bin" / "mergekit-yaml"
    args = cm.build_parser().parse_args(["--cuda", "--mergekit-yaml", str(yaml_exe), "--mergekit-args=--x"])
    tools = cm.Tools(args)  # a given mergekit-yaml: scripts/mergekit_venv.sh is not run
    assert tools.names == ["mergesmith", "mergekit"]
    ms = tools.command("mergesmith", "linear", tmp_path / "c.yml", tmp_path / "out")
    mk = tools.command("mergekit", "linear", tmp_path / "c.yml", tmp_path / "out")
    assert ms[-1] == "--cuda" and ms.count("--cuda") == 1
    assert mk[0] == str(yaml_exe) and mk[-2:] == ["--x", "--cuda"]
    plain = cm.Tools(cm.build_parser().parse_args([]))
    assert "--cuda" not in plain.command("mergesmith", "linear", tmp_path / "c.yml", tmp_path / "out")
    assert plain.names == ["mergesmith"]


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / script), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ""})


def test_both_scripts_refuse_bad_arguments_in_one_line(tmp_path: Path) -> None:
    for script, args, words in [
        ("bench/gpu_check.sh", [], "usage: bench/gpu_check.sh WHEELS_DIR"),
        ("bench/gpu_check.sh", [str(tmp_path / "missing")], "is not a directory"),
        ("bench/gpu_check.sh", [str(tmp_path), "--minutes", "five"], "--minutes must be a number"),
        ("bench/gpu_check.sh", [str(tmp_path), "--frobnicate"], "unknown option --frobnicate"),
        ("bench/gpu_check.sh", [str(tmp_path)], "no mergesmith-*.whl in"),
        ("scripts/gpu_wheels.sh", [], "usage: scripts/gpu_wheels.sh DIR"),
        ("scripts/gpu_wheels.sh", [str(tmp_path), "--python-version", "3"], "--python-version must look like"),
    ]:
        proc = _run(script, *args)
        assert proc.returncode == 2, (script, args, proc.stderr)
        assert proc.stderr.count("error:") == 1 and words in proc.stderr, (script, args, proc.stderr)


def test_the_check_refuses_in_one_line_without_a_device(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen")
    (tmp_path / "mergesmith-0.1.0-py3-none-any.whl").write_bytes(b"")  # the refusal comes before any install
    proc = _run("bench/gpu_check.sh", str(tmp_path), "--python", sys.executable, "--work", str(tmp_path / "w"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "torch.cuda.is_available() is False" in proc.stderr and "--cpu-dry-run" in proc.stderr
    assert not (tmp_path / "w" / "venv-mergesmith").exists()


def _mergesmith_wheel(folder: Path, tmp: Path) -> Path:
    """This checkout's wheel, built from a copy (no build/ or egg-info left in the repository)."""
    src = tmp / "pkg"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(folder), str(src)], check=True, timeout=300)
    return next(folder.glob("mergesmith-*.whl"))


@pytest.mark.slow
def test_cpu_dry_run_goes_from_a_wheel_folder_to_the_table_and_json(tmp_path: Path) -> None:
    """The whole pipeline without a GPU or a network (about 40 s on two cores): offline venv, models, tests,
    one merge with its floor, OMP, table, JSON."""
    wheels = tmp_path / "wheels"
    _mergesmith_wheel(wheels, tmp_path)
    out = tmp_path / "check.json"
    proc = _run("bench/gpu_check.sh", str(wheels), "--cpu-dry-run", "--python", sys.executable, "--work",
                str(tmp_path / "work"), "--minutes", "4", "--json", str(out), "--",
                "--models-root", str(tmp_path / "models"), "--cases", "linear", "--commands-size", "tiny",
                "--test-files", "tests/test_magnitude_blocks.py", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    venv_python = tmp_path / "work" / "venv-mergesmith" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import mergesmith; print(mergesmith.__file__)"],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""})
    assert where.stdout.startswith(str(tmp_path / "work" / "venv-mergesmith"))  # the wheel, not a source tree
    text = proc.stdout
    assert text.startswith("bench/gpu_check: cpu-dry-run on ")
    assert "CUDA tests: " in text and ("3 skipped" in text or "3 passed" in text)
    assert any(line.startswith("linear ") for line in text.splitlines())
    assert "omp N=4000 D=256 k=16 B=" in text
    for row in ("tokensurgeon 300->400 D=128 ", "extract-lora D=128 r=4 "):  # the commands, at their tiny size (the
        # dry run's default, quick, takes 20 s more and runs the same code)
        assert any(line.startswith(row) and "  ok: " in line for line in text.splitlines()), text
    assert "note: mergekit not run (no mergekit wheels): mergesmith figures only" in text
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-dry-run" and data["size"] == "tiny"
    assert data["tests"]["passed"] + data["tests"]["skipped"] == 3 and not data["tests"]["failures"]
    linear = data["cases"][0]
    assert linear["case"] == "linear" and linear["mergekit"] is None
    assert linear["mergesmith"]["total_s"] > 0 and linear["mergesmith"]["maxrss"] > 0 and linear["floor_s"] > 0
    assert data["omp"]["mergesmith"]["residual"] > 0 and not math.isnan(data["omp"]["mergesmith"]["seconds"])
    assert data["elapsed_s"] < 240 or any("overran" in n for n in data["notes"])


@pytest.mark.slow
def test_cpu_dry_run_without_venvs_runs_the_checkout_on_the_machines_python_and_samples_a_case(tmp_path: Path) -> None:
    """--no-venv, as on a GPU machine whose image holds the ML stack and whose transfer limit leaves room for a few
    wheels only: no venv is made, this checkout's src/ is what runs (no mergesmith wheel needed), the wheels that
    are there are unpacked into WORK/site, and --sample leaves a stack report of the case."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    out = tmp_path / "check.json"
    proc = _run("bench/gpu_check.sh", str(wheels), "--no-venv", "--cpu-dry-run", "--python", sys.executable,
                "--work", str(tmp_path / "work"), "--minutes", "3", "--json", str(out), "--",
                "--models-root", str(tmp_path / "models"), "--cases", "linear", "--sample", "linear",
                "--commands-size", "none", "--test-files", "tests/test_magnitude_blocks.py", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert not (tmp_path / "work" / "venv-mergesmith").exists()
    data = json.loads(out.read_text())
    assert data["cases"][0]["mergesmith"]["total_s"] > 0
    report = tmp_path / "work" / "sample-linear.txt"
    assert f"note: stack sample of linear: {report}" in proc.stdout
    text = report.read_text()
    assert "== thread group 'MainThread'" in text and "engine/run.py:run_merge" in text


def test_the_gpu_path_is_set_against_the_same_machines_cpu_path() -> None:
    """Issue 33, item 4: the GPU path never slower than the CPU path on the same machine. A case with a CPU-path run
    gets a line with both times, their ratio and which is faster; a case without one gets none."""
    table = bench_module("gpu_table")
    result = _result()
    result["cases"][0]["cpu_path"] = {"total_s": 12.5, "wall_s": 12.4, "cpu_s": 30.0, "maxrss": 9e8}
    result["cases"][2]["cpu_path"] = {"total_s": 20.0, "wall_s": 19.9, "cpu_s": 30.0, "maxrss": 9e8}
    text = table.render(result)
    slower = "linear: --cuda 15.0 s, this machine's CPU path 12.5 s (1.20x: the GPU path slower than the CPU path)"
    assert slower in text
    assert "slerp: --cuda 15.0 s, this machine's CPU path 20.0 s (0.75x: the GPU path at least as fast as" in text
    assert "della: --cuda" not in text
    assert json.loads(table.to_json(result))["cases"][0]["cpu_path"]["total_s"] == 12.5
    result["cases"][0]["cpu_path_threads"] = {
        "8": {"total_s": 9.0, "cpu_s": 25.0},
        "4": {"total_s": 10.0, "cpu_s": 21.0},
    }
    assert (f"{slower}; the CPU path with --threads 4: 10.0 s (21 CPU-s), --threads 8: 9.0 s (25 CPU-s), with its "
            "default: 30 CPU-s") in table.render(result)


def test_the_cpu_path_runs_are_cut_when_they_would_not_fit(tmp_path: Path, monkeypatch: Any) -> None:
    """The CPU-path step keeps the later steps' reserves: with too little time left it runs nothing and says so in
    one cut line per case; off CUDA (the dry run) it does nothing at all."""
    check = bench_module("gpu_check")
    args = check.build_parser().parse_args(["--work", str(tmp_path), "--commands-size", "none"])
    cases = [{"case": "linear", "mergesmith": {"total_s": 15.0}}, {"case": "ties", "mergesmith": {"total_s": 9.0}}]
    cut: list[str] = []
    check.run_cpu_path(args, check.Clock(__import__("time").time() + check.OMP_RESERVE_S + 10), cases, False, cut)
    assert cut == ["linear on the CPU path: out of time (10 s left, ~22 s)"]  # ties is not a --cpu-cases case
    assert all("cpu_path" not in c for c in cases)
    args.mode = "cpu-dry-run"
    check.run_cpu_path(args, check.Clock(0.0), cases, False, cut)
    assert len(cut) == 1
    runs: list[list[str]] = []

    def run_timed(cmd: list[str], **_: Any) -> Any:
        runs.append(cmd)
        return SimpleNamespace(total_s=10.0, wall_s=10.0, cpu_s=12.0, maxrss=1e9, peak_anon=5e8)

    monkeypatch.setattr(check.bl, "run_timed", run_timed)
    args.mode, args.cpu_threads = "cuda", [4, 8]
    clock = check.Clock(__import__("time").time() + 10**6)
    cut.clear()
    check.run_cpu_path(args, clock, cases, False, cut)
    assert [cmd[-2:] for cmd in runs[1:]] == [["--threads", "4"], ["--threads", "8"]] and "--threads" not in runs[0]
    assert cases[0]["cpu_path"]["total_s"] == 10.0 and sorted(cases[0]["cpu_path_threads"]) == ["4", "8"]
    assert not cut
