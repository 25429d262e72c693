"""Ctrl-C: the first stops a merge cleanly within seconds (exit 130, saying how to resume, the work so
far journaled), a second exits at once; rerunning the same command completes byte-identical.

The merge runs as a real `python -m mergesmith.cli merge` subprocess, slowed down with the test-only
`MERGESMITH_TEST_SLOW` (seconds per tensor) so that the signal lands mid-merge.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.cli import main
from mergesmith.engine.execution.local_executor import ProgressEvent
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import RunControls, build_plan, run_merge
from mergesmith.errors import MergeInterrupted
from mergesmith.io.journal import STATE_DIR, STATE_TOP, Journal

SHARD_ARGS = ["--out-shard-size", "50K", "--threads", "1"]


@pytest.fixture(scope="module")
def case(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A linear merge config and the files of its uninterrupted merge (same shard size)."""
    root = tmp_path_factory.mktemp("interrupt")
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    config = root / "merge.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [{"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {}}],
                "parameters": {"weight": 0.25},
                "dtype": "float32",
            }
        )
    )
    run_merge(config, root / "ref", MergeOptions(out_shard_size=50_000, threads=1))
    return config, _files(root / "ref")


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP}


def _start(config: Path, out: Path, slow: float) -> subprocess.Popen[str]:
    env = {**os.environ, "MERGESMITH_TEST_SLOW": str(slow)}
    return subprocess.Popen(
        [sys.executable, "-m", "mergesmith.cli", "merge", str(config), str(out), *SHARD_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_until_merging(proc: subprocess.Popen[str], out: Path) -> None:
    """Block until the executor has opened its shards (so a tensor is in flight and the SIGINT
    handler is set), plus a moment for the first tensor to get going."""
    deadline = time.monotonic() + 180
    while not any((out / STATE_DIR / "partial").glob("*.partial")):
        assert proc.poll() is None, f"merge ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "merge never started"
        time.sleep(0.05)
    time.sleep(1.0)


def _open_files_under(root: Path) -> list[str]:
    """Files under `root` this process holds open (Linux /proc; empty elsewhere)."""
    fd_dir = Path("/proc/self/fd")
    found = []
    for fd in fd_dir.iterdir() if fd_dir.is_dir() else []:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def _resume_and_compare(capsys: pytest.CaptureFixture[str], config: Path, out: Path, ref: dict[str, bytes]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["merge", str(config), str(out), *SHARD_ARGS, "-q"])
    captured = capsys.readouterr()
    assert exc.value.code == 0, captured.err
    assert _files(out) == ref
    return captured.out


def test_ctrl_c_once_stops_cleanly_twice_exits_at_once(
    tmp_path: Path, case: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two merges side by side (each interpreter spends seconds importing torch). `once` takes 0.2 s
    per tensor and gets one Ctrl-C: it must stop within seconds, with exit 130, saying how to resume,
    its finished tensors journaled. `twice` takes 10 s per tensor, so only the second Ctrl-C can
    explain an exit within 3 s. Both then resume to the bytes of an uninterrupted merge."""
    config, ref = case
    procs = {"once": _start(config, tmp_path / "once", slow=0.2), "twice": _start(config, tmp_path / "twice", slow=10)}

    _wait_until_merging(procs["once"], tmp_path / "once")
    sent = time.monotonic()
    procs["once"].send_signal(signal.SIGINT)
    _stdout, stderr = procs["once"].communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert procs["once"].returncode == 130, stderr
    assert elapsed < 5, f"took {elapsed:.1f}s to stop"
    assert "stopping after the tensors in flight" in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted:") and "run the same command again to resume" in last, stderr
    assert "Traceback" not in stderr
    journal = Journal.load(tmp_path / "once")
    assert journal is not None and not journal.complete
    saved = sum(len(t) for t in journal.partial.values()) + len(journal.finished)
    assert saved >= 1, "the tensors finished before Ctrl-C were not journaled"

    _wait_until_merging(procs["twice"], tmp_path / "twice")
    sent = time.monotonic()
    procs["twice"].send_signal(signal.SIGINT)
    time.sleep(0.3)
    procs["twice"].send_signal(signal.SIGINT)
    _stdout, stderr = procs["twice"].communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert procs["twice"].returncode == 130, stderr
    assert elapsed < 3, f"took {elapsed:.1f}s to exit after the second Ctrl-C"
    assert "Ctrl-C again to quit at once" in stderr

    for name in procs:
        assert not (tmp_path / name / "config.json").exists()
        _resume_and_compare(capsys, config, tmp_path / name, ref)


def test_stop_request_in_process_journals_and_resumes(
    tmp_path: Path, case: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The API side of Ctrl-C (what the CLI's handler sets): stop after N tensors, then resume."""
    config, ref = case
    out = tmp_path / "out"
    stop = threading.Event()

    def on_progress(event: ProgressEvent) -> None:
        if event.tensors_done >= 17:
            stop.set()

    with pytest.raises(MergeInterrupted, match="run the same command again to resume") as exc:
        options = MergeOptions(out_shard_size=50_000, threads=1)
        run_merge(config, out, options, controls=RunControls(on_progress=on_progress, stop=stop))
    assert exc.value.exit_code == 130
    del exc  # its traceback holds the executor and its unfinished writers
    assert _open_files_under(out) == [], "an interrupted merge must not keep its partial files open"
    journal = Journal.load(out)
    assert journal is not None and journal.finished, "finished shards must be journaled at the stop"
    saved = sum(len(t) for t in journal.partial.values()) + sum(1 for _ in journal.finished)
    assert saved >= 2
    plan, _ = build_plan(config, MergeOptions(out_shard_size=50_000), out)
    whole = {s.filename: len(s.recipes) for s in plan.shards if s.filename in journal.finished}
    reused = sum(whole.values()) + sum(len(t) for t in journal.partial.values())
    expected = f"resumed: {reused} of {len(plan.recipes)} tensors already written ({len(whole)} of {len(plan.shards)} "
    assert expected in _resume_and_compare(capsys, config, out, ref)


def test_ctrl_c_while_verifying_finished_shards_stops_between_shards(
    tmp_path: Path, case: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifying rerun checksums every finished shard (minutes for a large merge): Ctrl-C must stop it
    between shards, changing nothing, instead of waiting for the whole verification. (A plain rerun of
    a complete merge whose shards are untouched reads none of them; `verify=True` forces the reading.)"""
    import mergesmith.engine.run

    config, ref = case
    out = tmp_path / "out"
    options = MergeOptions(out_shard_size=50_000, threads=1)
    run_merge(config, out, options)
    stop = threading.Event()
    checked: list[Path] = []
    real_checksum = mergesmith.engine.run.file_checksum

    def checksum_then_ctrl_c(path: Path) -> str:
        checked.append(path)
        stop.set()  # Ctrl-C arrives while the first shard is being verified
        return real_checksum(path)

    monkeypatch.setattr(mergesmith.engine.run, "file_checksum", checksum_then_ctrl_c)
    with pytest.raises(MergeInterrupted, match="nothing was changed"):
        options = MergeOptions(out_shard_size=50_000, threads=1)
        run_merge(config, out, options, controls=RunControls(stop=stop, verify=True))
    assert len(checked) == 1
    assert _files(out) == ref
    journal = Journal.load(out)
    assert journal is not None and journal.complete
    monkeypatch.undo()
    assert run_merge(config, out, MergeOptions(out_shard_size=50_000, threads=1)).already_complete


_SECOND_CTRL_C_AT_EXIT = """
import atexit, os, signal, sys, time
from mergesmith.cli import main

def second_ctrl_c():  # the user presses Ctrl-C again while the process shuts down
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still running after the second Ctrl-C", file=sys.stderr)

atexit.register(second_ctrl_c)
main(sys.argv[1:])
"""


def test_second_ctrl_c_during_shutdown_exits_130_without_a_traceback(
    tmp_path: Path, case: tuple[Path, dict[str, bytes]]
) -> None:
    """After the first Ctrl-C has stopped the merge, the process still has to shut down (thread
    joins, atexit hooks); a Ctrl-C there must quit at once with 130, not print a KeyboardInterrupt
    traceback ("Exception ignored in atexit callback")."""
    config, _ref = case
    out = tmp_path / "out"
    env = {**os.environ, "MERGESMITH_TEST_SLOW": "0.2"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SECOND_CTRL_C_AT_EXIT, "merge", str(config), str(out), *SHARD_ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_until_merging(proc, out)
    proc.send_signal(signal.SIGINT)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "stopping after the tensors in flight" in stderr
    assert "run the same command again to resume" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert "KeyboardInterrupt" not in stderr and "still running" not in stderr, stderr
