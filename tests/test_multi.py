"""Multi-stage merges: dependency order, skipping unchanged stages, and errors caught before any merge."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from mergesmith.cli import main
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.errors import ConfigError, MergesmithError
from mergesmith.io.journal import Journal
from mergesmith.multi.stages import load_stages, run_multi, stage_order
from tests.helpers import read_state_dict


def _write_multi(path: Path, documents: list[dict]) -> Path:
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


def _three_stages(a: Path, b: Path, c: Path, last_weight: float = 0.5) -> list[dict]:
    """`final` <- `mid` <- `first`, listed out of order so the file order is not the run order."""
    return [
        {
            "name": "final",
            "merge_method": "linear",
            "models": [
                {"model": "mid", "parameters": {"weight": last_weight}},
                {"model": str(a), "parameters": {"weight": 1.0 - last_weight}},
            ],
        },
        {
            "name": "first",
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 1.0}},
                {"model": str(b), "parameters": {"weight": 1.0}},
            ],
        },
        {
            "name": "mid",
            "merge_method": "slerp",
            "base_model": "first",
            "models": [{"model": "first"}, {"model": str(c)}],
            "parameters": {"t": 0.3},
        },
    ]


def _snapshot(out: Path) -> dict[str, int]:
    """mtime of every model file under `out`: a skipped stage must leave all of them untouched."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.rglob("*")) if p.is_file()}


def _ran(results) -> list[str]:
    return [r.name for r in results if r.ran]


def test_three_stages_run_in_order_and_a_rerun_after_an_edit_runs_only_what_changed(tmp_path, tiny_models):
    a, b, c = (tiny_models("llama", seed=s) for s in (1, 2, 3))
    cfg = _write_multi(tmp_path / "multi.yml", _three_stages(a, b, c))
    out = tmp_path / "stages"

    results = run_multi(cfg, out, MergeOptions())
    assert [r.name for r in results] == ["first", "mid", "final"]  # dependencies first
    assert _ran(results) == ["first", "mid", "final"]
    for name in ("first", "mid", "final"):
        assert (out / name / "config.json").is_file() and (out / name / "model.safetensors").is_file()

    # The stage outputs are what the stages say: `first` is the mean of a and b, `final` mixes `mid` and a.
    sa, sb = read_state_dict(a), read_state_dict(b)
    first, mid, final = (read_state_dict(out / n) for n in ("first", "mid", "final"))
    for name in first:
        torch.testing.assert_close(first[name], (sa[name] + sb[name]) / 2)
        torch.testing.assert_close(final[name], 0.5 * mid[name] + 0.5 * sa[name])

    # Unchanged: nothing runs and no file is touched.
    before = _snapshot(out)
    assert _ran(run_multi(cfg, out, MergeOptions())) == []
    assert _snapshot(out) == before

    # Editing the last stage reruns only it; its upstream files stay as they were.
    _write_multi(cfg, _three_stages(a, b, c, last_weight=0.8))
    assert _ran(run_multi(cfg, out, MergeOptions())) == ["final"]
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if not k.startswith("final/")} == {
        k: v for k, v in before.items() if not k.startswith("final/")
    }
    torch.testing.assert_close(
        read_state_dict(out / "final")["model.norm.weight"],
        0.8 * mid["model.norm.weight"] + 0.2 * sa["model.norm.weight"],
    )

    # Editing the middle stage reruns it and everything downstream, not what it depends on.
    docs = _three_stages(a, b, c, last_weight=0.8)
    docs[2]["parameters"]["t"] = 0.6
    _write_multi(cfg, docs)
    assert _ran(run_multi(cfg, out, MergeOptions())) == ["mid", "final"]

    # --no-lazy reruns every stage.
    assert _ran(run_multi(cfg, out, MergeOptions(), lazy=False)) == ["first", "mid", "final"]


