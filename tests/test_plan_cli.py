"""`mergesmith plan` and the import discipline of a plain merge."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from mergesmith.cli import main
from mergesmith.errors import ConfigError
from mergesmith.options import parse_size


def _config(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    path = tmp_path / "c.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": str(a), "parameters": {"weight": 1.0}},
                    {"model": str(b), "parameters": {"weight": [0.0, 1.0]}},
                ],
            }
        )
    )
    return path


def test_plan_json_reports_tensors_shards_bytes_memory_disk_and_time(tmp_path, tiny_models, capsys):
    cfg = _config(tmp_path, tiny_models)
    try:
        main(["plan", str(cfg), str(tmp_path / "out"), "--json", "--out-shard-size", "50K", "--threads", "3"])
    except SystemExit as exit_:
        assert exit_.code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["tensors"]) == 39 and len(report["shards"]) > 1
    assert sum(s["bytes"] for s in report["shards"]) == report["bytes_written"]
    assert report["bytes_read"] == 2 * report["bytes_written"]  # two float32 models in, one float32 out
    assert report["threads"] == 3 and report["peak_memory_bytes"] > 0
    assert report["disk"]["needed_bytes"] == report["bytes_written"] and report["disk"]["enough"]
    assert report["estimated_seconds"] >= 0 and report["read_throughput_bytes_per_s"] > 0
    weights = {t["name"]: [p["weight"] for p in t["model_params"]] for t in report["tensors"]}
    assert weights["model.layers.0.mlp.up_proj.weight"] == [1.0, 0.0]
    assert weights["model.layers.3.mlp.up_proj.weight"] == [1.0, 1.0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_plan_text_warns_when_one_tensor_exceeds_the_memory_budget(tmp_path, tiny_models, capsys):
    cfg = _config(tmp_path, tiny_models)
    try:
        main(["plan", str(cfg), "--max-memory", "10K", "--tensors"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "over the --max-memory budget" in out and "model.embed_tokens.weight" in out
    assert "estimated time" in out and "peak memory" in out


def test_merge_under_a_tiny_memory_budget_still_completes(tmp_path, tiny_models):
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import run_merge

    cfg = _config(tmp_path, tiny_models)
    result = run_merge(cfg, tmp_path / "o", MergeOptions(threads=4, max_memory=1))
    assert (tmp_path / "o" / "config.json").is_file() and len(result.plan.recipes) == 39


def test_a_plain_merge_never_imports_transformers(tmp_path, tiny_models):
    cfg = _config(tmp_path, tiny_models)
    code = (
        "import sys\n"
        "from mergesmith.cli import main\n"
        "try:\n"
        f"    main(['merge', {str(cfg)!r}, {str(tmp_path / 'o')!r}, '-q'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5B", 5_000_000_000),
        ("5b", 5_000_000_000),  # mergekit reads a lowercase b as billions too
        ("0.5B", 500_000_000),
        ("500M", 500_000_000),
        ("500m", 500_000_000),
        ("2G", 2_000_000_000),
        ("8GB", 8_000_000_000),
        ("16GiB", 16 * 1024**3),
        ("64KiB", 64 * 1024),
        ("1234", 1234),
        (4096, 4096),
    ],
)
def test_sizes_read_as_mergekit_reads_them(text, expected):
    assert parse_size(text, "--out-shard-size") == expected


@pytest.mark.parametrize("text", ["0", "0B", "0M", "five", "5X", "5iB", "-1G", ""])
def test_unreadable_or_zero_sizes_are_refused_naming_the_option(text):
    with pytest.raises(ConfigError, match="--max-memory"):
        parse_size(text, "--max-memory")


def test_zero_max_memory_on_the_command_line_is_one_error_line(tmp_path, tiny_models, capsys):
    cfg = _config(tmp_path, tiny_models)
    with pytest.raises(SystemExit) as exit_:
        main(["merge", str(cfg), str(tmp_path / "o"), "--max-memory", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: `--max-memory`: size must be positive, got '0'"]
    assert not (tmp_path / "o" / "config.json").exists()
