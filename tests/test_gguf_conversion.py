"""Merged outputs convert to GGUF with llama.cpp's own converter, tensor for tensor.

llama.cpp's `convert_hf_to_gguf.py` and its `gguf-py` are taken from the llama-cpp-python source
distribution on PyPI (`pip download --no-binary :all: --no-deps`), downloaded once per machine into a cache
directory and skipped with the reason when that is impossible. No compiling: the converter is plain Python.

Four merges are converted (`--outtype f32`, so nothing is rounded): a llama linear merge, a qwen2 SLERP
(tied embeddings), a phi3 passthrough that repeats a layer range, and a gemma2 TIES. Every GGUF tensor is
traced back, through gguf-py's own name map, to the safetensors tensor it came from and must equal it bit for
bit, after undoing the converter's two rewrites: llama's q/k row permutation (for its RoPE layout, undone here)
and gemma's `norm + 1` (compared as `safetensors + 1` in float32, exactly what the converter computes, because
subtracting 1 again would round). The models carry a SentencePiece `tokenizer.model` beside its
`tokenizer.json`, as Llama-2, Gemma and Phi-3 repositories do: the converter rejects tokenizers it does not know.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from tests.helpers import read_state_dict
from tests.model_factory import make_model, make_sentencepiece_tokenizer

LLAMA_CPP_PYTHON = os.environ.get("MERGESMITH_LLAMA_CPP_PYTHON", "llama-cpp-python==0.3.36")
"""The pinned source distribution (MERGESMITH_LLAMA_CPP_PYTHON=llama-cpp-python tries the newest)."""
CACHE = Path(os.environ.get("MERGESMITH_TEST_CACHE") or Path(tempfile.gettempdir()) / "mergesmith-test-cache")
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
"""What the converter needs, under the sdist's vendor/llama.cpp/."""
ARCHS = ["llama", "qwen2", "phi3", "gemma2"]


