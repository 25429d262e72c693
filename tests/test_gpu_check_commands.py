"""The GPU check's commands step (bench/gpu_check.py -> bench/device_commands.py) on a machine without a GPU.

On a GPU it runs `mergesmith tokensurgeon` and `extract-lora --device cuda` at a realistic size; what can rot
without one is tested here at the tiny size, on the CPU, through the dry-run pipeline of bench/gpu_check.py: the
step runs and its rows reach the table and the JSON, a failing command becomes a failed row and exit status 1,
and a step that does not fit its time is cut with a `cut:` line. The formatting of the rows is tested on a
made-up result (the --also-cpu line, a failed check).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers import bench_module

TINY_OMP = ["--omp-shared", "500", "--omp-hidden", "64", "--omp-k", "4", "--omp-targets", "64"]


@pytest.fixture(scope="module")
def bench_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One root for the tiny bench models the check generates first (shared by the pipeline tests)."""
    return tmp_path_factory.mktemp("bench-models")


def _check(tmp_path: Path, bench_models: Path, *extra: str) -> tuple[int, str, dict]:
    """bench/gpu_check.py's dry run with no merge, no tests, no sample: the commands step at the tiny size."""
    check = bench_module("gpu_check")
    out = tmp_path / "check.json"
    code = check.main(["--mode", "cpu-dry-run", "--size", "tiny", "--minutes", "3", "--cases", "", "--test-files", "",
                       "--sample", "", *TINY_OMP, "--commands-size", "tiny", "--work", str(tmp_path / "work"),
                       "--models-root", str(bench_models), "--json", str(out), *extra])
    return code, out.read_text(), json.loads(out.read_text())


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert len(rows) == 1, text
    return rows[0]


