"""bench/streaming_floor.py, the torch-free floor quoted in bench/README.md (issue 33, tenth session), runs end to end
and sums right: bf16 models with a tensor over two 8 MB chunks and unaligned lengths, two shards each, its
first and last chunks checked against numpy's sum (--check), warm cache, one run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def _model(directory: Path, seed: int) -> Path:
    directory.mkdir()
    generator = torch.Generator().manual_seed(seed)
    save_file({"big": torch.randn(2049, 2561, generator=generator).to(torch.bfloat16)},
              str(directory / "model-00001-of-00002.safetensors"))
    save_file({"small": torch.randn(7, generator=generator).to(torch.bfloat16)},
              str(directory / "model-00002-of-00002.safetensors"))
    return directory


def test_the_floor_runs_and_its_sums_are_numpys(tmp_path: Path) -> None:
    models = [_model(tmp_path / f"m{k}", seed=k) for k in range(3)]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "streaming_floor.py"), *map(str, models),
                           "--weights", "0.5,0.3,0.2", "--runs", "1", "--warm", "--check"],
                          capture_output=True, text=True, timeout=300)
    if "Invalid argument" in done.stderr:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"run 1: [\d.]+ s wall, first read [\d.]+ s after the child's start, 0\.03 GB read, cache warm, "
                     r"check ok", done.stdout), done.stdout
    assert re.search(r"median [\d.]+ s .* 1 runs", done.stdout)


def test_a_model_without_the_tensor_is_one_error_line(tmp_path: Path) -> None:
    first = _model(tmp_path / "m0", seed=0)
    other = tmp_path / "m1"
    other.mkdir()
    save_file({"big": torch.zeros(3, dtype=torch.bfloat16)}, str(other / "model.safetensors"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "streaming_floor.py"), str(first), str(other),
                           "--runs", "1", "--warm"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith(f"error: {other}: no tensor big of")
