"""Crash consistency and resume: a merge SIGKILLed at any moment, rerun until done, gives the same bytes.

Each merge runs in its own process, forked from a multiprocessing fork server that has imported
torch and mergesmith once (a fresh interpreter costs ~3 s here, a fork ~0.1 s), so dozens of kills fit
in the test budget. Kills come two ways: at exact points through the test-only hook
`MERGESMITH_TEST_KILL_AT=<event>:<n>` (between writing a file and renaming it, after a shard's rename
but before it is journaled, after an output file is removed...), and at random moments with SIGKILL
from outside. After every kill the directory must never look complete while it is not (a present
index or config.json means every shard is whole); after the final rerun it must be byte-identical to
an uninterrupted merge (every shard, the index, config.json, the tokenizer and card), with no
temporary file left behind.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import INDEX_NAME, RunControls, run_merge
from mergesmith.io.journal import STATE_DIR, STATE_TOP, Journal
from mergesmith.methods import method_names

SHARD_SIZE = "50K"  # ~220 KB of fp32 weights -> 5 shards, so kills land between and inside shards
KILLED = -9  # multiprocessing's exit code for a process ended by SIGKILL

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "mergesmith.cli",
        "mergesmith.engine.run",
        "mergesmith.methods",
        "mergesmith.display.terminal",
        "mergesmith.engine.card",
        "tests.test_resume",
    ]
)


def _cli_child(args: list[str], env: dict[str, str], log: str) -> None:
    """Body of a forked merge: output to `log`, the hook's variables set, then the real CLI entry point."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    from mergesmith.cli import main

    main(args)  # sys.exit(code) becomes the process's exit code


class Runner:
    """Runs `mergesmith merge CONFIG OUT ...` in forked processes, optionally killing them."""

    def __init__(self, config: Path, out: Path, extra: list[str], log: Path) -> None:
        self.args = ["merge", str(config), str(out), "--out-shard-size", SHARD_SIZE, "-q", *extra]
        self.journal = out / STATE_DIR / "journal.json"
        self.log = log
        self.write_phase = 0.0  # seconds from this run's first journal write to its exit

    def run(self, kill_at: str | None = None, kill_after: float | None = None) -> int:
        """Exit code of one run: 0 done, -9 killed by the hook at `kill_at`, or by SIGKILL from here
        `kill_after` seconds after the run wrote its journal (so random kills land while it writes,
        not while a fresh process is still parsing arguments and planning)."""
        env = {"MERGESMITH_TEST_KILL_AT": kill_at} if kill_at else {}
        before = self._journal_stamp()
        proc = self.start(env)
        while proc.is_alive() and self._journal_stamp() == before:
            time.sleep(0.001)
        began = time.monotonic()
        if kill_after is not None:
            proc.join(kill_after)
            if proc.is_alive():
                proc.kill()
        proc.join(120)
        self.write_phase = time.monotonic() - began
        assert proc.exitcode is not None, "merge process hung"
        return proc.exitcode

    def start(self, env: dict[str, str] | None = None) -> Any:
        """Start one run in the background; returns its multiprocessing.Process."""
        proc = _CTX.Process(target=_cli_child, args=(self.args, env or {}, str(self.log)))
        proc.start()
        return proc

    def _journal_stamp(self) -> int | None:
        try:
            return self.journal.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def _write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _top_files(out: Path) -> dict[str, bytes]:
    """Every file of the output directory except the resume state, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != STATE_TOP}


def assert_never_looks_complete_when_it_is_not(out: Path, ref: dict[str, bytes], context: str) -> None:
    """The crash-consistency invariant, checked after every kill.

    A shard under its final name is whole; an index or config.json means every shard is there and
    whole, and config.json (written last) means the whole model is there.
    """
    if not out.exists():
        return
    files = _top_files(out)
    shards = [n for n in ref if n.startswith("model") and n.endswith(".safetensors")]
    for name in files:
        if name in shards:
            assert files[name] == ref[name], f"{context}: {name} has its final name but not its final bytes"
    if INDEX_NAME in files or "config.json" in files:
        for name in shards:
            assert files.get(name) == ref[name], f"{context}: index/config.json present but {name} is not complete"
    if "config.json" in files:
        assert INDEX_NAME in files, f"{context}: config.json present without the index"
        assert files[INDEX_NAME] == ref[INDEX_NAME]
        assert files["config.json"] == ref["config.json"]


def assert_same_as_reference(out: Path, ref: dict[str, bytes], context: str) -> None:
    files = _top_files(out)
    assert sorted(files) == sorted(ref), f"{context}: files differ: {sorted(set(files) ^ set(ref))}"
    for name, data in ref.items():
        assert files[name] == data, f"{context}: {name} differs from the uninterrupted merge"
    journal = Journal.load(out)
    assert journal is not None and journal.complete and not journal.partial
    leftovers = list((out / STATE_DIR / "partial").glob("*")) if (out / STATE_DIR / "partial").exists() else []
    assert not leftovers, f"{context}: partial files left behind: {leftovers}"


@pytest.fixture(scope="module")
def linear_case(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A two-model linear merge config and the files of its uninterrupted merge."""
    root = tmp_path_factory.mktemp("resume_linear")
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    config = _write_config(
        root / "linear.yml",
        {
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.7}},
                {"model": str(b), "parameters": {"weight": 0.3}},
            ],
            "dtype": "float32",
        },
    )
    return config, _reference(config, root / "reference")


