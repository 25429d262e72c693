"""bench/first_read.py, the start-up measurement quoted in bench/README.md ("Start-up"), runs end to end: a merge in
a fresh process whose first input read is stamped. Warm cache and tiny models, so it takes seconds; whether the
stamp is the feed's first read is what the assertion on its order checks (the read comes after the start-up and
before the end)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_first_read_reports_the_start_up_and_the_end(tmp_path, tiny_models):
    base = tiny_models("llama", seed=1)
    config = tmp_path / "linear.yml"
    config.write_text(
        f"merge_method: linear\nmodels:\n- model: {base}\n  parameters: {{weight: 0.5}}\n"
        f"- model: {tiny_models.derive(base, seed=2)}\n  parameters: {{weight: 0.5}}\n"
    )
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "first_read.py"), str(config), "--runs", "2",
                           "--warm", "--src", str(ROOT / "src")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = re.findall(r"first read ([\d.]+) s, end ([\d.]+) s", done.stdout)
    assert len(runs) == 2
    assert all(0 < float(first) < float(end) for first, end in runs)
    assert re.search(r"median first read [\d.]+ s .* 2 runs, cache warm", done.stdout)
