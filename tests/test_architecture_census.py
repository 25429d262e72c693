"""The architecture census in the suite: every type tests/fixtures/architecture_census.json records as passing
is built, merged three ways and checked again (tests/architecture_census.py), one test per type so xdist
spreads them; a type that stops passing fails here. The fixture and docs/architectures.md are written by
scripts/architecture_census.py only: the fixture must be what the script writes for the rows it records.

Cost: about 2 CPU-minutes (96 s wall) for the 208 passing types (0.1 to 3 s each, tiny sizes, in-process), measured
with `--durations`; no type is marked `slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.architecture_census import passed

FIXTURE = Path(__file__).parent / "fixtures" / "architecture_census.json"
_RECORD = json.loads(FIXTURE.read_text())


def _passing() -> list[tuple[str, str, str]]:
    """(kind, type, the passthrough outcome word) of every type the fixture records as passing."""
    out = []
    for key, row in sorted(_RECORD["types"].items()):
        kind, model_type = key.split("/", 1)
        if passed(row):
            out.append((kind, model_type, row["passthrough"].split(":")[0]))
    return out


def _param(kind: str, model_type: str, passthrough: str) -> object:
    return pytest.param(kind, model_type, passthrough, id=f"{kind}/{model_type}")


@pytest.mark.parametrize(("kind", "model_type", "passthrough"), [_param(*p) for p in _passing()])
def test_a_census_type_that_passed_still_passes(tmp_path: Path, kind: str, model_type: str, passthrough: str) -> None:
    import transformers

    from tests.architecture_census import census_type

    if transformers.__version__ != _RECORD["transformers"]:
        pytest.skip(f"census recorded with transformers {_RECORD['transformers']}, {transformers.__version__} here")
    row = census_type(model_type, kind, tmp_path)
    assert "status" not in row, row
    assert row["linear"] == "pass", row["linear"]
    assert row["ties"] == "pass", row["ties"]
    assert row["passthrough"].split(":")[0] == passthrough, row["passthrough"]
    assert passed(row)


def test_the_fixture_and_the_table_are_what_the_script_writes() -> None:
    """No hand edits: the fixture, read and written again by the script, is the same text, and
    docs/architectures.md is the script's table of the same rows."""
    import importlib.util

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("census_script", root / "scripts" / "architecture_census.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = FIXTURE.read_text()
    rows, version = script.rows_of_fixture(text)
    assert script.fixture_text(rows, version) == text
    assert script.document(rows, version) == (root / "docs" / "architectures.md").read_text()


@pytest.mark.parametrize(
    ("model_type", "key"), [("zamba2", "hybrid_layer_ids"), ("gemma4_text", "hidden_size_per_layer_input")]
)
def test_a_depth_change_no_config_can_describe_is_one_plan_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_type: str, key: str
) -> None:
    """`plan` and `merge` refuse the passthrough in one `error:` line naming the config key, before any output;
    a `linear` merge of the same models is the census's (and passes there)."""
    from tests.architecture_census import build, merge_config
    from tests.helpers import assert_one_line_error, run_cli, write_config

    base, a, b = build(model_type, "causal-lm", tmp_path / "models")
    cfg = write_config(tmp_path / "f.yml", merge_config("passthrough", base, a, b))
    capsys.readouterr()  # what building the models printed
    code, _out, err = run_cli(capsys, "plan", cfg)
    assert_one_line_error(code, err, key)
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert_one_line_error(code, err, key)
    assert not (tmp_path / "out" / "config.json").exists()