def _reference(config: Path, out: Path, seed: int | None = None) -> dict[str, bytes]:
    from mergesmith.options import parse_size

    run_merge(config, out, MergeOptions(out_shard_size=parse_size(SHARD_SIZE, "x"), threads=1, random_seed=seed))
    files = _top_files(out)
    assert sum(n.startswith("model-") for n in files) >= 4, "want several shards"
    assert INDEX_NAME in files and "config.json" in files and "tokenizer.json" in files
    return files


def _models_config(path: Path, method: str, models: list[tuple[Path, dict[str, Any]]], **top: Any) -> Path:
    config = {"merge_method": method, **top, "models": [{"model": str(m), "parameters": p} for m, p in models]}
    config["dtype"] = "float32"
    return _write_config(path, config)


def _sequence_points(ref: dict[str, bytes], threads: int) -> list[str]:
    """Kill points through a whole merge, in the order one directory reaches them when each rerun
    resumes the last one's state: from the first journal write to config.json's rename."""
    shards = sorted(n for n in ref if n.startswith("model-"))
    weight_map = json.loads(ref[INDEX_NAME])["weight_map"]
    tensors = list(weight_map)
    middle = tensors[len(tensors) // 2]
    if threads > 1:
        return [
            "tensor:10",
            "tensor:3",  # killed again while resuming a partial shard
            f"shard_renamed@{shards[-2]}",
            "atomic_done@tokenizer_config.json",
            f"atomic_tmp@{INDEX_NAME}",
            "atomic_done@config.json",
        ]
    return [
        "atomic_tmp:1",  # the first journal, not yet renamed: the directory holds only temporary state
        "atomic_done:1",  # journal written, nothing computed
        "tensor:1",  # one tensor's bytes in a partial file, not yet journaled
        f"tensor@{middle}",  # mid-shard, after earlier shards were finished and journaled
        f"shard_renamed@{weight_map[middle]}",  # a resumed partial shard renamed, not yet journaled
        "atomic_done:2",  # that shard redone and journaled
        f"shard_renamed@{shards[-1]}",
        "atomic_tmp@tokenizer.json",
        "atomic_done@README.md",
        f"atomic_tmp@{INDEX_NAME}",  # the final writes: index, then config.json, each before/after rename
        f"atomic_done@{INDEX_NAME}",
        "atomic_tmp@config.json",
        "atomic_done@config.json",  # everything written, the journal not yet marked complete
    ]


def _kill_in_sequence_then_finish(
    tmp_path: Path, config: Path, ref: dict[str, bytes], extra: list[str], points: list[str]
) -> None:
    """One directory killed at each point in turn (each run resuming the previous one's state), the
    invariant checked after every kill; then a last run completes and is compared byte for byte."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    runner = Runner(config, out, extra, tmp_path / "run.log")
    for point in points:
        code = runner.run(kill_at=point)
        assert code == KILLED, f"{point}: exit {code}, expected the hook to kill the merge\n{runner.output()}"
        assert_never_looks_complete_when_it_is_not(out, ref, f"killed at {point}")
    assert runner.run() == 0, f"final rerun failed:\n{runner.output()}"
    assert_same_as_reference(out, ref, f"resumed after kills at {points}")


def _kill_at_random_moments_then_finish(
    tmp_path: Path, config: Path, ref: dict[str, bytes], extra: list[str], seed: int, wanted: int = 10
) -> None:
    """SIGKILL from outside at random times while writing, each rerun resuming the previous one's
    directory; each kill lands uniformly within the write phase of an uninterrupted run."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    timing = Runner(config, tmp_path / "timing", extra, tmp_path / "timing.log")
    assert timing.run() == 0, timing.output()
    duration = timing.write_phase
    out = tmp_path / "out"
    runner = Runner(config, out, extra, tmp_path / "run.log")
    rng = random.Random(seed)
    kills = 0
    for attempt in range(40):
        code = runner.run(kill_after=rng.uniform(0.0, duration))
        if code == 0:  # it finished before the kill: start over, so later kills hit a merge in progress
            assert_same_as_reference(out, ref, f"attempt {attempt}")
            shutil.rmtree(out)
            continue
        assert code == KILLED, runner.output()
        kills += 1
        assert_never_looks_complete_when_it_is_not(out, ref, f"random kill {kills} (attempt {attempt})")
        if kills == wanted:
            break
    assert kills == wanted, f"only {kills} of 40 random kills landed during a merge"
    assert runner.run() == 0, runner.output()
    assert_same_as_reference(out, ref, "after random kills")


# ----- linear ---------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_killed_at_each_write_point_resumes_byte_identical(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], threads: int
) -> None:
    config, ref = linear_case
    points = _sequence_points(ref, threads)
    assert threads > 1 or len(points) >= 10
    _kill_in_sequence_then_finish(tmp_path, config, ref, ["--threads", str(threads)], points)


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_killed_at_random_moments_resumes_byte_identical(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], threads: int
) -> None:
    config, ref = linear_case
    _kill_at_random_moments_then_finish(
        tmp_path, config, ref, ["--threads", str(threads)], seed=1234 + threads, wanted=8
    )


