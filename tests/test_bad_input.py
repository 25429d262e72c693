"""Bad input, one test each: a clear one-line error naming the file, key or tensor, exit code 2, no
traceback unless `-v`, and never an output directory with an index or config.json but missing shards.

Most cases call `mergesmith.cli.main([...])` in-process (fast); a representative few run the real
`python -m mergesmith.cli` in a subprocess, where the exact stderr and exit code are what a user sees.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mergesmith.cli import main
from tests.helpers import assert_one_line_error, run_cli

INDEX_NAME = "model.safetensors.index.json"


# ----- helpers --------------------------------------------------------------------------------


def assert_no_false_complete(out: Path) -> None:
    """The output directory, if any, has no index or config.json unless every shard is there and whole."""
    if not out.exists():
        return
    from mergesmith.io.checkpoint import read_safetensors_header

    if (out / INDEX_NAME).exists():
        for shard in set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values()):
            read_safetensors_header(out / shard)  # exists and parses, tensors within the file
    elif (out / "config.json").exists():
        read_safetensors_header(out / "model.safetensors")


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def linear_config(tmp_path: Path, *models: Path, **top: Any) -> Path:
    return write_config(
        tmp_path / "merge.yml",
        {
            "merge_method": "linear",
            "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in models],
            "dtype": "float32",
            **top,
        },
    )


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's JSON header with `edit`, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n], object_pairs_hook=OrderedDict)
    edit(header)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


@pytest.fixture(scope="module")
def llama(tiny_models: Any) -> Path:
    return tiny_models("llama", seed=1)


@pytest.fixture(scope="module")
def llama2(tiny_models: Any) -> Path:
    return tiny_models("llama", seed=2)


@pytest.fixture
def broken(tmp_path: Path, llama: Path) -> Path:
    """A private copy of a tiny llama whose files a test may damage."""
    return copy_model(llama, tmp_path / "broken")


# ----- through the real command line (subprocess) --------------------------------------------


def test_real_cli_gives_one_line_and_exit_2(tmp_path: Path, llama: Path) -> None:
    """A representative few through `python -m mergesmith.cli` (run side by side: each interpreter
    spends seconds importing torch): malformed YAML, a missing model, a corrupt safetensors header."""
    bad_yaml = tmp_path / "bad.yml"
    bad_yaml.write_text("merge_method: linear\nmodels:\n  - model: a\n   parameters: {weight: 1\n")
    missing = tmp_path / "no-such-model"
    broken = copy_model(llama, tmp_path / "broken")
    weights = broken / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 2)
    weights.write_bytes(bytes(raw))
    (tmp_path / "a").mkdir()
    cases = {
        "yaml": (bad_yaml, [str(bad_yaml), "malformed YAML", "line 4"]),
        "missing": (linear_config(tmp_path / "a", llama, missing), [str(missing), "no such file or directory"]),
        "header": (linear_config(tmp_path, llama, broken), [str(weights), "header length", "larger than the file"]),
    }
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "mergesmith.cli", "merge", str(cfg), str(tmp_path / f"out-{key}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, (cfg, _names) in cases.items()
    }
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert_one_line_error(proc.returncode, stderr, *cases[key][1])
        assert stdout == ""
        assert not (tmp_path / f"out-{key}").exists()


def test_verbose_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path) -> None:
    missing = tmp_path / "no-such-model"
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, missing), tmp_path / "out", "-v")
    assert code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1] == f"error: model {str(missing)!r}: no such file or directory"


# ----- config ---------------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_right_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_methd": "linear", "models": [{"model": "x"}]})
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert_one_line_error(code, err, str(cfg), "`merge_methd` was ignored", "did you mean `merge_method`")


def test_unknown_nested_key_suggests_the_right_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path
) -> None:
    cfg = write_config(
        tmp_path / "c.yml",
        {"merge_method": "linear", "models": [{"model": str(llama), "parameter": {"weight": 1.0}}]},
    )
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    # mergekit ignores the misspelt key and then misses `weight`: so do we, naming the near miss
    assert_one_line_error(
        code, err, "`parameters.weight` is required", "models[0].parameter", "did you mean `parameters`"
    )
    assert not (tmp_path / "out").exists()


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "merge", tmp_path / "nope.yml", tmp_path / "out")
    assert_one_line_error(code, err, "nope.yml", "not found")


def test_hub_id_not_in_the_local_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama: Path
) -> None:
    import huggingface_hub.constants

    # the cache location is read when huggingface_hub is imported, so patch the constant itself
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = linear_config(tmp_path, llama, Path("some-org/not-downloaded-model"))
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert_one_line_error(code, err, "'some-org/not-downloaded-model'", "not in the local Hugging Face cache")
    assert not (tmp_path / "out").exists()


def test_layer_range_past_the_models_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path) -> None:
    cfg = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "passthrough",
            "slices": [{"sources": [{"model": str(llama), "layer_range": [2, 9]}]}],
        },
    )
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    assert_one_line_error(code, err, str(cfg), "slices[0].sources[0].layer_range", "past the 4 layers")
    assert not (tmp_path / "out").exists()


# ----- safetensors files ------------------------------------------------------------------------


def _merge_broken(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path) -> str:
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, broken), out)
    line = assert_one_line_error(code, err, str(broken / "model.safetensors"))
    assert not out.exists(), "a bad input must be found before the output directory is touched"
    return line


def test_truncated_safetensors_no_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00")
    assert "truncated safetensors file" in _merge_broken(tmp_path, capsys, llama, broken)


def test_truncated_safetensors_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted download
    line = _merge_broken(tmp_path, capsys, llama, broken)
    assert "runs past the end of the file" in line and "tensor '" in line


def test_safetensors_header_not_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    weights = broken / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:12] = b"{{{{"
    weights.write_bytes(bytes(raw))
    assert "header is not valid JSON" in _merge_broken(tmp_path, capsys, llama, broken)


def test_safetensors_overlapping_offsets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    def overlap(header: dict[str, Any]) -> None:
        q = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
        header["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = [q[0] + 4, q[1] + 4]

    rewrite_header(broken / "model.safetensors", overlap)
    line = _merge_broken(tmp_path, capsys, llama, broken)
    assert "overlap" in line and "q_proj" in line and "o_proj" in line


def test_safetensors_offsets_past_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    def past_end(header: dict[str, Any]) -> None:
        entry = header["model.norm.weight"]
        size = entry["data_offsets"][1] - entry["data_offsets"][0]
        end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
        entry["data_offsets"] = [end + 64, end + 64 + size]

    rewrite_header(broken / "model.safetensors", past_end)
    line = _merge_broken(tmp_path, capsys, llama, broken)
    assert "'model.norm.weight'" in line and "runs past the end of the file" in line


def test_safetensors_offsets_disagree_with_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    def short(header: dict[str, Any]) -> None:
        begin, end = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [begin, end - 4]

    rewrite_header(broken / "model.safetensors", short)
    line = _merge_broken(tmp_path, capsys, llama, broken)
    assert "'model.norm.weight'" in line and "do not match its shape" in line


def test_safetensors_unsupported_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    def weird(header: dict[str, Any]) -> None:
        header["model.norm.weight"]["dtype"] = "C64"

    rewrite_header(broken / "model.safetensors", weird)
    line = _merge_broken(tmp_path, capsys, llama, broken)
    assert "'model.norm.weight'" in line and "unsupported dtype 'C64'" in line


@pytest.mark.parametrize("escape", ["../outside.safetensors", "sub/../../outside.safetensors", "ABSOLUTE"])
def test_index_shard_path_escapes_the_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, tiny_models: Any, escape: str
) -> None:
    """An index naming a file outside its model directory (a valid safetensors file is waiting there)
    is refused, whether it climbs out with `..` or is absolute."""
    sharded = copy_model(tiny_models("llama", seed=1, fmt="sharded"), tmp_path / "sharded")
    index_path = sharded / INDEX_NAME
    index = json.loads(index_path.read_text())
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((sharded / next(iter(index["weight_map"].values()))).read_bytes())
    escape = str(outside) if escape == "ABSOLUTE" else escape
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = escape
    index_path.write_text(json.dumps(index))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, sharded), out)
    assert_one_line_error(code, err, str(index_path), repr(escape), "escapes the model directory")
    assert not out.exists()


def test_index_names_a_missing_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, tiny_models: Any
) -> None:
    sharded = copy_model(tiny_models("llama", seed=1, fmt="sharded"), tmp_path / "sharded")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, sharded), tmp_path / "out")
    assert_one_line_error(code, err, str(sharded / INDEX_NAME), shard.name, "missing")


# ----- .bin files -------------------------------------------------------------------------------


class NotATensor:
    """Anything a pickle could carry besides tensors: loading it with weights_only must refuse."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this code must never run",))


