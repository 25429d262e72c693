"""Issue 29, items 6 and 8: a finished output directory is fit to publish, and every resume is reported.

- What `huggingface-cli upload` / `HfApi.upload_folder` would publish from a finished merge is computed with
  huggingface_hub's own filter (`filter_repo_objects` over DEFAULT_IGNORE_PATTERNS, on the folder listing
  upload_folder makes): exactly the model (config.json, generation config, shards and index, tokenizer),
  README.md and mergekit_config.yml; the journal is not in it, nor in what `git add` would stage.
- The card's metadata, read by huggingface_hub's ModelCard, says `base_model_relation: merge` and carries the
  `merge` tag beside `mergesmith`.
- A merge interrupted inside its only shard (journaled tensors, no whole shard: the case that used to say
  nothing) reports `resumed: N of M tensors already written` with the journal's N, through the CLI and the
  API (the result's `tensors_reused`, the printed line with progress=True, the `mergesmith` logger); `multi`
  per stage; `moe` and `tokensurgeon` through their own commands; `merge-raw` through the API.
- A journal an older version left in `.mergesmith/` is adopted: the merge it started resumes, and nothing of
  it is left where an upload would take it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

import mergesmith
from mergesmith.engine.card import front_matter
from mergesmith.engine.execution.local_executor import ProgressEvent
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import RunControls, build_plan, run_merge
from mergesmith.errors import MergeInterrupted
from mergesmith.io.journal import LEGACY_STATE_DIR, STATE_DIR, STATE_TOP, Journal
from tests.helpers import run_cli

SHARD = "60K"


@pytest.fixture(scope="module")
def models(tiny_models: Any) -> tuple[Path, Path]:
    return tiny_models("llama", seed=1), tiny_models("llama", seed=2)


def _config(path: Path, a: Path, b: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [{"model": str(a), "parameters": {"weight": 0.6}}, {"model": str(b), "parameters": {}}],
                "parameters": {"weight": 0.4},
                "dtype": "float32",
            }
        )
    )
    return path


def _uploaded(folder: Path) -> set[str]:
    """What upload_folder sends: every file under the folder, relative, through the Hub client's own filter."""
    listing = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*")) if p.is_file()]
    return set(filter_repo_objects(listing, ignore_patterns=list(DEFAULT_IGNORE_PATTERNS)))


def _model_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP}


def _interrupt(config: Path, out: Path, after: int, shard_size: int | None = None) -> Journal:
    """Stop a merge once `after` tensors are done (the API side of Ctrl-C) and return its journal."""
    stop = threading.Event()

    def on_progress(event: ProgressEvent) -> None:
        if event.tensors_done >= after:
            stop.set()

    options = MergeOptions(threads=1, out_shard_size=shard_size) if shard_size else MergeOptions(threads=1)
    with pytest.raises(MergeInterrupted):
        run_merge(config, out, options, controls=RunControls(on_progress=on_progress, stop=stop))
    journal = Journal.load(out)
    assert journal is not None
    return journal


# ----- item 8: what the directory holds ---------------------------------------------------------------


def test_upload_takes_the_model_and_its_card_and_config_and_never_the_journal(
    tmp_path: Path, capsys: Any, models: Any
) -> None:
    a, _b = models
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", _config(tmp_path / "c.yml", *models), out, "--out-shard-size", SHARD, "-q")
    assert code == 0, err
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1, "the merge is sharded, so the index is among the files"
    tokenizer = {p.name for p in a.iterdir() if p.name.startswith("tokenizer")}
    assert tokenizer, "the tiny model has tokenizer files to copy"
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        *shards,
        *tokenizer,
        "README.md",
        "mergekit_config.yml",
    }
    assert _uploaded(out) == expected
    # everything else is mergesmith's state, under the one folder the Hub client skips (and refuses: `.cache/`)
    everything = {p.relative_to(out).as_posix() for p in out.glob("**/*") if p.is_file()}
    assert all(
        name.startswith(f"{STATE_DIR}/") or name == ".cache/huggingface/.gitignore" for name in everything - expected
    )
    assert (out / STATE_DIR / "journal.json").is_file(), "the journal stays: a rerun trusts it"
    assert not list(out.glob("**/*.tmp")) and not list(out.glob("**/*.partial"))
    assert yaml.safe_load((out / "mergekit_config.yml").read_text())["merge_method"] == "linear"
    assert not (out / "mergesmith_config.yml").exists() and not (out / LEGACY_STATE_DIR).exists()

    # a rerun of the complete merge still finds it complete
    code, stdout, err = run_cli(capsys, "merge", tmp_path / "c.yml", out, "--out-shard-size", SHARD, "-q")
    assert code == 0 and "already complete" in stdout, err


