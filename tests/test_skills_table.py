"""The four-skill benchmark (bench/skills_table.py) on its committed fixtures (tests/fixtures/skills4).

The full table is a measurement (`python bench/skills_table.py`, the README's "Which method keeps the most
skills"); this runs its machinery on task arithmetic alone so it cannot rot: the fixtures load and score as the
README says, a merge goes through `mergesmith.merge` from the config the bench writes, a method this checkout
lacks is listed as "not available", and a failing merge is reported in its row. The slow test rebuilds the
fixtures and compares their sha256s (make_fixtures.py --skills4 --check).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "skills4"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load(ROOT / "bench" / "skills_table.py", "skills_table_under_test")


def _accuracies(lines: list[str]) -> dict[str, list[str]]:
    """Table row name -> its cells after the hyperparameters (four skills and the mean, or a note)."""
    out = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out[cells[0]] = cells[2:]
    return out


def test_fixtures_are_small_and_complete() -> None:
    models = ["base", "add", "rev", "sort", "next"]
    size = sum(f.stat().st_size for m in models for f in (FIXTURES / m).iterdir())
    assert size < 500_000, size
    for skill in models[1:]:
        assert len((FIXTURES / f"{skill}_eval.jsonl").read_text().splitlines()) == 150
    calibration = (FIXTURES / "calibration.txt").read_text().splitlines()
    assert len(calibration) == 256
    held = set()
    for skill in models[1:]:
        records = [json.loads(line) for line in (FIXTURES / f"{skill}_eval.jsonl").read_text().splitlines()]
        held |= {r["prompt"] + r["answer"] for r in records}
    assert held.isdisjoint(calibration)  # calibration text is training data, never a held-out example


def test_table_task_arithmetic(bench, monkeypatch, capsys) -> None:
    """Measured on the fixtures' first 50 held-out prompts per skill (the README's table uses all 150, with
    the same ordering): each fine-tune is best at its own skill, and task arithmetic at
    lambda 0.3 keeps more of the four skills on average than the base or any fine-tune alone."""
    missing = bench.Row("no_such_method", {"lambda": 1.0}, {"weight": 1.0}, "absent on purpose")
    broken = dataclasses.replace(bench.TABLE[0], params={"lambda": 0.3, "no_such_key": 1.0})
    broken = dataclasses.replace(broken, method="ties")  # a registered method with a parameter it refuses
    monkeypatch.setattr(bench, "TABLE", (bench.TABLE[0], broken, missing))
    lines = bench.run(["task_arithmetic", "ties", "no_such_method"], FIXTURES, 50, 1, 150, show_sources=False)
    rows = _accuracies(lines)
    assert rows["base"] == ["0.280", "0.220", "0.340", "0.560", "**0.350**"]  # the first 50 prompts per skill
    alone = {s: [float(c) for c in rows[f"{s} fine-tune alone"][:4]] for s in bench.SKILLS}
    for i, skill in enumerate(bench.SKILLS):
        assert max(range(4), key=lambda j: alone[skill][j]) == i, (skill, alone[skill])
        assert alone[skill][i] > [0.280, 0.220, 0.340, 0.560][i]
    ta_mean = float(rows["task_arithmetic"][4].strip("*"))
    assert ta_mean == pytest.approx(0.595, abs=0.0015)
    assert ta_mean > max(sum(v) / 4 for v in alone.values()) + 0.1
    assert rows["no_such_method"][-1] == "not available"
    assert re.match(r"error: .*no_such_key", rows["ties"][-1]), rows["ties"]
    assert "| task_arithmetic | lambda=0.3, normalize=False, weight=1.0 |" in capsys.readouterr().out


def test_every_row_is_a_config_mergesmith_reads(bench) -> None:
    """Each row's config parses as a merge config (the new methods' rows included: their parameter names are
    checked against the registry only where the method is registered)."""
    from mergesmith.config import MergeConfiguration
    from mergesmith.methods import get_method

    for row in bench.TABLE:
        config = bench.config_for(row, FIXTURES)
        MergeConfiguration.model_validate(config)
        spec = get_method(row.method)
        if spec is None:
            continue
        known = {p.name for p in (*spec.params, *spec.model_params)}
        assert set(row.params) | set(row.model_params) <= known, row.method
        assert row.source, row.method


@pytest.mark.slow
def test_fixture_rebuild_is_bit_identical() -> None:
    """make_fixtures.py --skills4 rebuilds the same bytes (about 30 s of training on one thread)."""
    fixtures = _load(ROOT / "examples" / "evolve_skills" / "make_fixtures.py", "make_fixtures_under_test")
    assert fixtures.check(FIXTURES, fixtures.RECIPES["skills4"]) == []
