"""`mergesmith evolve`: genome -> merge configs, bad genomes in one line, a short seeded search, resume after an
interruption with the same history, the in-memory and on-disk candidate paths, and Ray against local.

Uses the committed fixtures in tests/fixtures/evolve (three tiny char-level llamas; see
examples/evolve_skills/make_fixtures.py), so nothing is trained here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("cma", reason="cma is not installed (pip install 'mergesmith[evolve]')")
pytest.importorskip("transformers")

from mergesmith.cli import main  # noqa: E402
from mergesmith.config import parse_config  # noqa: E402
from mergesmith.errors import ConfigError, MergeInterrupted  # noqa: E402
from mergesmith.evolve import SearchOptions, run_search  # noqa: E402
from mergesmith.evolve import scoring as scoring_mod  # noqa: E402
from mergesmith.evolve.config import GenomeDefinition  # noqa: E402
from mergesmith.evolve.genome import Genome  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "evolve"
LIMIT = 12  # records per task: enough to tell candidates apart, fast on a shared CPU


def genome_doc(**genome) -> dict:
    g = {
        "models": [str(FIXTURES / "add"), str(FIXTURES / "rev")],
        "merge_method": "task_arithmetic",
        "base_model": str(FIXTURES / "base"),
        "layer_granularity": 2,
    }
    g.update(genome)
    return {
        "genome": g,
        "tasks": [
            {"name": "addition", "type": "exact_match", "data": str(FIXTURES / "add_eval.jsonl")},
            {"name": "reverse", "type": "exact_match", "data": str(FIXTURES / "rev_eval.jsonl"), "metric": "acc,none"},
        ],
        "limit": LIMIT,
    }


def write_genome(tmp_path: Path, doc: dict, name: str = "genome.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def comparable(history: list[dict]) -> list[tuple]:
    """A history without its timings."""
    return [(r["evaluation"], r["generation"], r["index"], r["params"], json.dumps(r["config"], sort_keys=True),
             json.dumps(r["scores"], sort_keys=True), r["fitness"]) for r in history]


# -- genome -> merge config ---------------------------------------------------------------------------------


def test_genome_vector_to_merge_config():
    g = Genome.build(GenomeDefinition(**genome_doc()["genome"]), "g")
    assert g.shape == (2, 2, 1, 1) and g.dimension == 4
    x = np.array([0.5, -0.25, 1.5, 0.75])
    cfg = g.merge_config(x)
    parse_config(cfg, "candidate")  # what `mergesmith merge` runs
    assert [s["sources"][0]["layer_range"] for s in cfg["slices"]] == [[0, 2], [2, 4]]
    # weights are absolute values unless allow_negative_weights; the base joins every slice without parameters
    assert cfg["slices"][0]["sources"][1]["parameters"] == {"weight": 0.25}
    assert cfg["slices"][1]["sources"][2] == {"model": str(FIXTURES / "base"), "layer_range": [2, 4]}
    neg = Genome.build(GenomeDefinition(**genome_doc(allow_negative_weights=True)["genome"]), "g")
    assert neg.merge_config(x)["slices"][0]["sources"][1]["parameters"] == {"weight": -0.25}
    np.testing.assert_allclose(g.initial(), [0.5] * 4)


def test_genome_filters_smooth_density_and_slerp():
    ties = Genome.build(GenomeDefinition(**genome_doc(merge_method="ties", filters=["mlp"], smooth=True,
                                                      layer_granularity=1)["genome"]), "g")
    assert ties.shape == (4, 2, 2, 2)
    x = np.full(ties.shape, 0.3)
    x[..., 1] = 1.7  # density is clipped to [0, 1]
    x[:, 0, 0, 0] = [0.1, 0.2, 0.3, 0.4]  # add's weight for mlp tensors, per layer
    cfg = ties.merge_config(x.reshape(-1))
    parse_config(cfg, "candidate")
    add = cfg["models"][0]["parameters"]
    assert add["weight"][0] == {"filter": "mlp", "value": [0.1, 0.2, 0.3, 0.4]}
    assert add["density"][1] == {"value": [1.0, 1.0, 1.0, 1.0]}
    assert cfg["parameters"]["normalize"] is True and cfg["models"][2] == {"model": str(FIXTURES / "base")}
    slerp = Genome.build(GenomeDefinition(**genome_doc(merge_method="slerp", base_model=None)["genome"]), "g")
    cfg = slerp.merge_config(np.array([0.2, 0.9, 0.8, 0.1]))
    parse_config(cfg, "candidate")
    assert cfg["slices"][0]["base_model"].endswith("rev") and cfg["slices"][1]["base_model"].endswith("add")
    assert cfg["slices"][0]["parameters"]["t"] == pytest.approx(1 / (1 + np.exp(0.7)))


# -- bad genomes: one line, before the first merge --------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["genome"].update(layer_granularity=3), "layer_granularity`: 3 does not divide the models' 4"),
        (lambda d: d["tasks"].append({"name": "no_such_task_xyz"}), "task 'no_such_task_xyz': not a built-in task"),
        (lambda d: d["tasks"][0].update(metric="perplexity"), "metric 'perplexity' is not reported"),
        (lambda d: d["tasks"][0].update(data="/nonexistent/x.jsonl"), "data file not found"),
        (lambda d: d["genome"].update(merge_method="tiess"), "tiess"),
        (lambda d: d["genome"].update(base_model=None), "requires a base model"),
        (lambda d: d["genome"].update(granularity=2), "unknown key `genome.granularity`"),
    ],
)
def test_bad_genome_fails_in_one_line(tmp_path, capsys, change, expected):
    doc = genome_doc()
    change(doc)
    path = write_genome(tmp_path, doc)
    storage = tmp_path / "storage"
    with pytest.raises(SystemExit) as exc:
        main(["evolve", str(path), "--storage-path", str(storage)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not storage.exists()  # refused before anything was written


# -- the search ----------------------------------------------------------------------------------------------


def options(**kw) -> SearchOptions:
    return SearchOptions(**{"max_fevals": 6, "popsize": 3, "random_seed": 3, "sigma0": 0.3, **kw})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evolve_full")
    result = run_search(write_genome(tmp, genome_doc()), tmp / "s", options())
    return result


def test_short_search_writes_journal_and_best(uninterrupted):
    s = uninterrupted.storage
    assert len(uninterrupted.history) == 6
    assert {p.name for p in s.iterdir()} >= {"history.jsonl", "best_config.yml", "summary.json", "search.png",
                                              "optimizer.pkl", "evolve.json"}
    assert not (s / "candidate").exists()
    best = max(uninterrupted.history, key=lambda r: (r["fitness"], -r["evaluation"]))
    assert yaml.safe_load((s / "best_config.yml").read_text()) == best["config"]
    parse_config(best["config"], "best")
    summary = json.loads((s / "summary.json").read_text())
    assert summary["evaluations"] == 6 and summary["best"]["evaluation"] == best["evaluation"]
    fits = {r["fitness"] for r in uninterrupted.history}
    assert len(fits) > 1  # the candidates really differ


def test_interrupted_search_resumes_to_the_same_history(uninterrupted, tmp_path, monkeypatch):
    path = write_genome(tmp_path, genome_doc())
    real = scoring_mod.score_candidate
    calls = {"n": 0}

    def dying(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # mid second generation, after the optimiser state of the first was journaled
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(scoring_mod, "score_candidate", dying)
    with pytest.raises(MergeInterrupted):
        run_search(path, tmp_path / "s", options())
    lines = (tmp_path / "s" / "history.jsonl").read_text().splitlines()
    assert len(lines) == 4
    with open(tmp_path / "s" / "history.jsonl", "a") as f:
        f.write('{"evaluation": 5, "torn')  # a kill in the middle of an append
    monkeypatch.setattr(scoring_mod, "score_candidate", real)
    resumed = run_search(path, tmp_path / "s", options())
    assert resumed.resumed
    assert comparable(resumed.history) == comparable(uninterrupted.history)
    # a changed task list is refused unless --overwrite
    doc = genome_doc()
    doc["tasks"][1]["weight"] = 2.0
    with pytest.raises(Exception, match="different genome, tasks or options"):
        run_search(write_genome(tmp_path, doc), tmp_path / "s", options())


def test_memory_and_disk_paths_score_equally(tmp_path):
    import torch

    from mergesmith.evolve.candidates import CandidateLoader, CandidateSettings
    from mergesmith.evolve.config import load_evolve_config
    from mergesmith.evolve.evaluators import resolve_builtin
    from mergesmith.evolve.scoring import TokenizerSpec, score_candidate

    path = write_genome(tmp_path, genome_doc())
    config, _ = load_evolve_config(path)
    tasks = [resolve_builtin(t, LIMIT, "g") for t in config.tasks]
    g = Genome.build(config.genome, "g")
    candidate = g.merge_config(np.array([0.9, 0.6, 1.1, 0.4]))
    tok = TokenizerSpec(tuple(config.genome.models), config.genome.base_model, None)
    storage = tmp_path / "s"
    storage.mkdir()
    mem = CandidateSettings(str(storage), in_memory=True, threads=1)
    disk = CandidateSettings(str(storage), in_memory=False, threads=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the loads below run outside score_candidate, which sets it itself
    a = {k: v.clone() for k, v in CandidateLoader(mem).load(candidate).state_dict().items()}
    loader = CandidateLoader(disk)
    b = loader.load(candidate).state_dict()
    assert (storage / "candidate" / "config.json").is_file()
    loader.cleanup()
    assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    scores_mem, _ = score_candidate(candidate, tasks, mem, tok, 8)
    scores_disk, _ = score_candidate(candidate, tasks, disk, tok, 8)
    assert scores_mem == scores_disk
    assert list(storage.iterdir()) == []  # the on-disk candidate is removed after scoring
    torch.set_num_threads(threads)


def test_merge_best_and_cli(tmp_path, capsys):
    path = write_genome(tmp_path, genome_doc())
    out = tmp_path / "best"
    with pytest.raises(SystemExit) as exc:
        main(["evolve", str(path), "--storage-path", str(tmp_path / "s"), "--max-fevals", "2", "--popsize", "2",
              "--merge-best", str(out), "--no-in-memory", "-q"])
    assert exc.value.code == 0, capsys.readouterr().err
    assert "best fitness" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    import torch

    assert torch.isfinite(model(torch.tensor([[1, 5, 6]])).logits).all()
    assert not (tmp_path / "s" / "candidate").exists()


def test_ray_scores_the_same_history_as_local(uninterrupted, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'mergesmith[ray]')")
    path = write_genome(tmp_path, genome_doc())
    result = run_search(path, tmp_path / "s", options(executor="ray", ray_num_cpus=2))
    assert comparable(result.history) == comparable(uninterrupted.history)
    lines = [json.loads(line) for line in (tmp_path / "s" / "history.jsonl").read_text().splitlines()]
    assert [r["evaluation"] for r in lines] == list(range(1, 7))  # rewritten in evaluation order at the end


def test_kill_between_last_candidate_and_optimizer_state(uninterrupted, tmp_path, monkeypatch):
    """A kill after a generation's last candidate is journaled but before the optimiser state is: the rerun
    asks the previous state for that generation again, finds every candidate in the history, scores none."""
    from mergesmith.evolve import journal as journal_mod

    path = write_genome(tmp_path, genome_doc())
    real = journal_mod.SearchJournal.save_optimizer
    saves = {"n": 0}

    def dying(self, state):
        saves["n"] += 1
        if saves["n"] == 2:
            raise KeyboardInterrupt
        return real(self, state)

    monkeypatch.setattr(journal_mod.SearchJournal, "save_optimizer", dying)
    with pytest.raises(MergeInterrupted):
        run_search(path, tmp_path / "s", options())
    monkeypatch.setattr(journal_mod.SearchJournal, "save_optimizer", real)
    scored = {"n": 0}
    real_score = scoring_mod.score_candidate

    def counting(*args, **kw):
        scored["n"] += 1
        return real_score(*args, **kw)

    monkeypatch.setattr(scoring_mod, "score_candidate", counting)
    resumed = run_search(path, tmp_path / "s", options())
    assert scored["n"] == 0
    assert comparable(resumed.history) == comparable(uninterrupted.history)


def test_search_beats_each_parent_and_linear(tmp_path):
    """The proof's short version (the full run: examples/evolve_skills/run_proof.py): on the two skills' whole
    held-out sets, the best merge found in 32 evaluations beats each fine-tuned parent and the plain 50/50
    linear merge on the combined score by a clear margin (measured mean accuracy: 0.733 against 0.637,
    0.653 and 0.657)."""
    from mergesmith.evolve.candidates import CandidateSettings
    from mergesmith.evolve.config import load_evolve_config
    from mergesmith.evolve.evaluators import resolve_builtin
    from mergesmith.evolve.scoring import TokenizerSpec, fitness, score_candidate

    doc = genome_doc()
    del doc["limit"]  # all 150 prompts per skill: the margins below are not a small-sample accident
    path = write_genome(tmp_path, doc)
    result = run_search(path, tmp_path / "s", options(max_fevals=32, popsize=8, random_seed=0, sigma0=1 / 6))
    config, _ = load_evolve_config(path)
    tasks = [resolve_builtin(t, None, "g") for t in config.tasks]
    tok = TokenizerSpec(tuple(config.genome.models), config.genome.base_model, None)
    settings = CandidateSettings(str(tmp_path / "ref"), in_memory=True, threads=1)

    def linear(**weights):
        return {"merge_method": "linear", "dtype": "bfloat16",
                "models": [{"model": str(FIXTURES / m), "parameters": {"weight": w}} for m, w in weights.items()]}

    references = {name: fitness(tasks, score_candidate(cfg, tasks, settings, tok, 64)[0])
                  for name, cfg in (("add", linear(add=1.0)), ("rev", linear(rev=1.0)),
                                    ("linear 50/50", linear(add=0.5, rev=0.5)))}
    # fitness is the sum of the two accuracies: 0.1 here is 0.05 on their mean
    assert all(result.best["fitness"] >= score + 0.1 for score in references.values()), (
        result.best["fitness"], references)
    best = result.best["scores"]
    assert best["addition"]["acc"] > 0.5 and best["reverse"]["acc"] > 0.8  # both skills survive the merge


@pytest.mark.parametrize("kill_at", ["evolve_candidate:4", "atomic_tmp@optimizer.pkl"])
def test_sigkilled_search_resumes_to_the_same_history(uninterrupted, tmp_path, kill_at):
    """A real SIGKILL of `mergesmith evolve` (after the 4th journaled candidate; while the first optimiser state
    is half-written), then the same search again: the history is the uninterrupted one."""
    import os
    import signal
    import subprocess
    import sys

    path = write_genome(tmp_path, genome_doc())
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "MERGESMITH_TEST_KILL_AT": kill_at,
           "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mergesmith.cli", "evolve", str(path), "--storage-path", str(tmp_path / "s"),
           "--max-fevals", "6", "--popsize", "3", "--random-seed", "3", "--sigma0", "0.3", "-q"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    resumed = run_search(path, tmp_path / "s", options())
    assert resumed.resumed
    assert comparable(resumed.history) == comparable(uninterrupted.history)


def test_multiple_choice_and_loglikelihood_evaluators(tmp_path):
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergesmith.evolve.config import TaskDefinition
    from mergesmith.evolve.evaluators import resolve_builtin, score_builtin

    records = [json.loads(line) for line in (FIXTURES / "rev_eval.jsonl").read_text().splitlines()[:20]]

    def mc_file(name: str, right: bool):
        """The answer by text on even lines, by index on odd ones; the other choice is the string unreversed.
        `right=False` labels that wrong choice as the answer."""
        path = tmp_path / name
        rows = []
        for i, r in enumerate(records):
            choices = [r["prompt"][:-1], r["answer"]]
            label = 1 if right else 0
            rows.append({"prompt": r["prompt"], "choices": choices, "answer": choices[label] if i % 2 == 0 else label})
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return resolve_builtin(TaskDefinition(name=name, type="multiple_choice", data=str(path)), None, "g")

    def ll_file(name: str, reversed_: bool):
        path = tmp_path / name
        path.write_text("".join(r["prompt"] + (r["answer"] if reversed_ else r["prompt"][:-1]) + "\n"
                                for r in records))
        return resolve_builtin(TaskDefinition(name=name, type="loglikelihood", data=str(path),
                                              metric="perplexity", weight=-1), None, "g")

    tok = AutoTokenizer.from_pretrained(FIXTURES / "rev")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / "rev", dtype=torch.float32).eval()
        mc = {right: score_builtin(mc_file(f"mc{right}.jsonl", right), model, tok) for right in (True, False)}
        ll = {rev: score_builtin(ll_file(f"ll{rev}.txt", rev), model, tok, batch_size=7) for rev in (True, False)}
    finally:
        torch.set_num_threads(threads)
    # the reversal fine-tune picks the reversed string: right labels score high, flipped labels the complement
    assert mc[True]["acc"] >= 0.9 and mc[False]["acc"] == pytest.approx(1 - mc[True]["acc"])
    assert set(mc[True]) == {"acc", "acc_norm"}
    # and it finds reversed answers likelier than unreversed ones
    assert ll[True]["loglikelihood"] > ll[False]["loglikelihood"]
    assert ll[True]["perplexity"] == pytest.approx(math.exp(-ll[True]["loglikelihood"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ab>", "choices": ["ba", "ab"], "answer": "zz"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: `answer` 'zz' is not one of the choices"):
        resolve_builtin(TaskDefinition(name="b", type="multiple_choice", data=str(bad)), None, "g")