def _bin_model(tmp_path: Path, llama: Path, state: dict[str, Any]) -> Path:
    model = tmp_path / "binmodel"
    model.mkdir()
    shutil.copy(llama / "config.json", model / "config.json")
    torch.save(state, model / "pytorch_model.bin")
    return model


def test_bin_with_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path) -> None:
    model = _bin_model(tmp_path, llama, {"model.norm.weight": torch.ones(32), "payload": NotATensor()})
    code, out, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, model), tmp_path / "out")
    line = assert_one_line_error(code, err, str(model / "pytorch_model.bin"), "refused", "weights_only")
    assert "this code must never run" not in out + err, line
    assert not (tmp_path / "out").exists()


def test_bin_with_a_non_tensor_value_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path
) -> None:
    model = _bin_model(tmp_path, llama, {"model.norm.weight": torch.ones(32), "step": 1000})
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, model), tmp_path / "out")
    assert_one_line_error(code, err, str(model / "pytorch_model.bin"), "'step'", "not a tensor")


def test_truncated_bin(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path) -> None:
    model = _bin_model(tmp_path, llama, {"model.norm.weight": torch.ones(32)})
    weights = model / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[:-200])
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, model), tmp_path / "out")
    assert_one_line_error(code, err, str(weights), "cannot load PyTorch checkpoint")


