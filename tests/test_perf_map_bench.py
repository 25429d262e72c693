"""bench/perf_map.py, the perf map behind bench/README.md's profiles of numba's loops ("eighth session of issue 33"),
runs a merge in-process and names the compiled loops the run loaded: with `--load` every kernel group is loaded
first, so the map must name loops of each of them, at distinct addresses, and the merge must still succeed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="perf maps are Linux's")
def test_the_map_names_each_kernel_groups_loops(tmp_path, tiny_models):
    pytest.importorskip("numba")
    base = tiny_models("llama", seed=1)
    config = tmp_path / "ties.yml"
    config.write_text(
        f"merge_method: ties\nbase_model: {base}\nmodels:\n- model: {tiny_models.derive(base, seed=2)}\n"
        f"  parameters: {{weight: 0.5, density: 0.5}}\ndtype: bfloat16\n"
    )
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "perf_map.py"), "--load", "merge", str(config),
                           str(out), "-q"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "model.safetensors").is_file()
    path = re.search(r"perf map: (\S+) \((\d+) functions\)", done.stderr)
    assert path, done.stderr[-2000:]
    lines = Path(path.group(1)).read_text().splitlines()
    Path(path.group(1)).unlink()
    names = {line.split(" ", 2)[2] for line in lines}
    for loop in ("bf16_mix.mix", "introsort_replay.key_counts", "keyed_kernels.dare_totals",
                 "keyed_kernels.mix_bf16"):
        assert f"numba:{loop}" in names, sorted(names)[:20]
    addresses = [int(line.split(" ", 1)[0], 16) for line in lines]
    assert addresses == sorted(set(addresses))
