"""bench/profile_replay.py, the replay timings bench/README.md and block_stops quote, runs without the bench
models (--synthetic) and reports both ways of following and how the stops are gathered."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_replay_bench_times_both_ways(tmp_path):
    pytest.importorskip("numba")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_replay.py"), "--synthetic", "300000",
                           "--runs", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"300000 entries, [\d.]+% followed, stops by (compress|loop)", done.stdout), done.stdout
    for way in ("none", "ids"):
        assert re.search(rf"following {way}: [\d.]+ ns an entry", done.stdout), done.stdout