# ----- models that do not fit together ------------------------------------------------------------


def test_tensor_missing_from_one_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, broken: Path
) -> None:
    from safetensors.torch import load_file, save_file

    weights = broken / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, broken), tmp_path / "out")
    assert_one_line_error(code, err, str(broken), "mlp.down_proj.weight", "not found")
    assert not (tmp_path / "out").exists()


def test_shape_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, tiny_models: Any) -> None:
    wider = tiny_models("llama", seed=1, intermediate_size=96)
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, wider), tmp_path / "out")
    line = assert_one_line_error(code, err, "mlp.", "shapes differ", str(llama), str(wider))
    assert ("[32, 64]" in line and "[32, 96]" in line) or ("[64, 32]" in line and "[96, 32]" in line), line
    assert not (tmp_path / "out").exists()


# ----- the output directory ---------------------------------------------------------------------


def test_output_path_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path) -> None:
    out = tmp_path / "out"
    out.write_text("not a directory")
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, llama, llama), out)
    assert_one_line_error(code, err, str(out), "not a directory")
    assert out.read_text() == "not a directory"


@pytest.mark.parametrize("as_file", [False, True])
def test_output_directory_is_an_input_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], llama: Path, llama2: Path, as_file: bool
) -> None:
    """Merging into an input model's own directory is refused even with --overwrite, which would
    otherwise delete that model's config.json and weights (they carry the names a merge replaces)."""
    mine = copy_model(llama, tmp_path / "mine")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    ref = mine / "model.safetensors" if as_file else mine
    code, _, err = run_cli(capsys, "merge", linear_config(tmp_path, ref, llama2), mine, "--overwrite")
    assert_one_line_error(code, err, str(mine), "is the directory of input model", repr(str(ref)))
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before