def test_damaged_shard_is_redone_without_ever_looking_complete(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]]
) -> None:
    """A finished merge whose shard was damaged: the rerun redoes that shard only, and removes
    config.json and the index before the damaged shard, so a kill in between never leaves a directory
    that claims completeness with a shard missing."""
    config, ref = linear_case
    shards = sorted(n for n in ref if n.startswith("model-"))
    damaged = shards[2]
    pristine = tmp_path / "pristine"
    assert Runner(config, pristine, [], tmp_path / "pristine.log").run() == 0
    data = bytearray((pristine / damaged).read_bytes())
    data[-1] ^= 0xFF  # same size, last tensor byte flipped: only the checksum can tell
    (pristine / damaged).write_bytes(bytes(data))
    for point in ["unlink@config.json", f"unlink@{damaged}", None]:
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(pristine, out)
        runner = Runner(config, out, ["--threads", "1"], tmp_path / "run.log")
        if point is not None:
            assert runner.run(kill_at=point) == KILLED, f"{point}\n{runner.output()}"
            files = _top_files(out)
            if "config.json" in files or INDEX_NAME in files:
                assert all(s in files for s in shards), f"killed at {point}: config.json/index but a shard is gone"
        untouched = {s: (out / s).stat().st_mtime_ns for s in shards if s != damaged}
        log_size = len(runner.output())
        assert runner.run() == 0, runner.output()
        assert_same_as_reference(out, ref, f"damaged shard redone (kill at {point})")
        assert {s: (out / s).stat().st_mtime_ns for s in untouched} == untouched, "intact shards were rewritten"
        whole = f"({len(shards) - 1} of {len(shards)} shards whole); 1 missing or damaged shard written again"
        assert whole in runner.output()[log_size:]


