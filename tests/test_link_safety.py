"""Never write or delete through a link (issue 17): one test per planted link.

Each test plants a symbolic link where mergesmith writes, cleans or descends (inside the output
directory, a `multi` stage directory, the Ray executor's shard files, the MoE router cache, the
import-list cache, the tokenizer staging directory) pointing at a "victim" outside, runs the real
code path, and checks that the victim is untouched and that the link was either replaced by our own
file (when the name is ours to replace) or refused with one `error:` line, exit 2.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergesmith.io import safe_fs
from mergesmith.io.journal import STATE_DIR
from tests.helpers import assert_one_line_error, run_cli

VICTIM_BYTES = b"precious data, not mergesmith's\n"


@pytest.fixture(scope="module")
def models(tiny_models: Any) -> tuple[Path, Path]:
    return tiny_models("llama", seed=1), tiny_models("llama", seed=2)


def _config(path: Path, a: Path, b: Path, weight: float = 0.7) -> Path:
    config = {
        "merge_method": "linear",
        "models": [
            {"model": str(a), "parameters": {"weight": weight}},
            {"model": str(b), "parameters": {"weight": 1 - weight}},
        ],
        "dtype": "float32",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victim = outside / name
    victim.write_bytes(VICTIM_BYTES)
    return victim


def _merge(capsys: Any, config: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(capsys, "merge", config, out, "-q", "--threads", "1", *extra)


def _assert_regular(path: Path) -> None:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode), f"{path} is not a regular file (mode {st.st_mode:o})"


def _assert_complete(out: Path) -> None:
    _assert_regular(out / "config.json")
    _assert_regular(out / "model.safetensors")
    assert load_file(out / "model.safetensors")


# ----- the output directory -----------------------------------------------------------------------


def test_partial_shard_link_is_replaced_not_written_through(tmp_path: Path, capsys: Any, models: Any) -> None:
    """A link at `<state>/partial/<shard>.partial` (no --overwrite needed): the outside file keeps
    its bytes and the finished shard is our own regular file, not a link to it."""
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    (out / STATE_DIR / "partial").mkdir(parents=True)
    (out / STATE_DIR / "partial" / "model.safetensors.partial").symlink_to(victim)
    code, _, err = _merge(capsys, _config(tmp_path / "c.yml", *models), out)
    assert code == 0, err
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_complete(out)


@pytest.mark.parametrize(
    "where",
    [f"{STATE_DIR}/.journal.json.tmp", ".config.json.tmp", ".README.md.tmp", ".mergekit_config.yml.tmp"],
)
def test_temporary_file_link_is_replaced_not_written_through(
    tmp_path: Path, capsys: Any, models: Any, where: str
) -> None:
    """Links at the temporary names of the journal, config.json, the model card: our file is written
    (with `--overwrite` where the link makes the directory non-empty), the outside one keeps its bytes."""
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)
    (out / where).symlink_to(victim)
    extra = () if where.startswith(f"{STATE_DIR}/") else ("--overwrite",)
    code, _, err = _merge(capsys, _config(tmp_path / "c.yml", *models), out, *extra)
    assert code == 0, err
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_complete(out)


def test_dangling_temporary_link_creates_nothing_outside(tmp_path: Path, capsys: Any, models: Any) -> None:
    """A dangling link at the journal's temporary name would make an O_CREAT open create the file
    wherever it points."""
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)
    (out / STATE_DIR / ".journal.json.tmp").symlink_to(outside / "planted")
    (out / STATE_DIR / "lock").symlink_to(outside / "planted-lock")
    code, _, err = _merge(capsys, _config(tmp_path / "c.yml", *models), out)
    assert code == 0, err
    assert list(outside.iterdir()) == []
    _assert_regular(out / STATE_DIR / "lock")
    _assert_complete(out)


@pytest.mark.parametrize("where", [".cache", ".cache/huggingface", STATE_DIR])
def test_state_directory_link_with_overwrite_deletes_nothing_outside(
    tmp_path: Path, capsys: Any, models: Any, where: str
) -> None:
    """The state directory, or a directory on its way, a link to a directory outside, then `--overwrite`:
    refused in one line, and every file of that directory is still there."""
    victim = _victim(tmp_path)
    (victim.parent / "journal.json").write_text("{}")
    out = tmp_path / "out"
    (out / where).parent.mkdir(parents=True)
    (out / where).symlink_to(victim.parent, target_is_directory=True)
    code, _, err = _merge(capsys, _config(tmp_path / "c.yml", *models), out, "--overwrite")
    assert_one_line_error(code, err, where, "symbolic link")
    assert sorted(p.name for p in victim.parent.iterdir()) == ["journal.json", "victim.txt"]
    assert victim.read_bytes() == VICTIM_BYTES
    assert not (out / "config.json").exists()


def test_legacy_state_directory_link_is_never_followed(tmp_path: Path, capsys: Any, models: Any) -> None:
    """`.mergesmith` (where earlier versions kept the journal) a link to a directory outside: it is not read
    as a journal nor adopted; the directory counts as not empty, and `--overwrite` removes the link itself."""
    victim = _victim(tmp_path)
    (victim.parent / "journal.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mergesmith").symlink_to(victim.parent, target_is_directory=True)
    config = _config(tmp_path / "c.yml", *models)
    code, _, err = _merge(capsys, config, out)
    assert_one_line_error(code, err, "not empty", "--overwrite")
    code, _, err = _merge(capsys, config, out, "--overwrite")
    assert code == 0, err
    assert not os.path.lexists(out / ".mergesmith")
    assert sorted(p.name for p in victim.parent.iterdir()) == ["journal.json", "victim.txt"]
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_complete(out)


def test_partial_directory_link_is_refused_or_removed(tmp_path: Path, capsys: Any, models: Any) -> None:
    """`<state>/partial` a link: without --overwrite refused in one line; `--overwrite` removes the
    link itself (it is inside our state directory) and merges. The outside directory is untouched."""
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)
    (out / STATE_DIR / "partial").symlink_to(victim.parent, target_is_directory=True)
    config = _config(tmp_path / "c.yml", *models)
    code, _, err = _merge(capsys, config, out)
    assert_one_line_error(code, err, "partial", "symbolic link")
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
    code, _, err = _merge(capsys, config, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
    assert victim.read_bytes() == VICTIM_BYTES
    assert not (out / STATE_DIR / "partial").is_symlink()
    _assert_complete(out)


def test_finished_shard_replaced_by_a_link_is_rewritten(tmp_path: Path, capsys: Any, models: Any) -> None:
    """A copied output directory whose shard is now a link to a copy elsewhere (same bytes, same
    mtime): the rerun does not keep the link as a finished shard, it writes its own file."""
    out = tmp_path / "out"
    config = _config(tmp_path / "c.yml", *models)
    code, _, err = _merge(capsys, config, out)
    assert code == 0, err
    outside = tmp_path / "outside"
    outside.mkdir()
    copy = outside / "model.safetensors"
    copy.write_bytes((out / "model.safetensors").read_bytes())
    st = os.stat(out / "model.safetensors")
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(copy)
    code, _, err = _merge(capsys, config, out)
    assert code == 0, err
    _assert_complete(out)
    assert copy.read_bytes() == (out / "model.safetensors").read_bytes()


# ----- the writer and the Ray executor's shard task -------------------------------------------------


def test_shard_writer_never_writes_through_its_partial_link(tmp_path: Path) -> None:
    """The unit every executor shares: a link at the partial name is removed, the victim untouched,
    the finished file regular; a link among the directories below `root` is refused."""
    from mergesmith.io.safetensors_writer import ShardWriter

    victim = _victim(tmp_path)
    out = tmp_path / "out"
    (out / "state").mkdir(parents=True)
    (out / "state" / "x.partial").symlink_to(victim)
    writer = ShardWriter(out / "x.safetensors", out / "state" / "x.partial", [("a", "F32", (2,))], root=out)
    writer.write("a", torch.ones(2))
    writer.finish()
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_regular(out / "x.safetensors")
    assert load_file(out / "x.safetensors")["a"].tolist() == [1.0, 1.0]

    (out / "linked").symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(safe_fs.LinkError, match="linked"):
        ShardWriter(out / "y.safetensors", out / "linked" / "y.partial", [("a", "F32", (2,))], root=out)
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_ray_shard_task_never_writes_through_a_link(tmp_path: Path, models: Any) -> None:
    """The body of the Ray executor's shard task (run in-process here; on a cluster it runs the same
    code on a worker, against the shared filesystem)."""
    pytest.importorskip("ray")
    from mergesmith.engine.execution.ray_executor import _input_path, write_shard
    from mergesmith.engine.planning.shared import MergeOptions
    from mergesmith.engine.run import build_plan

    victim = _victim(tmp_path)
    out = tmp_path / "out"
    plan, checkpoints = build_plan(_config(tmp_path / "c.yml", *models), MergeOptions(threads=1), out)
    shard = plan.shards[0].filename
    (out / STATE_DIR / "partial").mkdir(parents=True)
    (out / STATE_DIR / "partial" / f"{shard}.partial").symlink_to(victim)
    paths = {ref: _input_path(ckpt) for ref, ckpt in checkpoints.items()}
    record = write_shard(plan, 0, str(out), paths, None, 1, None, "cpu")
    assert record["size"] == (out / shard).stat().st_size
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_regular(out / shard)


# ----- multi-stage directories ----------------------------------------------------------------------


def test_multi_stage_directory_link_is_refused(tmp_path: Path, capsys: Any, models: Any) -> None:
    """`<out-dir>/<stage>` a link to a directory holding an older mergesmith merge (which a changed
    stage replaces): refused in one line naming the stage; the merge there is left as it was."""
    a, b = models

    def multi(path: Path, weight: float) -> Path:
        doc = yaml.safe_load(_config(tmp_path / "tmp.yml", a, b, weight).read_text())
        path.write_text(yaml.safe_dump_all([{"name": "first", **doc}], sort_keys=False))
        return path

    elsewhere = tmp_path / "elsewhere"
    code, _, err = run_cli(capsys, "multi", multi(tmp_path / "m1.yml", 0.7), "--out-dir", elsewhere, "-q")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (elsewhere / "first").iterdir() if p.is_file()}
    out = tmp_path / "out"
    out.mkdir()
    (out / "first").symlink_to(elsewhere / "first", target_is_directory=True)
    code, _, err = run_cli(capsys, "multi", multi(tmp_path / "m2.yml", 0.4), "--out-dir", out, "-q")
    assert_one_line_error(code, err, "first", "symbolic link")
    assert {p.name: p.read_bytes() for p in (elsewhere / "first").iterdir() if p.is_file()} == before


# ----- caches ----------------------------------------------------------------------------------------


def test_router_cache_directory_link_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE router cache (`<cache>/moe-router`) a link: refused in one line, nothing written there."""
    from mergesmith.moe import router

    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "cache" / "moe-router").symlink_to(outside, target_is_directory=True)
    with pytest.raises(safe_fs.LinkError, match="moe-router"):
        router._save_atomic(router.cache_dir() / "k.safetensors", {"router.0": torch.ones(2, 4)}, {})
    assert list(outside.iterdir()) == []