def _read_only_under(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Simulate a read-only filesystem at `root` (chmod means nothing to root): creating, opening
    for writing or removing anything under it fails with EROFS, as the kernel would."""
    prefix = str(root)

    def full(path: Any, dir_fd: int | None) -> Any:
        if dir_fd is None or not isinstance(path, (str, os.PathLike)):
            return path
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)  # relative to a descriptor (safe_fs)

    def blocked(path: Any, dir_fd: int | None = None) -> bool:
        path = full(path, dir_fd)
        return str(os.fspath(path)).startswith(prefix) if isinstance(path, (str, os.PathLike)) else False

    def refuse(path: Any) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_open, real_os_open, real_mkdir, real_unlink = open, os.open, os.mkdir, os.unlink

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if blocked(file) and any(c in mode for c in "wax+"):
            raise refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if blocked(path, kwargs.get("dir_fd")) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if blocked(path, kwargs.get("dir_fd")) and os.path.lexists(full(path, kwargs.get("dir_fd"))):
            # the kernel reports an existing entry first
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        if blocked(path, kwargs.get("dir_fd")):
            raise refuse(path)
        real_mkdir(path, *args, **kwargs)

    def fake_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if blocked(path, kwargs.get("dir_fd")):
            raise refuse(path)
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "unlink", fake_unlink)


@pytest.mark.parametrize("state", ["missing", "empty", "other_merge"])
def test_read_only_output_filesystem(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    llama: Path,
    llama2: Path,
    state: str,
) -> None:
    """Read-only output: whether the directory must be created, written, or (with --overwrite) have
    another merge removed from it, the answer is one line naming the path."""
    cfg = linear_config(tmp_path, llama, llama2)
    out = tmp_path / "ro" / "out"
    if state == "empty":
        out.mkdir(parents=True)
    elif state == "other_merge":
        (tmp_path / "b").mkdir()
        assert run_cli(capsys, "merge", linear_config(tmp_path / "b", llama, llama), out, "-q")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} if out.exists() else {}
    _read_only_under(monkeypatch, tmp_path / "ro")
    code, _, err = run_cli(capsys, "merge", cfg, out, "-q", "--overwrite")
    assert_one_line_error(code, err, str(out), "Read-only file system")
    monkeypatch.undo()
    assert_no_false_complete(out)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} if out.exists() else {}
    assert after == before


def test_rerun_of_a_complete_merge_on_a_read_only_filesystem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama: Path, llama2: Path
) -> None:
    """A finished merge on a read-only mount (a shared model store) still verifies as complete."""
    cfg = linear_config(tmp_path, llama, llama2)
    out = tmp_path / "ro" / "out"
    assert run_cli(capsys, "merge", cfg, out, "-q")[0] == 0
    _read_only_under(monkeypatch, tmp_path / "ro")
    code, stdout, err = run_cli(capsys, "merge", cfg, out, "-q")
    assert code == 0, err
    assert "already complete" in stdout


def test_not_enough_space_refused_then_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama: Path
) -> None:
    import mergesmith.engine.run

    real = shutil.disk_usage
    monkeypatch.setattr(mergesmith.engine.run.shutil, "disk_usage", lambda p: real(p)._replace(free=123_456))
    cfg = linear_config(tmp_path, llama, llama)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", cfg, out)
    line = assert_one_line_error(code, err, str(out), "not enough free space", "123.46 KB", "--force")
    assert "16." in line, "the needed size (data + 16 MB margin) is printed too"
    assert_no_false_complete(out)
    code, stdout, err = run_cli(capsys, "merge", cfg, out, "--force", "-q")
    assert code == 0, err
    assert (out / "config.json").exists() and "wrote" in stdout


def _fail_with_enospc(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, after: int = 0) -> None:
    """Make `target.name` raise ENOSPC from its (after+1)-th call on."""
    real = getattr(target, name)
    calls = {"n": 0}

    def full(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, full)


@pytest.mark.parametrize("where", ["pwrite", "fallocate", "small_file"])
def test_disk_fills_up_during_the_merge_then_resumes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    llama: Path,
    llama2: Path,
    where: str,
) -> None:
    """ENOSPC while writing a shard, reserving one, or writing config/tokenizer files: one line, exit
    2, nothing that looks complete; once space is freed the same command resumes to the same bytes."""
    import mergesmith.io.safetensors_writer as writer

    cfg = linear_config(tmp_path, llama, llama2)
    reference = tmp_path / "reference"
    assert run_cli(capsys, "merge", cfg, reference, "-q", "--out-shard-size", "50K")[0] == 0
    out = tmp_path / "out"
    if where == "pwrite":
        _fail_with_enospc(monkeypatch, writer.os, "pwrite", after=10)
    elif where == "fallocate":
        _fail_with_enospc(monkeypatch, writer.os, "posix_fallocate", after=2)
    else:
        real_atomic = writer.write_file_atomic

        def atomic(path: Path, data: bytes) -> None:
            if path.name == "tokenizer.json":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path.with_name(".tokenizer.json.tmp")))
            real_atomic(path, data)

        monkeypatch.setattr(writer, "write_file_atomic", atomic)
        import mergesmith.engine.run

        monkeypatch.setattr(mergesmith.engine.run, "write_file_atomic", atomic)
    code, _, err = run_cli(capsys, "merge", cfg, out, "-q", "--out-shard-size", "50K", "--threads", "2")
    assert_one_line_error(code, err, str(out), "No space left on device")
    assert not (out / "config.json").exists()
    assert_no_false_complete(out)
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "merge", cfg, out, "-q", "--out-shard-size", "50K")
    assert code == 0, err
    for f in reference.iterdir():
        if f.is_file():
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_internal_error_is_one_line_with_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, llama: Path, llama2: Path
) -> None:
    """A bug (not the user's fault) exits 1 with one line and a hint to use -v; the traceback is
    shown with -v; the half-written output never looks complete."""
    import mergesmith.engine.execution.local_executor

    def broken_compute(recipe: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"simulated bug while merging {recipe.name}")

    monkeypatch.setattr(mergesmith.engine.execution.local_executor, "compute", broken_compute)
    cfg = linear_config(tmp_path, llama, llama2)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "merge", cfg, out, "-q")
    line = assert_one_line_error(code, err, "internal error", "RuntimeError", "simulated bug", exit_code=1)
    assert "-v" in line
    assert_no_false_complete(out)
    code, _, err = run_cli(capsys, "merge", cfg, out, "-q", "-v")
    assert code == 1 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: internal error")


def _hub_cache_layout(src: Path, cache: Path, repo: str) -> Path:
    """Lay `src` out as the Hugging Face cache does: content in blobs/, the snapshot made of symlinks."""
    import hashlib

    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123456789abcdef"
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123456789abcdef")
    return snapshot


def test_sharded_model_in_the_hub_cache_is_not_mistaken_for_an_escape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_models: Any
) -> None:
    """In the hub cache every shard is a symlink into blobs/, outside the snapshot directory: that is
    the cache's own layout, not an index escaping its model directory, and must merge."""
    import huggingface_hub.constants

    sharded = tiny_models("llama", seed=1, fmt="sharded")
    assert (sharded / INDEX_NAME).exists()
    cache = tmp_path / "hub"
    _hub_cache_layout(sharded, cache, "someorg/sharded-llama")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    cfg = write_config(
        tmp_path / "c.yml", {"merge_method": "passthrough", "models": [{"model": "someorg/sharded-llama"}]}
    )
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q")
    assert code == 0, err
    from tests.helpers import read_state_dict

    merged, original = read_state_dict(tmp_path / "out"), read_state_dict(sharded)
    assert merged.keys() == original.keys() and all(torch.equal(merged[n], original[n]) for n in original)


# ----- any safetensors header: a one-line error or a sound result, never a crash --------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "BOOL": 1, "U8": 1}


@st.composite
def _headers(draw: st.DrawFn) -> Any:
    """Mostly well-formed headers with back-to-back offsets, each damaged in at most a few places
    (a field or a whole entry replaced by any JSON value, offsets nudged), so the damage is reached
    instead of hiding behind an earlier, simpler error."""
    header: dict[str, Any] = {}
    offset = 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(sorted(_SIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=2))
        size = _SIZES[dtype] * math.prod(shape)
        entry: Any = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        damage = draw(st.sampled_from(["none", "none", "dtype", "shape", "data_offsets", "entry", "nudge"]))
        if damage == "entry":
            entry = draw(_json)
        elif damage == "nudge":
            entry["data_offsets"] = [o + draw(st.integers(-6, 6)) for o in entry["data_offsets"]]
        elif damage != "none":
            entry[damage] = draw(_json)
        header[f"t{i}"] = entry
    metadata = draw(st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2) | _json)
    if metadata is not None:
        header["__metadata__"] = metadata
    whole: Any = draw(_json) if draw(st.integers(0, 9)) == 0 else header
    return whole, max(0, offset + draw(st.integers(-8, 8)))  # data bytes: about what the layout needs


@settings(max_examples=120, deadline=None)
@given(case=_headers())
def test_any_safetensors_header_is_refused_in_one_line_or_read_soundly(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[Any, int]
) -> None:
    """Fuzzed headers (wrong types, floats, booleans, string shapes, odd metadata, offsets anywhere):
    the reader either raises a CheckpointError naming the file, or returns tensors that lie inside
    the file, match their shape and do not overlap. Any other exception would be an internal error."""
    from mergesmith.errors import CheckpointError
    from mergesmith.io.checkpoint import read_safetensors_header

    header, data_len = case
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * data_len)
    try:
        tensors, _meta, _raw = read_safetensors_header(path)
    except CheckpointError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)
        return
    size = path.stat().st_size
    spans = sorted((i.data_offset, i.data_offset + i.nbytes) for i in tensors.values() if i.nbytes)
    assert all(8 + len(blob) <= b and e <= size for b, e in spans)
    assert all(e0 <= b1 for (_, e0), (b1, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]},  # was truncated to 2
        {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},  # was read as [1, 2]
        {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},  # was iterated as digits
        {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]},
        {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},  # was a TypeError
        {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},  # was a TypeError
        {"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]},
    ],
)
def test_header_entries_of_the_wrong_type_are_refused_not_coerced(tmp_path: Path, entry: dict[str, Any]) -> None:
    from mergesmith.errors import CheckpointError
    from mergesmith.io.checkpoint import read_safetensors_header

    path = tmp_path / "x.safetensors"
    blob = json.dumps({"t": entry}).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 8)
    with pytest.raises(CheckpointError, match="tensor 't' has a malformed header entry"):
        read_safetensors_header(path)


