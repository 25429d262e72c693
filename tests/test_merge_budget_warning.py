"""`merge` says at its start what `plan` says: a tensor whose working set is over --max-memory runs by itself."""

from __future__ import annotations

import subprocess
import sys

import yaml


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from mergesmith.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300)


def test_merge_warns_like_plan_when_a_tensor_is_over_the_budget(tmp_path, tiny_models):
    base = tiny_models("llama", seed=31)
    a, b = tiny_models.derive(base, seed=32), tiny_models.derive(base, seed=33)
    cfg = tmp_path / "ties.yml"
    cfg.write_text(yaml.safe_dump({
        "merge_method": "ties",
        "base_model": str(base),
        "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in (a, b)],
    }))
    planned = _cli(["plan", str(cfg), "--max-memory", "10KB"])
    assert planned.returncode == 0, planned.stderr
    line = next(x for x in planned.stdout.splitlines() if "over the --max-memory budget" in x)
    merged = _cli(["merge", str(cfg), str(tmp_path / "out"), "--max-memory", "10KB", "--no-copy-tokenizer"])
    assert merged.returncode == 0, merged.stderr
    assert line in merged.stderr.splitlines()
    roomy = _cli(["merge", str(cfg), str(tmp_path / "out2"), "--max-memory", "1GB", "--no-copy-tokenizer"])
    assert roomy.returncode == 0 and "over the --max-memory budget" not in roomy.stderr