def test_router_cache_entry_link_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache entry that is a link to a file outside: our new entry replaces the link, the file keeps
    its bytes."""
    from mergesmith.moe import router

    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "moe-router").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = outside / "planted.safetensors"
    save_file({"router.0": torch.zeros(2, 4)}, planted)
    before = planted.read_bytes()
    entry = router.cache_dir() / "k.safetensors"
    entry.symlink_to(planted)
    router._save_atomic(entry, {"router.0": torch.ones(2, 4)}, {})
    assert planted.read_bytes() == before
    _assert_regular(entry)
    assert load_file(entry)["router.0"].sum().item() == 8


def test_import_list_cache_never_writes_through_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The import-list cache: a link as its temporary file is replaced (the victim keeps its bytes);
    a link as its directory makes `record` write nothing and `read_ahead` read nothing."""
    from mergesmith.runtime import import_manifest

    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))
    victim = _victim(tmp_path)
    target = import_manifest.manifest_path()
    target.parent.mkdir(parents=True)
    (target.parent / f"{target.name}.{os.getpid()}.tmp").symlink_to(victim)
    import_manifest.record()
    assert victim.read_bytes() == VICTIM_BYTES
    _assert_regular(target)
    assert "safe_fs" in target.read_text()

    for entry in list(target.parent.iterdir()):
        entry.unlink()
    target.parent.rmdir()
    target.parent.symlink_to(victim.parent, target_is_directory=True)
    import_manifest.record()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
    assert import_manifest.read_ahead() == []