@pytest.mark.parametrize("metadata", ["pt", [1], 3])
def test_metadata_that_is_not_an_object_is_refused(tmp_path: Path, metadata: Any) -> None:
    from mergesmith.errors import CheckpointError
    from mergesmith.io.checkpoint import read_safetensors_header

    path = tmp_path / "x.safetensors"
    blob = json.dumps({"__metadata__": metadata, "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    path.write_bytes(struct.pack("<Q", len(blob)) + blob.encode() + b"\0" * 8)
    with pytest.raises(CheckpointError, match="`__metadata__` is not a JSON object"):
        read_safetensors_header(path)


@pytest.mark.parametrize(
    ("method", "params", "needle"),
    [
        ("ties", {"consensus_method": "bogus"}, "must be one of sum, count"),
        ("ties", {"normalize": "maybe"}, "must be true or false"),
        ("task_arithmetic", {"lambda": "big"}, "must be a number"),
    ],
)
def test_bad_method_parameters_fail_at_plan_time(tmp_path, tiny_models, capsys, method, params, needle):
    base, a = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    cfg = tmp_path / "c.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": method,
                "base_model": str(base),
                "models": [{"model": str(a), "parameters": {"weight": 1.0, "density": 0.5}}],
                "parameters": params,
            }
        )
    )
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["merge", str(cfg), str(out), "-q"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and needle in err and next(iter(params)) in err
    assert not out.exists()


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["merge", "c.yml", "out", "--threads", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and "--threads" in err