@contextlib.contextmanager
def _locked(path: Path):
    """One download per machine even when pytest-xdist workers ask at once."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_sdist(into: Path) -> Path:
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[-1]
    with tempfile.TemporaryDirectory(dir=into) as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--retries", "1"]
        cmd += ["--timeout", "30", "-d", scratch, LLAMA_CPP_PYTHON]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            pytest.skip(f"`pip download {LLAMA_CPP_PYTHON}` took more than 30 minutes")
        got = sorted(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
        if run.returncode != 0 or not got:
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot download the {LLAMA_CPP_PYTHON} source distribution from the package index: {last}")
        target = into / got[0].name
        os.replace(got[0], target)
        return target


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, holding only what the converter needs."""
    root = CACHE / "llama-cpp-python"
    with _locked(root / ".lock"):
        sdist = _download_sdist(root)
        dest = root / sdist.name.removesuffix(".tar.gz")
        done = dest / ".extracted"
        if not done.exists():
            shutil.rmtree(dest, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                members = []
                for m in tar.getmembers():
                    _top, sep, inner = m.name.partition("/vendor/llama.cpp/")
                    if sep and (inner in NEEDED or inner.startswith(NEEDED[1:])) and (m.isfile() or m.isdir()):
                        m.name = inner
                        members.append(m)
                kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(dest, members=members, **kwargs)
            done.touch()
    assert (dest / "convert_hf_to_gguf.py").is_file() and (dest / "gguf-py" / "gguf").is_dir()
    return dest


def _gguf(llama_cpp: Path) -> Any:
    """gguf-py from the same sdist as the converter (what llama.cpp itself reads and writes with)."""
    path = str(llama_cpp / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    assert Path(gguf.__file__).is_relative_to(llama_cpp), f"another gguf package is imported: {gguf.__file__}"
    return gguf


# ----- the merges ------------------------------------------------------------------------------------------------
def _merge_config(arch: str, a: Path, b: Path) -> dict[str, Any]:
    if arch == "llama":
        return {
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.7}},
                {"model": str(b), "parameters": {"weight": 0.3}},
            ],
        }
    if arch == "qwen2":
        return {
            "merge_method": "slerp",
            "base_model": str(a),
            "models": [{"model": str(a)}, {"model": str(b)}],
            "parameters": {"t": 0.4},
        }
    if arch == "phi3":  # layers 0-2 of a, then 1-2 of a again, then 2 of b: 6 layers from 3
        return {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(a), "layer_range": [0, 3]}]},
                {"sources": [{"model": str(a), "layer_range": [1, 3]}]},
                {"sources": [{"model": str(b), "layer_range": [2, 3]}]},
            ],
        }
    return {
        "merge_method": "ties",
        "base_model": str(a),
        "models": [
            {"model": str(a)},
            {"model": str(b), "parameters": {"weight": 0.5, "density": 0.6}},
        ],
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory, llama_cpp) -> dict[str, tuple[Path, Path, subprocess.CompletedProcess]]:
    """arch -> (merged dir, GGUF file, converter run); the four conversions run side by side."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = make_sentencepiece_tokenizer(root / "tokenizer", 256)
    outs: dict[str, Path] = {}
    for arch in ARCHS:
        inputs = []
        for seed in (1, 2):
            where = root / arch / f"m{seed}"
            if arch == "llama" and seed == 1:  # as a Hub model sits in the Hugging Face cache: its card names it
                where = root / "hub" / "models--tiny--llama-a" / "snapshots" / ("0" * 40)
            path = make_model(arch, where, seed=seed, layers=3, tokenizer=False)
            for f in tokenizer.iterdir():
                shutil.copy2(f, path / f.name)
            inputs.append(path)
        cfg = root / arch / "merge.yml"
        cfg.write_text(yaml.safe_dump(_merge_config(arch, *inputs), sort_keys=False))
        outs[arch] = root / arch / "merged"
        run_merge(cfg, outs[arch], MergeOptions())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py beside it
    procs = {}
    for arch, out in outs.items():
        gguf_file = out.parent / "merged-f32.gguf"
        cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(out), "--outfile", str(gguf_file)]
        cmd += ["--outtype", "f32"]
        procs[arch] = (
            gguf_file,
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        )
    result = {}
    for arch, (gguf_file, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        result[arch] = (outs[arch], gguf_file, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return result


# ----- the comparison --------------------------------------------------------------------------------------------
def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's LlamaModel.permute (rows (head, 2, half) -> (head, half, 2) for its RoPE)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_model_converts_to_gguf_tensor_for_tensor(converted, llama_cpp, arch):
    out, gguf_file, run = converted[arch]
    assert run.returncode == 0, f"convert_hf_to_gguf.py failed for {arch}:\n{run.stderr[-4000:]}"
    gguf = _gguf(llama_cpp)
    reader = gguf.GGUFReader(gguf_file)
    config = json.loads((out / "config.json").read_text())
    arch_name = _field(reader, "general.architecture")
    assert _field(reader, f"{arch_name}.block_count") == config["num_hidden_layers"]
    if arch == "phi3":
        assert config["num_hidden_layers"] == 6
    # The card names only Hub ids as base_model (a Hugging Face cache snapshot is one), never a local path,
    # which the converter turned into `https://huggingface.co//tmp/...` URLs.
    strings = [str(_field(reader, k)) for k in reader.fields if not k.startswith("tokenizer.ggml.")]
    assert not any("huggingface.co//" in s or str(out.parent.parent) in s for s in strings), strings
    if arch == "llama":
        assert _field(reader, "general.base_model.count") == 1
        assert _field(reader, "general.base_model.0.repo_url") == "https://huggingface.co/tiny/llama-a"
    else:
        assert _field(reader, "general.base_model.count") in (None, 0)

    state = read_state_dict(out)
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    source = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in state}
    assert None not in source, f"gguf-py maps no GGUF name for some of {sorted(state)}"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    seen = set()
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, (tensor.name, tensor.tensor_type)
        assert tensor.name in source, f"GGUF tensor {tensor.name} has no safetensors source"
        hf_name = source[tensor.name]
        seen.add(hf_name)
        want = state[hf_name]
        assert tuple(tensor.data.shape) == tuple(want.shape), (tensor.name, tensor.data.shape, want.shape)
        got = torch.from_numpy(tensor.data.copy())
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            got = _unpermute(got, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            got = _unpermute(got, kv_heads)
        elif arch == "gemma2" and hf_name.endswith("norm.weight"):
            want = want + 1
        assert torch.equal(got, want), f"{tensor.name} differs from {hf_name}"
    assert seen == set(state), f"not in the GGUF: {sorted(set(state) - seen)}"
    if arch in ("qwen2", "gemma2"):  # tied: no head in either file, llama.cpp reads the embedding
        assert "lm_head.weight" not in state and "output.weight" not in {t.name for t in reader.tensors}
