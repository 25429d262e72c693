"""More bad inputs: files that are not PyTorch checkpoints at all, given where a `.pt`/`.bin` is expected.

Each must fail as one user-error line naming the file (exit 2), never as an internal error, a
misleading "holds objects other than tensors" or a multi-line torch warning.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergesmith.cli import main
from mergesmith.errors import CheckpointError
from mergesmith.io.bin_checkpoint import load_bin


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return (exc.value.code if isinstance(exc.value.code, int) else 1), captured.out, captured.err


def one_line_error(code: int, err: str, *needles: str) -> str:
    lines = err.strip("\n").splitlines()
    assert code == 2, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "internal error" not in lines[0] and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    return lines[0]


def write_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


# ----- item: text or random bytes as a .pt/.bin ------------------------------------------------

NOT_CHECKPOINTS = {
    "notes.txt": b"# Notes\nthis is not a model\n",
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}\n',
    "random.pt": bytes(range(1, 128)) * 3,  # no 0x80 first byte, not text
    "empty.bin": b"",
}


@pytest.mark.parametrize("name", sorted(NOT_CHECKPOINTS))
def test_merge_raw_with_a_file_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str):
    good = tmp_path / "good.pt"
    torch.save(_state(1), good)
    bad = tmp_path / name
    bad.write_bytes(NOT_CHECKPOINTS[name])
    cfg = write_yaml(
        tmp_path / "raw.yml",
        {
            "merge_method": "linear",
            "models": [
                {"model": str(good), "parameters": {"weight": 1.0}},
                {"model": str(bad), "parameters": {"weight": 1.0}},
            ],
        },
    )
    code, _, err = run_cli(capsys, "merge-raw", cfg, tmp_path / "out")
    line = one_line_error(code, err, str(bad), "not a PyTorch checkpoint")
    assert "objects other than tensors" not in line
    assert not (tmp_path / "out").exists()


def test_merge_with_a_text_pytorch_model_bin(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_models: Any):
    llama = tiny_models("llama", seed=1)
    model = tmp_path / "textmodel"
    model.mkdir()
    shutil.copy(llama / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    cfg = write_yaml(
        tmp_path / "m.yml",
        {
            "merge_method": "linear",
            "dtype": "float32",
            "models": [
                {"model": str(llama), "parameters": {"weight": 1.0}},
                {"model": str(model), "parameters": {"weight": 1.0}},
            ],
        },
    )
    code, _, err = run_cli(capsys, "merge", cfg, tmp_path / "out")
    one_line_error(code, err, str(model / "pytorch_model.bin"), "not a PyTorch checkpoint", "text file")


def test_a_pickle_torch_cannot_parse_is_not_called_code_and_warns_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
):
    path = tmp_path / "p4.bin"
    path.write_bytes(b"\x80\x04\x95" + bytes(range(200)))  # protocol-4 header, then garbage
    with pytest.raises(CheckpointError) as info:
        load_bin(path)
    message = str(info.value)
    assert message.startswith(f"{path}: cannot load PyTorch checkpoint") and "\n" not in message, message
    assert "objects other than tensors" not in message
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]
    assert capsys.readouterr().err == ""


def test_a_real_checkpoint_still_loads(tmp_path: Path) -> None:
    for legacy in (False, True):
        path = tmp_path / f"ok{legacy}.bin"
        torch.save(_state(3), path, _use_new_zipfile_serialization=not legacy)
        loaded = load_bin(path)
        assert all(torch.equal(loaded[k], v) for k, v in _state(3).items())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=600),
        st.binary(max_size=300).map(lambda b: b"\x80" + b),
        st.binary(max_size=300).map(lambda b: b"\x80\x02" + b),
        st.binary(max_size=300).map(lambda b: b"PK\x03\x04" + b),
        st.text(max_size=200).map(str.encode),
    )
)
def test_any_bytes_as_a_bin_give_a_one_line_checkpoint_error(tmp_path: Path, data: bytes) -> None:
    """Fuzz: whatever the bytes, `load_bin` returns tensors or raises the user-error class in one line."""
    path = tmp_path / "fuzz.bin"
    path.write_bytes(data)
    try:
        state = load_bin(path)
    except CheckpointError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc), str(exc)
    else:
        assert all(isinstance(v, torch.Tensor) for v in state.values())
    finally:
        os.unlink(path)