def test_the_commands_step_runs_in_the_dry_run_and_its_rows_reach_the_table_and_json(
    tmp_path: Path, bench_models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, data = _check(tmp_path, bench_models)
    text = capsys.readouterr().out
    assert code == 0, text
    assert _row(text, "tokensurgeon 300->400 D=128").rstrip().endswith("shared rows the base's bytes")
    assert "ok: vocab 400; 200 new rows x2 within" in text
    assert "ok: 7 modules of rank 4 rebuild the delta within" in _row(text, "extract-lora D=128 r=4")
    assert "commands: tokensurgeon 300->400 tokens (200 new, k=8) and extract-lora (r=4) at hidden 128" in text
    commands = data["commands"]
    assert commands["size"] == "tiny" and commands["device"] == "cpu"
    assert [(r["command"], r["device"]) for r in commands["runs"]] == [("tokensurgeon", "cpu"), ("extract-lora", "cpu")]
    for run in commands["runs"]:
        assert run["check"]["ok"] and run["total_s"] > 0 and run["maxrss"] > 0 and run["error"] is None
    assert commands["runs"][0]["check"]["rel_error"] < 0.02
    assert [r[0] for r in data["table"]["rows"]][-2:] == ["tokensurgeon 300->400 D=128", "extract-lora D=128 r=4"]
    assert not (tmp_path / "work" / "commands" / "out-tokensurgeon-cpu").exists()  # outputs removed once checked


def test_a_failing_command_is_a_failed_row_and_the_check_exits_1(
    tmp_path: Path, bench_models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tokensurgeon refuses a k larger than the shared vocabulary (one error line): that line is its row."""
    code, _, data = _check(tmp_path, bench_models, "--commands-args=--k 1000 --commands tokensurgeon")
    text = capsys.readouterr().out
    assert code == 1, text
    row = _row(text, "tokensurgeon 300->400 D=128")
    assert "failed: error: `--k`: 1000 is larger than the 200 tokens BASE and DONOR share" in row
    assert row.split()[3:5] == ["-", "-"]  # no time for a command that failed
    run = data["commands"]["runs"][0]
    assert run["error"].startswith("error: `--k`: 1000") and run["check"] is None


def test_a_step_that_does_not_fit_is_cut_with_a_line_and_its_row_says_so() -> None:
    check, table = bench_module("gpu_check"), bench_module("gpu_table")
    args = check.build_parser().parse_args(["--mode", "cpu-dry-run", "--commands-size", "quick"])
    cut: list[str] = []
    clock = check.Clock(time.time() + check.OMP_RESERVE_S + 10)  # 10 s for a step that needs about 40
    commands = check.run_commands(args, clock, False, cut)
    assert cut == ["commands: out of time (10 s left, the quick size needs about 40 s)"]
    assert check.commands_reserve(args) == 50.0
    result = {"mode": "cpu-dry-run", "cases": [], "omp": None, "commands": commands, "cut": cut, "notes": []}
    text = table.render(result)
    why = "out of time (10 s left, the quick size needs about 40 s)"
    assert f"cut: commands: {why}" in text.splitlines()
    assert _row(text, "commands ").rstrip().endswith(f"not run: {why}")
    assert not table.commands_failed(commands)  # a cut is not a failure
    none = check.build_parser().parse_args(["--commands-size", "none"])
    assert check.run_commands(none, clock, False, cut) is None and check.commands_reserve(none) == 0.0


def _commands() -> dict:
    """A made-up realistic result with --also-cpu: the device runs passed; on the CPU extract-lora finished and
    tokensurgeon was stopped at the budget."""
    spec = {"hidden": 4096, "layers": 1, "base_vocab": 32000, "donor_vocab": 50000, "shared": 16000, "k": 64,
            "lora_rank": 16}
    ok = {"ok": True, "summary": "fine"}
    return {"size": "realistic", "spec": spec, "device": "cuda", "build_s": 9.4, "notes": [], "runs": [
        {"command": "tokensurgeon", "device": "cuda", "total_s": 31.0, "cpu_s": 40.0, "maxrss": 5.1e9, "check": ok},
        {"command": "extract-lora", "device": "cuda", "total_s": 8.0, "cpu_s": 9.0, "maxrss": 2.2e9,
         "check": {"ok": False, "summary": "model.layers.0.mlp.up_proj: B @ A is 9.00% off the delta"}},
        {"command": "extract-lora", "device": "cpu", "total_s": 40.0, "cpu_s": 300.0, "maxrss": 2.0e9, "check": ok},
        {"command": "tokensurgeon", "device": "cpu", "cut": "stopped after 120 s", "check": None, "error": None},
    ]}


def test_command_rows_the_cpu_line_and_a_failed_check() -> None:
    table = bench_module("gpu_table")
    commands = _commands()
    rows = table.command_rows(commands)
    assert [r[0] for r in rows] == ["tokensurgeon 32000->50000 D=4096", "extract-lora D=4096 r=16"]  # device runs
    assert rows[0][1:9] == ["31.0", "-", "-", "-", "-", "40.0", "5.10 GB", "ok: fine"]
    assert rows[1][-1] == "FAILED check: model.layers.0.mlp.up_proj: B @ A is 9.00% off the delta"
    assert table.commands_cpu_line(commands) == (
        "commands with --device cpu (--also-cpu): extract-lora 40.0 s (5.00x the device's), "
        "tokensurgeon not run: stopped after 120 s")
    assert table.commands_failed(commands)
    commands["runs"][1]["check"]["ok"] = True
    assert not table.commands_failed(commands)
    text = table.render({"mode": "cuda", "cases": [], "omp": None, "commands": commands, "cut": [], "notes": []})
    assert "commands: tokensurgeon 32000->50000 tokens (34000 new, k=64) and extract-lora (r=16) at hidden 4096" in text
    assert table.commands_failed({"cut": "failed: Traceback"}) and not table.commands_failed(None)


def test_a_timed_command_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """benchlib.run_timed's timeout, which stops a command at the step's budget: the launcher and the command go
    (a CPU transplant at the realistic size would otherwise run for hours after the check has printed its table)."""
    import subprocess

    bl = bench_module("benchlib")
    pid_file = tmp_path / "pid"
    started = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        bl.run_timed(["bash", "-c", f"echo $$ > {pid_file}; exec sleep 60"], cold=False, timeout=1.0)
    assert time.perf_counter() - started < 10
    pid = int(pid_file.read_text())
    for _ in range(50):  # gone, or a zombie until init reaps it
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the timed command {pid} is still running")
