"""bench/recipe_trace.py, the per-recipe timeline quoted in bench/README.md (issue 33's sixth session) and in
admission.MemoryBudget, runs end to end: a merge in a fresh process with each recipe's start, end and worker printed.
Tiny models and a warm cache, so it takes seconds; the assertions check that every tensor of the output has its
line and that the times are ordered."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from .helpers import write_config

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_trace_prints_every_recipe_with_its_worker_and_times(tmp_path, tiny_models):
    base = tiny_models("llama", seed=1)
    tuned = [str(tiny_models.derive(base, seed=seed)) for seed in (2, 3)]
    config = write_config(tmp_path / "ties.yml", {
        "merge_method": "ties",
        "base_model": str(base),
        "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.5}} for m in tuned],
    })
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "recipe_trace.py"), "--min-s", "0", "--",
                           str(config), str(out), "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^automatic budget: \d+ MB$", done.stdout, re.M)
    lines = re.findall(r"^ *([\d.]+) +([\d.]+) +([\d.]+)  (merge_\d) +(\S+) \(\d+ MB\)$", done.stdout, re.M)
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        names = set(written.keys())
    assert {name for *_, name in lines} == names
    assert all(float(start) <= float(end) for start, end, *_ in lines)
    assert [float(start) for start, *_ in lines] == sorted(float(start) for start, *_ in lines)