def test_unnamed_final_merge_goes_to_out_path_via_the_cli(tmp_path, tiny_models, capsys):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    cfg = _write_multi(
        tmp_path / "multi.yml",
        [
            {
                "name": "avg",
                "merge_method": "linear",
                "models": [{"model": str(a)}, {"model": str(b)}],
                "parameters": {"weight": 1.0},
            },
            {"merge_method": "linear", "models": [{"model": "avg"}, {"model": str(b)}], "parameters": {"weight": 1.0}},
        ],
    )
    final = tmp_path / "final"
    with pytest.raises(SystemExit) as exit_info:
        main(["multi", str(cfg), "--intermediate-dir", str(tmp_path / "stages"), "--out-path", str(final), "-q"])
    assert exit_info.value.code == 0
    assert (final / "config.json").is_file() and (tmp_path / "stages" / "avg" / "config.json").is_file()
    printed = capsys.readouterr().out
    assert "avg: wrote" in printed and "(final): wrote" in printed

    with pytest.raises(SystemExit) as exit_info:
        main(["multi", str(cfg), "--out-dir", str(tmp_path / "stages"), "-q"])
    assert exit_info.value.code == 2
    assert "--out-path" in capsys.readouterr().err


def _doc(name: str | None, *models: str) -> dict:
    doc = {"merge_method": "linear", "models": [{"model": m} for m in models], "parameters": {"weight": 1.0}}
    return {"name": name, **doc} if name else doc