def test_overwrite_killed_while_removing_a_different_merge(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], tiny_models: Any
) -> None:
    """A kill while `--overwrite` removes another merge leaves no config.json or index without all
    of its shards, and rerunning the same command finishes the new merge."""
    config, ref = linear_case
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    other = _models_config(tmp_path / "other.yml", "linear", [(a, {"weight": 0.2}), (b, {"weight": 0.8})])
    other_ref = _reference(other, tmp_path / "other_ref")
    first = tmp_path / "first"
    assert Runner(config, first, [], tmp_path / "first.log").run() == 0
    shards = sorted(n for n in ref if n.startswith("model-"))
    out = tmp_path / "out"
    for point in [f"unlink@{INDEX_NAME}", f"unlink@{shards[1]}"]:
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(first, out)
        runner = Runner(other, out, ["--overwrite"], tmp_path / "run.log")
        assert runner.run(kill_at=point) == KILLED, f"{point}\n{runner.output()}"
        # what is left is (part of) the first merge: never config.json or an index without its shards
        assert_never_looks_complete_when_it_is_not(out, ref, f"--overwrite killed at {point}")
        assert runner.run() == 0, runner.output()
        assert_same_as_reference(out, other_ref, f"--overwrite after a kill at {point}")


# ----- a randomised method --------------------------------------------------------------------

DARE = next((m for m in ("dare_ties", "dare_linear") if m in method_names()), None)
needs_dare = pytest.mark.skipif(DARE is None, reason="neither dare_ties nor dare_linear is registered yet")
DARE_SEED = 7