def test_git_add_skips_the_journal_too(tmp_path: Path, capsys: Any, models: Any) -> None:
    """A model repository cloned with git and merged into: `git add -A` stages no state file (the
    `.gitignore` the Hub client itself writes in `.cache/huggingface/`)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", _config(tmp_path / "c.yml", *models), out, "-q")
    assert code == 0, err
    subprocess.run([git, "init", "-q", str(out)], check=True)
    staged = subprocess.run(
        [git, "-C", str(out), "add", "-A", "--dry-run"], check=True, capture_output=True, text=True
    ).stdout
    assert "README.md" in staged and "model.safetensors" in staged
    assert ".cache" not in staged and "journal" not in staged


def test_model_card_metadata_says_merge(tmp_path: Path, capsys: Any, models: Any) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", _config(tmp_path / "c.yml", *models), out, "-q")
    assert code == 0, err
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model_relation == "merge"
    assert {"merge", "mergesmith"} <= set(card.data.tags)
    assert card.data.base_model is None, "local inputs are no Hub ids"

    # with Hub ids among the inputs, they are the card's base_model (local paths never are)
    front = yaml.safe_load(
        front_matter(["mistralai/Mistral-7B-v0.1", str(models[0]), "org/b@v2"], ["mergesmith", "moe"]).strip("-\n")
    )
    assert front["base_model"] == ["mistralai/Mistral-7B-v0.1", "org/b"]
    assert front["base_model_relation"] == "merge"
    assert front["tags"] == ["mergesmith", "moe", "merge"]


# ----- item 6: every resume is reported -------------------------------------------------------------


def test_resume_inside_a_shard_is_reported_by_the_cli(tmp_path: Path, capsys: Any, models: Any) -> None:
    """One shard, stopped part way: no whole shard is reused, only the tensors journaled inside it."""
    config = _config(tmp_path / "c.yml", *models)
    run_merge(config, tmp_path / "ref", MergeOptions(threads=1))
    out = tmp_path / "out"
    journal = _interrupt(config, out, after=9)
    assert not journal.finished and len(journal.partial) == 1
    reused = len(next(iter(journal.partial.values())))
    assert reused >= 9
    total = len(build_plan(config, MergeOptions(), out)[0].recipes)
    code, stdout, err = run_cli(capsys, "merge", config, out, "--threads", "1", "-q")
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == f"resumed: {reused} of {total} tensors already written", stdout
    assert lines[1].startswith(f"wrote {out} ")
    assert _model_files(out) == _model_files(tmp_path / "ref")

    # a fresh merge says nothing of the kind
    code, stdout, err = run_cli(capsys, "merge", config, tmp_path / "fresh", "-q")
    assert code == 0 and "resumed" not in stdout, err


def test_resume_is_reported_by_the_api(
    tmp_path: Path, capsys: Any, caplog: pytest.LogCaptureFixture, models: Any
) -> None:
    config = _config(tmp_path / "c.yml", *models)
    out = tmp_path / "out"
    journal = _interrupt(config, out, after=5, shard_size=60_000)
    whole = len(journal.finished)
    plan = build_plan(config, MergeOptions(out_shard_size=60_000), out)[0]
    reused = sum(len(s.recipes) for s in plan.shards if s.filename in journal.finished)
    reused += sum(len(t) for t in journal.partial.values())
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="mergesmith"):
        result = mergesmith.merge(config, out, out_shard_size="60K", threads=1, progress=True)
    printed = capsys.readouterr().out.splitlines()
    assert result.resumed and result.tensors_reused == reused and result.shards_reused == whole
    line = f"resumed: {reused} of {len(plan.recipes)} tensors already written"
    if whole:
        line += f" ({whole} of {len(plan.shards)} shards whole)"
    assert result.resume_line() == line
    assert printed[-2] == line and printed[-1].startswith("model written to "), printed
    assert " KB) in " in printed[-1] and "0.00 GB" not in printed[-1], "a small merge's size in a unit that fits it"
    assert line in caplog.messages

    again = mergesmith.merge(config, out, out_shard_size="60K", threads=1)
    assert again.already_complete and not again.resumed and again.resume_line() is None


def test_multi_reports_the_resume_of_each_stage(tmp_path: Path, capsys: Any, models: Any) -> None:
    a, b = models
    stage = {"merge_method": "linear", "dtype": "float32", "parameters": {"weight": 0.5}}
    first = {**stage, "name": "first", "models": [{"model": str(a)}, {"model": str(b)}]}
    final = {**stage, "models": [{"model": "first"}, {"model": str(b)}]}
    config = tmp_path / "multi.yml"
    config.write_text(yaml.safe_dump_all([first, final]))
    out = tmp_path / "stages"
    stop = threading.Event()

    def on_progress(event: ProgressEvent) -> None:
        if event.tensors_done >= 7:
            stop.set()

    with pytest.raises(MergeInterrupted):  # the first stage stopped part way
        mergesmith.multi(config, out, out_path=tmp_path / "final", threads=1, progress=on_progress, stop=stop)
    journal = Journal.load(out / "first")
    assert journal is not None and not journal.complete
    reused = sum(len(t) for t in journal.partial.values())
    total = len(build_plan(_config(tmp_path / "first.yml", a, b), MergeOptions(), tmp_path / "x")[0].recipes)
    code, stdout, err = run_cli(
        capsys, "multi", config, "--out-dir", out, "--out-path", tmp_path / "final", "--threads", "1", "-q"
    )
    assert code == 0, err
    assert f"first: resumed: {reused} of {total} tensors already written" in stdout.splitlines(), stdout
    assert sum("resumed" in line for line in stdout.splitlines()) == 1, "the final stage started afresh"


def test_raw_merge_resume_is_reported(tmp_path: Path, models: Any) -> None:
    """merge-raw goes through the same result: `tensors_reused` counts the journaled tensors."""
    from safetensors.torch import load_file, save_file

    files = []
    for i, model in enumerate(models):
        path = tmp_path / f"m{i}.safetensors"
        save_file(load_file(model / "model.safetensors"), path)
        files.append(path)
    config = tmp_path / "raw.yml"
    config.write_text(
        yaml.safe_dump(
            {"merge_method": "linear", "models": [{"model": str(f), "parameters": {"weight": 0.5}} for f in files]}
        )
    )
    from mergesmith.raw.merge import run_raw_merge

    out = tmp_path / "out"
    stop = threading.Event()

    def on_progress(event: ProgressEvent) -> None:
        if event.tensors_done >= 6:
            stop.set()

    with pytest.raises(MergeInterrupted):
        run_raw_merge(config, out, MergeOptions(threads=1), controls=RunControls(on_progress=on_progress, stop=stop))
    journal = Journal.load(out)
    assert journal is not None
    reused = sum(len(t) for t in journal.partial.values())
    result = mergesmith.merge_raw(config, out, threads=1)
    assert result.resumed and result.tensors_reused == reused >= 6
    assert result.resume_line().startswith(f"resumed: {reused} of {len(result.plan.recipes)} tensors")


# ----- an older version's journal ------------------------------------------------------------------


def test_older_versions_journal_is_adopted_and_the_merge_resumes(tmp_path: Path, capsys: Any, models: Any) -> None:
    config = _config(tmp_path / "c.yml", *models)
    run_merge(config, tmp_path / "ref", MergeOptions(threads=1, out_shard_size=60_000))
    out = tmp_path / "out"
    journal = _interrupt(config, out, after=8, shard_size=60_000)
    # lay the state out as versions before this one did: <out>/.mergesmith/{journal.json,lock,partial/}
    (out / STATE_DIR).rename(out / LEGACY_STATE_DIR)
    shutil.rmtree(out / STATE_TOP)
    assert Journal.load(out) is not None, "the legacy journal is read where it is"
    plan = build_plan(config, MergeOptions(out_shard_size=60_000), out)[0]
    reused = sum(len(s.recipes) for s in plan.shards if s.filename in journal.finished)
    reused += sum(len(t) for t in journal.partial.values())
    code, stdout, err = run_cli(capsys, "merge", config, out, "--out-shard-size", SHARD, "--threads", "1", "-q")
    assert code == 0, err
    assert stdout.startswith(f"resumed: {reused} of {len(plan.recipes)} tensors already written"), stdout
    assert not (out / LEGACY_STATE_DIR).exists()
    assert (out / STATE_DIR / "journal.json").is_file()
    assert _model_files(out) == _model_files(tmp_path / "ref")
    assert STATE_TOP not in {name.split("/")[0] for name in _uploaded(out)}


def _stopper(after: int) -> tuple[threading.Event, Any]:
    stop = threading.Event()

    def on_progress(event: ProgressEvent) -> None:
        if event.tensors_done >= after:
            stop.set()

    return stop, on_progress


def test_moe_resume_is_reported_by_the_cli(tmp_path: Path, capsys: Any, tiny_models: Any) -> None:
    from mergesmith.moe import run_moe

    experts = [tiny_models("llama", seed=s) for s in (1, 2)]
    config = tmp_path / "moe.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "base_model": str(experts[0]),
                "gate_mode": "random",
                "experts": [{"source_model": str(m)} for m in experts],
            }
        )
    )
    out = tmp_path / "out"
    stop, on_progress = _stopper(10)
    options = MergeOptions(threads=1, out_shard_size=60_000, random_seed=3)
    with pytest.raises(MergeInterrupted):
        run_moe(config, out, options, controls=RunControls(on_progress=on_progress, stop=stop))
    journal = Journal.load(out)
    assert journal is not None
    args = ("--out-shard-size", SHARD, "--threads", "1", "--random-seed", "3", "-q")
    code, stdout, err = run_cli(capsys, "moe", config, out, *args)
    assert code == 0, err
    first = stdout.splitlines()[0]
    assert first.startswith("resumed: ") and " tensors already written" in first, stdout
    reused = int(first.split()[1])
    assert reused >= 10 and reused >= sum(len(t) for t in journal.partial.values())
    assert (out / "mergekit_moe_config.yml").is_file() and not (out / "mergekit_config.yml").exists()
    assert ModelCard.load(out / "README.md").data.base_model_relation == "merge"


def test_tokensurgeon_resume_is_reported_by_the_cli(tmp_path: Path, capsys: Any) -> None:
    from mergesmith.tokensurgeon import SurgeryOptions, run_tokensurgeon

    fixture = Path(__file__).parent / "fixtures" / "tokensurgeon"
    out = tmp_path / "out"
    stop, on_progress = _stopper(3)
    with pytest.raises(MergeInterrupted):
        run_tokensurgeon(
            fixture / "base",
            fixture / "donor",
            out,
            SurgeryOptions(k=16),
            MergeOptions(threads=1, out_shard_size=20_000),
            controls=RunControls(on_progress=on_progress, stop=stop),
        )
    journal = Journal.load(out)
    assert journal is not None
    reused = sum(len(t) for t in journal.partial.values())
    args = ("--k", "16", "--out-shard-size", "20K", "--threads", "1", "-q")
    code, stdout, err = run_cli(capsys, "tokensurgeon", fixture / "base", fixture / "donor", out, *args)
    assert code == 0, err
    first = stdout.splitlines()[0]
    assert first.startswith("resumed: ") and " tensors already written" in first, stdout
    assert int(first.split()[1]) >= max(reused, 3)
    assert (out / "mergesmith_config.yml").is_file(), "tokensurgeon's record is no mergekit config"


def test_an_older_version_still_writing_is_not_robbed_of_its_files(tmp_path: Path, capsys: Any, models: Any) -> None:
    """An older mergesmith holding `.mergesmith/lock` (its flock) while this one starts in the same directory:
    refused in one line, its journal and partial files left where it writes them."""
    import fcntl
    import os

    from tests.helpers import assert_one_line_error

    config = _config(tmp_path / "c.yml", *models)
    out = tmp_path / "out"
    _interrupt(config, out, after=6)
    (out / STATE_DIR).rename(out / LEGACY_STATE_DIR)
    shutil.rmtree(out / STATE_TOP)
    before = sorted(p.relative_to(out).as_posix() for p in (out / LEGACY_STATE_DIR).glob("**/*"))
    fd = os.open(out / LEGACY_STATE_DIR / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = run_cli(capsys, "merge", config, out, "--threads", "1", "-q")
    finally:
        os.close(fd)
    assert_one_line_error(code, err, "older version", "another mergesmith process")
    assert sorted(p.relative_to(out).as_posix() for p in (out / LEGACY_STATE_DIR).glob("**/*")) == before
    assert not (out / "config.json").exists()