@pytest.mark.parametrize(
    ("documents", "message"),
    [
        ([_doc("x", "y", "{a}"), _doc("y", "z", "{a}"), _doc("z", "x", "{a}")], "cycle: x -> y -> z -> x"),
        ([_doc("x", "{a}", "{a}"), _doc("y", "xx", "{a}")], "model 'xx' is neither a stage"),
        ([_doc("x", "{a}", "{a}"), _doc("x", "{a}", "{a}")], "documents 1 and 2 are both named 'x'"),
        ([_doc(None, "{a}", "{a}"), _doc(None, "{a}", "{a}")], "only the final merge may be unnamed"),
        ([_doc("../up", "{a}", "{a}")], "must be a plain directory name"),
        ([_doc("x", "x", "{a}")], "names itself"),
        ([{"name": "x", "merge_method": "linear", "modles": []}], "`modles` was ignored"),
    ],
)
def test_bad_multi_files_fail_before_any_merge_with_one_clear_line(tmp_path, tiny_models, documents, message):
    a = str(tiny_models("llama", seed=1))
    docs = yaml.safe_load(yaml.safe_dump(documents).replace("{a}", a))
    cfg = _write_multi(tmp_path / "multi.yml", docs)
    with pytest.raises(ConfigError, match="^" + re.escape(str(cfg))) as err:
        stage_order(load_stages(cfg), str(cfg))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_unknown_name_close_to_a_stage_is_suggested(tmp_path, tiny_models):
    a = str(tiny_models("llama", seed=1))
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("first-merge", a, a), _doc("second", "frist-merge", a)])
    with pytest.raises(ConfigError, match="did you mean stage `first-merge`"):
        run_multi(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_randomised_stage_without_a_seed_reuses_its_recorded_seed_and_is_skipped(tmp_path, tiny_models):
    base = tiny_models("llama", seed=1)
    tuned = [tiny_models.derive(base, seed=s) for s in (2, 3)]
    docs = [
        {
            "name": "avg",
            "merge_method": "linear",
            "models": [{"model": str(t)} for t in tuned],
            "parameters": {"weight": 1.0},
        },
        {
            "name": "dare",
            "merge_method": "dare_ties",
            "base_model": str(base),
            "models": [{"model": "avg", "parameters": {"weight": 1.0, "density": 0.5}}],
        },
    ]
    cfg = _write_multi(tmp_path / "multi.yml", docs)
    out = tmp_path / "stages"
    assert _ran(run_multi(cfg, out, MergeOptions())) == ["avg", "dare"]
    seed = Journal.load(out / "dare").random_seed
    assert seed is not None and Journal.load(out / "avg").random_seed is None  # no seed leaks across stages
    before = _snapshot(out)
    assert _ran(run_multi(cfg, out, MergeOptions())) == []
    assert _snapshot(out) == before


@pytest.mark.parametrize("which", ["stage", "path"])
def test_tokenizer_source_in_mergekits_model_prefix_form(tmp_path, tiny_models, which):
    """`tokenizer_source: model:<ref>` names a stage or a local model, as mergekit writes it."""
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    ref = "first" if which == "stage" else str(b)
    docs = [
        _doc("first", str(a), str(b)),
        {**_doc("second", "first", str(a)), "tokenizer_source": f"model:{ref}"},
        {**_doc("third", str(a), str(b)), "tokenizer": {"source": f"model:{ref}"}},
    ]
    cfg = _write_multi(tmp_path / "multi.yml", docs)
    stages = load_stages(cfg)
    assert stages[1].depends_on == ["first"]
    assert stages[2].depends_on == (["first"] if which == "stage" else [])
    out = tmp_path / "stages"
    assert _ran(run_multi(cfg, out, MergeOptions())) == ["first", "second", "third"]
    for name in ("second", "third"):
        assert (out / name / "config.json").is_file() and (out / name / "tokenizer.json").is_file()
    assert _ran(run_multi(cfg, out, MergeOptions())) == []  # the substituted document plans the same


@pytest.mark.parametrize("where", ["one", "one/sub", "./one/../one"])
def test_out_path_that_is_or_is_inside_a_stage_directory_is_refused(tmp_path, tiny_models, monkeypatch, where):
    a, b = str(tiny_models("llama", seed=1)), str(tiny_models("llama", seed=2))
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", a, b), _doc(None, "one", a)])
    monkeypatch.chdir(tmp_path)  # relative spellings of the same directory are caught too
    with pytest.raises(ConfigError, match="stage 'one'") as err:
        run_multi(cfg, "st", out_path=f"st/{where}")
    assert "\n" not in str(err.value) and "--out-path" in str(err.value)
    assert not (tmp_path / "st").exists()  # refused before anything ran


def test_out_path_with_no_unnamed_document_is_an_error_not_ignored(tmp_path, tiny_models, capsys):
    a, b = str(tiny_models("llama", seed=1)), str(tiny_models("llama", seed=2))
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", a, b), _doc("two", "one", a)])
    with pytest.raises(SystemExit) as exit_info:
        main(["multi", str(cfg), "--out-dir", str(tmp_path / "st"), "--out-path", str(tmp_path / "final"), "-q"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--out-path" in err and "every document has a `name`" in err
    assert not (tmp_path / "st").exists() and not (tmp_path / "final").exists()


def test_a_bad_input_of_a_later_stage_is_found_before_any_stage_runs(tmp_path, tiny_models, capsys):
    a, b = str(tiny_models("llama", seed=1)), str(tiny_models("llama", seed=2))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text((Path(a) / "config.json").read_text())
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)  # header length far past the end
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", a, b), _doc("two", "one", str(garbage))])
    with pytest.raises(SystemExit) as exit_info:
        main(["multi", str(cfg), "--out-dir", str(tmp_path / "st"), "-q"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "stage 'two'" in err and str(garbage / "model.safetensors") in err
    assert not (tmp_path / "st").exists()  # stage `one` never ran


def test_an_error_while_running_a_later_stage_names_that_stage(tmp_path, tiny_models):
    a, b = str(tiny_models("llama", seed=1)), str(tiny_models("llama", seed=2))
    other = str(tiny_models("qwen2", seed=1))  # another architecture: its tensors do not line up with `one`'s
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", a, b), _doc(None, "one", other)])
    with pytest.raises(MergesmithError) as err:
        run_multi(cfg, tmp_path / "st", out_path=tmp_path / "final")
    assert "document 2 (the unnamed final merge)" in str(err.value) and "\n" not in str(err.value)
    assert (tmp_path / "st" / "one" / "config.json").is_file()  # it failed in the later stage, not before

    # An error from writing (not planning) the stage is labelled too.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", a, b), _doc(None, "one", a)])
    with pytest.raises(MergesmithError) as err:
        run_multi(cfg, tmp_path / "st", out_path=blocker)
    assert str(err.value).startswith(f"document 2 (the unnamed final merge): {blocker}: "), str(err.value)


def test_a_model_plus_lora_input_is_accepted_and_checked_up_front(tmp_path, tiny_models):
    from mergesmith.lora.extract import extract_lora

    base = tiny_models("llama", seed=1)
    tuned = tiny_models.derive(base, seed=5)
    extract_lora(str(tuned), str(base), tmp_path / "adapter", 4)
    lora_ref = f"{base}+{tmp_path / 'adapter'}"
    cfg = _write_multi(tmp_path / "multi.yml", [_doc("one", lora_ref, str(base)), _doc("two", "one", str(base))])
    assert [s.depends_on for s in load_stages(cfg)] == [[], ["one"]]
    assert _ran(run_multi(cfg, tmp_path / "st")) == ["one", "two"]