@pytest.fixture(scope="module")
def dare_case(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A DARE merge of two fine-tunes of one base (seeded) and the files of its uninterrupted merge."""
    assert DARE is not None
    root = tmp_path_factory.mktemp("resume_dare")
    base = tiny_models("llama", seed=1)
    tuned = [_fine_tune(base, root / f"tuned{s}", seed=s) for s in (11, 12)]
    config = _models_config(
        root / "dare.yml",
        DARE,
        [(t, {"weight": 0.5, "density": 0.5}) for t in tuned],
        base_model=str(base),
    )
    return config, _reference(config, root / "reference", seed=DARE_SEED)


def _fine_tune(base: Path, out: Path, seed: int) -> Path:
    """A copy of `base` with small seeded noise on every float tensor: a cheap fine-tune sharing its base."""
    shutil.copytree(base, out)
    weights = out / "model.safetensors"
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        n: t + 0.01 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for n, t in load_file(weights).items()
    }
    save_file(tensors, weights, metadata={"format": "pt"})
    return out


@needs_dare
def test_dare_killed_at_write_points_and_random_moments_resumes_byte_identical(
    tmp_path: Path, dare_case: tuple[Path, dict[str, bytes]]
) -> None:
    """The seeded randomised method resumes to the same bytes: each tensor's drop mask comes from the
    seed and its name, never from what ran before it in the process."""
    config, ref = dare_case
    extra = ["--random-seed", str(DARE_SEED), "--threads", "2"]
    _kill_in_sequence_then_finish(tmp_path / "points", config, ref, extra, _sequence_points(ref, threads=2))
    _kill_at_random_moments_then_finish(tmp_path / "random", config, ref, extra, seed=99, wanted=6)


@needs_dare
def test_dare_without_a_seed_resumes_with_the_journaled_seed(
    tmp_path: Path, dare_case: tuple[Path, dict[str, bytes]]
) -> None:
    """No --random-seed: the interrupted run's drawn seed is journaled and reused, so the resumed
    output equals an uninterrupted merge with that seed (a fresh seed would mix two random draws)."""
    config, _ref = dare_case
    out = tmp_path / "out"
    runner = Runner(config, out, ["--threads", "1"], tmp_path / "run.log")
    assert runner.run(kill_at="tensor:12") == KILLED
    journal = Journal.load(out)
    assert journal is not None and journal.random_seed is not None
    assert runner.run() == 0, runner.output()
    assert_same_as_reference(out, _reference(config, tmp_path / "ref", seed=journal.random_seed), "seedless resume")


# ----- what a rerun accepts, skips and refuses (in-process CLI) ----------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    from mergesmith.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def test_rerun_of_a_complete_merge_verifies_and_changes_nothing(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, ref = linear_case
    out = tmp_path / "out"
    assert _cli(capsys, "merge", config, out, "--out-shard-size", SHARD_SIZE)[0] == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, stdout, err = _cli(capsys, "merge", config, out, "--out-shard-size", SHARD_SIZE)
    assert code == 0, err
    assert "already complete" in stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert_same_as_reference(out, ref, "rerun of a complete merge")


def test_different_config_is_refused_unless_overwrite(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, ref = linear_case
    out = tmp_path / "out"
    shutil.copytree(config.parent / "reference", out)
    before = _top_files(out)
    # same models, other shard size: a different plan, so a different fingerprint
    code, _, err = _cli(capsys, "merge", config, out, "--out-shard-size", "80K")
    assert code == 2
    assert err.strip() == (
        f"error: {out}: holds a merge with a different config or inputs; use --overwrite to replace it"
    )
    assert _top_files(out) == before, "a refused run must not touch the directory"
    code, _, err = _cli(capsys, "merge", config, out, "--out-shard-size", "80K", "--overwrite", "-q")
    assert code == 0, err
    assert _top_files(out) != before
    code, _, _ = _cli(capsys, "merge", config, out, "--out-shard-size", SHARD_SIZE, "--overwrite", "-q")
    assert code == 0
    assert_same_as_reference(out, ref, "overwritten back")


def test_changed_input_model_is_refused(tmp_path: Path, tiny_models: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The fingerprint covers the inputs (size, mtime, header): a model changed since the interrupted
    run must not be resumed into shards computed from its old weights."""
    a = tmp_path / "a"
    shutil.copytree(tiny_models("llama", seed=1), a)
    b = tiny_models("llama", seed=2)
    config = _models_config(tmp_path / "m.yml", "linear", [(a, {"weight": 1.0}), (b, {"weight": 1.0})])
    out = tmp_path / "out"
    assert _cli(capsys, "merge", config, out, "-q")[0] == 0
    tensors = load_file(a / "model.safetensors")
    tensors["model.norm.weight"] += 1
    save_file(tensors, a / "model.safetensors", metadata={"format": "pt"})
    code, _, err = _cli(capsys, "merge", config, out)
    assert code == 2 and "holds a merge with a different config or inputs" in err


def test_non_empty_directory_is_refused_and_overwrite_spares_foreign_files(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, ref = linear_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    code, _, err = _cli(capsys, "merge", config, out, "--out-shard-size", SHARD_SIZE)
    assert (
        code == 2 and err.strip() == f"error: {out}: directory is not empty; use --overwrite to replace its model files"
    )
    assert (out / "config.json").read_text() == "{}"
    code, _, err = _cli(capsys, "merge", config, out, "--out-shard-size", SHARD_SIZE, "--overwrite", "-q")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "config.json").read_bytes() == ref["config.json"]


def test_second_merge_into_a_directory_being_written_is_refused(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]]
) -> None:
    """Two runs of the same command at once (a second terminal, a scheduler's retry) would both
    reopen the same partial files by name, one truncating what the other already wrote and vouched
    for, so a second writer is refused while the first holds the directory; the first finishes."""
    config, ref = linear_case
    out = tmp_path / "out"
    first = Runner(config, out, ["--threads", "1"], tmp_path / "first.log")
    proc = first.start({"MERGESMITH_TEST_SLOW": "0.05"})  # ~2 s of merging
    deadline = time.monotonic() + 60
    while not (out / STATE_DIR / "journal.json").exists():
        assert proc.is_alive() and time.monotonic() < deadline, first.output()
        time.sleep(0.01)
    second = Runner(config, out, ["--threads", "1"], tmp_path / "second.log")
    assert second.run() == 2, second.output()
    assert "another mergesmith process is writing to this directory" in second.output()
    assert proc.is_alive(), "the first run must still be merging for this test to mean anything"
    proc.join(120)
    assert proc.exitcode == 0, first.output()
    assert_same_as_reference(out, ref, "first run after a refused second one")