def test_tokenizer_staging_directory_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging directory at a predictable name in the temporary directory: a link there, or a
    directory others can write to, is refused; a fresh one is made private (0700)."""
    import tempfile

    from mergesmith.errors import OutputError
    from mergesmith.tokenizer.align import staging_root

    monkeypatch.delenv("MERGESMITH_STAGING", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    name = tmp_path / f"mergesmith-{os.getuid()}"
    name.symlink_to(_victim(tmp_path).parent, target_is_directory=True)
    with pytest.raises(safe_fs.LinkError):
        staging_root()
    name.unlink()
    name.mkdir(mode=0o777)
    os.chmod(name, 0o777)
    with pytest.raises(OutputError, match="others can write"):
        staging_root()
    name.rmdir()
    assert staging_root() == name
    assert stat.S_IMODE(os.lstat(name).st_mode) == 0o700


# ----- the primitives ----------------------------------------------------------------------------------


def test_remove_tree_removes_links_not_their_targets(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "file").symlink_to(victim)
    (tree / "dirlink").symlink_to(victim.parent, target_is_directory=True)
    with safe_fs.opened_dir(tmp_path) as fd:
        safe_fs.remove_tree(fd, "tree")
    assert not tree.exists()
    assert victim.read_bytes() == VICTIM_BYTES


def test_direct_writer_refuses_a_swapped_name(tmp_path: Path) -> None:
    """The O_DIRECT descriptor is opened by name: if that name no longer is the file the writer
    created, bulk bytes must not go there (no direct writer; the buffered descriptor is used)."""
    from mergesmith.io import direct_write

    mine = tmp_path / "mine"
    fd = os.open(mine, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        other = tmp_path / "other"
        other.write_bytes(b"x")
        swapped = tmp_path / "swapped"
        swapped.symlink_to(other)
        os.environ.pop(direct_write.ENV, None)
        assert direct_write.DirectWriter.open(swapped, fd) is None
        assert direct_write.DirectWriter.open(other, fd) is None
    finally:
        os.close(fd)
