"""`mergesmith evolve` with lm-evaluation-harness tasks: a local task YAML directory (`--task-search-path`)
defining a tiny multiple-choice task over a local JSONL file, scored offline on the committed fixture models;
the journaled scores equal lm-eval's own `simple_evaluate` on the same merged model; an unknown task or metric
fails in one line before the first merge; without lm-eval the refusal names the extra to install.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local json datasets must need no network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("cma", reason="cma is not installed (pip install 'mergesmith[evolve]')")
pytest.importorskip("transformers")

from mergesmith.cli import main  # noqa: E402
from mergesmith.evolve import SearchOptions, run_search  # noqa: E402
from mergesmith.evolve import lmeval as lmeval_mod  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "evolve"
LIMIT = 40
needs_lm_eval = pytest.mark.skipif(not lmeval_mod.available(), reason="lm-eval is not installed")


def _choices(answer: str) -> list[str]:
    """The right sum and two wrong ones (off by one, digits swapped), in a fixed order."""
    wrong = str(int(answer) + 1)
    swapped = answer[::-1] if answer[::-1] != answer else str(int(answer) + 2)
    return [answer, wrong, swapped]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    rows = [json.loads(line) for line in (FIXTURES / "add_eval.jsonl").read_text().splitlines() if line.strip()]
    data = root / "tiny_add.jsonl"
    with data.open("w") as fh:
        for i, row in enumerate(rows[:LIMIT]):
            choices = _choices(row["answer"])
            order = i % 3  # the right answer at every position
            choices = choices[order:] + choices[:order]
            fh.write(json.dumps({"q": row["prompt"], "choices": choices, "label": choices.index(row["answer"])}) + "\n")
    (root / "tasks").mkdir()
    (root / "tasks" / "tiny_add.yaml").write_text(yaml.safe_dump({
        "task": "tiny_add",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{q}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "target_delimiter": "",  # the char-level vocabulary has no space
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }))
    return root / "tasks"


def genome(tmp_path: Path, **task) -> Path:
    doc = {
        "genome": {
            "models": [str(FIXTURES / "add"), str(FIXTURES / "rev")],
            "merge_method": "task_arithmetic",
            "base_model": str(FIXTURES / "base"),
            "layer_granularity": 4,
        },
        "tasks": [{"name": "tiny_add", "metric": "acc_norm", **task}],
    }
    path = tmp_path / "genome.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def lm_eval_direct(model_dir: Path, task_dir: Path, **harness) -> dict[str, float]:
    """lm-eval's own answer for a merged model on disk: HFLM + simple_evaluate, nothing of mergesmith's
    (only the local task directory is indexed: lm-eval's ~15k built-in YAMLs take ~10 s to index here)."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURES / "base"))
    lm = HFLM(pretrained=str(model_dir), tokenizer=tok, device="cpu", dtype="float32", batch_size=8)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = simple_evaluate(model=lm, tasks=["tiny_add"], task_manager=manager, log_samples=False, bootstrap_iters=0,
                          **harness)
    return {k: v for k, v in out["results"]["tiny_add"].items() if k in ("acc,none", "acc_norm,none")}


@needs_lm_eval
@pytest.mark.parametrize(("in_memory", "harness"), [(True, {}), (False, {"limit": 24, "num_fewshot": 1})])
def test_lm_eval_task_scores_equal_simple_evaluate(tmp_path, task_dir, in_memory, harness):
    """In memory (HFLM given the model object) and on disk (pretrained=DIR), with the harness's own
    `limit` and `num_fewshot` passed through: each journaled score is what simple_evaluate says."""
    from mergesmith.config import parse_config
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import RunControls, run_merge

    result = run_search(genome(tmp_path), tmp_path / "s", SearchOptions(
        max_fevals=2, popsize=2, random_seed=1, sigma0=1.0, batch_size=8, in_memory=in_memory,
        task_search_path=[str(task_dir)], **harness))
    assert len(result.history) == 2
    for row in result.history:
        scores = row["scores"]["tiny_add"]
        assert set(scores) >= {"acc,none", "acc_norm,none"}
        assert row["fitness"] == scores["acc_norm,none"]  # the genome's `acc_norm` is lm-eval's `acc_norm,none`
        merged = run_merge(parse_config(row["config"], "row"), tmp_path / f"m{row['evaluation']}",
                           MergeOptions(), controls=RunControls(overwrite=True)).out_dir
        direct = lm_eval_direct(merged, task_dir, **harness)
        assert {k: scores[k] for k in direct} == pytest.approx(direct, abs=1e-9)
    # another model (the reversal parent, weak at addition) scores differently, so equal scores above are not
    # a coincidence (the two candidates may score alike: the task has 40 easy three-way questions)
    other = lm_eval_direct(FIXTURES / "rev", task_dir, **harness)
    assert all({k: row["scores"]["tiny_add"][k] for k in other} != other for row in result.history)
    assert not (tmp_path / "s" / "candidate").exists()  # an on-disk candidate is removed after scoring


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ({"name": "no_such_task_xyz"}, "task 'no_such_task_xyz': not a built-in task and not an lm-eval task"),
        ({"metric": "f1"}, "task 'tiny_add': metric 'f1' is not reported by this lm-eval task (it reports "
                           "acc,none, acc_norm,none)"),
        ({"metric": "acc,strict-match"}, "metric 'acc,strict-match' is not reported"),
    ],
)
@needs_lm_eval
def test_unknown_lm_eval_task_or_metric_fails_in_one_line(tmp_path, task_dir, capsys, task, expected):
    storage = tmp_path / "storage"
    with pytest.raises(SystemExit) as exc:
        main(["evolve", str(genome(tmp_path, **task)), "--storage-path", str(storage),
              "--task-search-path", str(task_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not storage.exists()


def test_lm_eval_task_refused_without_lm_eval(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lmeval_mod, "available", lambda: False)
    storage = tmp_path / "storage"
    with pytest.raises(SystemExit) as exc:
        main(["evolve", str(genome(tmp_path)), "--storage-path", str(storage)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "task 'tiny_add': not a built-in task" in err[0] and "mergesmith[evolve-lm-eval]" in err[0]
    assert not storage.exists()


@needs_lm_eval
def test_bad_lm_eval_arg_fails_in_one_line(tmp_path, task_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["evolve", str(genome(tmp_path)), "--storage-path", str(tmp_path / "s"),
              "--task-search-path", str(task_dir), "--lm-eval-arg", "no_such_arg=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "'no_such_arg' is not an argument" in err[0], err