# ----- a rerun of a complete merge trusts size and mtime, not a re-read ---------------------------


def _count_checksums(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the shards whose bytes `_verify_finished` reads (via file_checksum)."""
    import mergesmith.engine.run as api

    calls: list[str] = []
    real = api.file_checksum

    def counting(path: Path) -> str:
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(api, "file_checksum", counting)
    return calls


def _complete_copy(linear_case: tuple[Path, dict[str, bytes]], out: Path) -> list[str]:
    from mergesmith.options import parse_size

    config, _ref = linear_case
    run_merge(config, out, MergeOptions(out_shard_size=parse_size(SHARD_SIZE, "x"), threads=1))
    return sorted(p.name for p in out.glob("model-*.safetensors"))


def _rerun(linear_case: tuple[Path, dict[str, bytes]], out: Path, verify: bool = False) -> Any:
    from mergesmith.options import parse_size

    options = MergeOptions(out_shard_size=parse_size(SHARD_SIZE, "x"))
    return run_merge(linear_case[0], out, options, controls=RunControls(verify=verify))


def test_rerun_of_a_complete_merge_reads_no_shard_bytes(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    shards = _complete_copy(linear_case, out)
    journal = Journal.load(out)
    assert journal is not None and all("mtime_ns" in journal.finished[s] for s in shards)
    calls = _count_checksums(monkeypatch)
    result = _rerun(linear_case, out)
    assert result.already_complete and calls == []
    # --verify (verify=True) reads every shard, and still changes nothing
    result = _rerun(linear_case, out, verify=True)
    assert result.already_complete and sorted(calls) == shards
    assert_same_as_reference(out, linear_case[1], "verified rerun")


@pytest.mark.parametrize("change", ["mtime", "size", "bytes"])
def test_a_shard_changed_since_completion_is_detected(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    out = tmp_path / "out"
    shards = _complete_copy(linear_case, out)
    victim = out / shards[1]
    st = victim.stat()
    if change == "mtime":  # touched, same bytes: verified in full, kept, and trusted again afterwards
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    elif change == "size":  # a byte appended
        with open(victim, "ab") as f:
            f.write(b"\0")
    else:  # same size, one data byte flipped (the write moves the mtime)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    calls = _count_checksums(monkeypatch)
    result = _rerun(linear_case, out)
    checked = [s for s in shards if s != victim.name] if change == "size" else shards  # a size mismatch needs no read
    assert sorted(calls) == checked, "a changed shard must make the rerun verify every shard"
    if change == "mtime":
        assert result.already_complete
    else:
        assert not result.already_complete and result.shards_reused == len(shards) - 1
    assert_same_as_reference(out, linear_case[1], f"after a {change} change")
    calls.clear()
    assert _rerun(linear_case, out).already_complete and calls == []  # the new mtimes are trusted


def test_cli_verify_flag_checksums_a_complete_output(
    tmp_path: Path, linear_case: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mergesmith.cli import main

    out = tmp_path / "out"
    shards = _complete_copy(linear_case, out)
    calls = _count_checksums(monkeypatch)
    for extra, expected in (([], []), (["--verify"], shards)):
        calls.clear()
        with pytest.raises(SystemExit) as exit_:
            main(["merge", str(linear_case[0]), str(out), "-q", "--out-shard-size", SHARD_SIZE, *extra])
        assert exit_.value.code in (0, None)
        assert sorted(calls) == expected
