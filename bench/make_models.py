"""Generate the benchmark checkpoints: three related llama-style bf16 models of ~0.25 B, 0.5 B, 1 B or 7 B parameters
(or tiny ones, for tests of the bench scripts).

Why generate instead of download: there is no model hub here, and the benchmarks only need checkpoints that *look*
like real ones to both merge tools (a ``config.json`` written by a real ``LlamaConfig``, sharded safetensors with the
index transformers writes, real tensor names and shapes). Random-initialising a 1 B model through transformers on two
cores is slow and memory-hungry, so the tensors are drawn directly with seeded ``torch.randn``, one tensor at a time,
and streamed into safetensors files (header first, then each tensor's bytes as it is drawn), so the generator holds
one tensor, not a shard: the 7b set (3 x 14.5 GB) is written with about 1.5 GB of memory. The three models are
written in one pass, each tensor's base drawn once and shared by the three files.

Why three *related* models: merge methods that work on task vectors (ties, dare) or angles (slerp) behave like they do
on real fine-tunes only when the models share a base. So ``model0`` is the "base" (N(0, 0.02) weights, norms at 1) and
``model1``/``model2`` are that base plus a small seeded delta (N(0, 0.002)), like two fine-tunes of one base.

Every tensor's values depend only on (size, model index, tensor name, seed), so the files are reproducible across
runs and machines. A ``.bench-complete`` marker written last makes the script idempotent: a model whose marker matches
is skipped, a half-written one is regenerated.

Usage::

    python bench/make_models.py --size 1b            # ~/.cache/mergesmith/bench-models/1b/model{0,1,2}
    python bench/make_models.py --size 0.25b --check-load
    python bench/make_models.py --size 7b            # Mistral-7B-v0.1's shape, ~43.5 GB for the three
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_ROOT = Path(os.environ.get("MERGESMITH_BENCH_MODELS", Path.home() / ".cache/mergesmith/bench-models"))
MARKER = ".bench-complete"
FORMAT_VERSION = 2  # bump when the generated values or layout change, so stale caches are rebuilt
NUM_MODELS = 3
BASE_STD = 0.02
DELTA_STD = 0.002
DEFAULT_SHARD_BYTES = 2 * 10**9  # transformers' "2GB": decimal gigabytes

# Llama shapes with GQA, untied embeddings (so lm_head is its own tensor, as in most llama-family models).
# 1b is TinyLlama-1.1B's shape; the smaller ones keep the same vocabulary so embeddings stay a realistic share.
SIZES: dict[str, dict[str, Any]] = {
    # ~35 MB a model: for tests of the bench scripts' plumbing (bench/gpu_check.sh --cpu-dry-run), not for timings
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "0.25b": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "0.5b": {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    # Mistral-7B-v0.1's shape (the free-Colab scale of issue 18); written with a MistralConfig, see llama_config.
    "7b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
}
MISTRAL_SIZES = {"7b"}
_COMMON: dict[str, Any] = {
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TensorSpec:
    """Name and shape of one checkpoint tensor, as the transformers model class names it."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def model_dirs(size: str, root: Path = DEFAULT_ROOT) -> list[Path]:
    """Where the three models of `size` live (the benchmarks import this so paths agree)."""
    return [root / size / f"model{i}" for i in range(NUM_MODELS)]


def llama_config(size: str) -> Any:
    """A real ``LlamaConfig`` (``MistralConfig`` for 7b, Mistral-7B-v0.1's own class) for `size`, so
    ``config.json`` is exactly what transformers writes and reads."""
    from transformers import LlamaConfig, MistralConfig

    settings = {**_COMMON, **SIZES[size]}
    if size in MISTRAL_SIZES:
        cfg = MistralConfig(**settings)
        cfg.architectures = ["MistralForCausalLM"]
    else:
        cfg = LlamaConfig(**settings)
        cfg.architectures = ["LlamaForCausalLM"]  # save_pretrained of a model sets this; tools dispatch on it
    cfg.dtype = torch.bfloat16
    return cfg


def tensor_specs(config: Any) -> list[TensorSpec]:
    """Tensor names/shapes in state-dict order, from the model class built on the meta device (no memory, instant).

    Going through the real class rather than hard-coding names means the checkpoint cannot drift from what
    ``from_pretrained`` expects.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [TensorSpec(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def _generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded from a stable hash of `parts` (``hash()`` is salted per process; crc32 is not)."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(parts).encode()))
    return g


def _base(spec: TensorSpec, seed: int, size: str) -> torch.Tensor:
    """The fp32 "base" values of one tensor (model0's, before rounding to bf16)."""
    base = torch.randn(spec.shape, generator=_generator(seed, size, "base", spec.name), dtype=torch.float32)
    base.mul_(BASE_STD)
    if len(spec.shape) == 1:  # norms sit around 1
        base.add_(1.0)
    return base


def _derive(base: torch.Tensor, spec: TensorSpec, model_index: int, seed: int, size: str) -> torch.Tensor:
    """Model `model_index`'s bf16 values from the shared fp32 base (model0 is the base itself)."""
    if model_index == 0:
        return base.to(torch.bfloat16)
    delta = torch.randn(spec.shape, generator=_generator(seed, size, model_index, spec.name), dtype=torch.float32)
    mixed = torch.add(base, delta, alpha=DELTA_STD)  # the base stays untouched for the next model
    del delta
    return mixed.to(torch.bfloat16)


def make_tensor(spec: TensorSpec, model_index: int, seed: int, size: str) -> torch.Tensor:
    """The bf16 values of one tensor of one model; depends only on the arguments."""
    return _derive(_base(spec, seed, size), spec, model_index, seed, size)


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in state-dict order, like transformers: start a new shard when the next tensor would overflow."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        nbytes = spec.numel * 2
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


def _fingerprint(size: str, index: int, seed: int, shard_bytes: int) -> dict[str, Any]:
    return {"version": FORMAT_VERSION, "size": size, "index": index, "seed": seed, "shard_bytes": shard_bytes}


def is_complete(path: Path, fingerprint: dict[str, Any]) -> bool:
    """True when the marker matches and every file it lists is present with the recorded size."""
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if recorded.get("fingerprint") != fingerprint:
        return False
    files: dict[str, int] = recorded.get("files", {})
    return all((path / name).is_file() and (path / name).stat().st_size == n for name, n in files.items())


def _header(shard: list[TensorSpec]) -> bytes:
    """A safetensors header for bf16 tensors stored in `shard` order, padded to 8 bytes as the format asks."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        nbytes = spec.numel * 2
        entries[spec.name] = {"dtype": "BF16", "shape": list(spec.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(fh: Any, tensor: torch.Tensor) -> None:
    """Append a bf16 tensor's bytes without a copy (its int16 view as a numpy buffer; little-endian hosts)."""
    fh.write(tensor.contiguous().view(torch.int16).numpy().data)


def write_models(paths: list[Path], size: str, seed: int, shard_bytes: int, quiet: bool = False) -> None:
    """Write the models at `paths` (model index = position) not complete yet, in one pass over the tensors.

    Each goes to a temp dir renamed at the end, so a kill leaves no half model. Every tensor's fp32 base is drawn
    once and written to each model being made, so the generator holds about one tensor in fp32 three times over
    (base, delta, bf16 copy); files are streamed, never assembled in memory."""
    todo = [i for i, p in enumerate(paths) if not is_complete(p, _fingerprint(size, i, seed, shard_bytes))]
    for i, p in enumerate(paths):
        if i not in todo and not quiet:
            print(f"{p}: present, skipped", file=sys.stderr)
    if not todo:
        return
    t0 = time.perf_counter()
    tmps = {i: paths[i].with_name(paths[i].name + ".tmp") for i in todo}
    config = llama_config(size)
    for tmp in tmps.values():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config.save_pretrained(tmp)
    specs = tensor_specs(config)
    shards = plan_shards(specs, shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_bytes = sum(s.numel * 2 for s in specs)
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        header = _header(shard)
        handles = {i: open(tmps[i] / fname, "wb") for i in todo}  # noqa: SIM115 - closed below
        try:
            for fh in handles.values():
                fh.write(header)
            for spec in shard:
                base = _base(spec, seed, size)
                for i, fh in handles.items():
                    _write_tensor(fh, _derive(base, spec, i, seed, size))
                del base
            for fh in handles.values():
                fh.flush()
                os.fsync(fh.fileno())  # durable before the rename makes it visible as complete
        finally:
            for fh in handles.values():
                fh.close()
        weight_map.update({spec.name: fname for spec in shard})
        if not quiet:
            print(f"  shard {k}/{n} written, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for i in todo:
        tmp = tmps[i]
        if n > 1:
            index_json = {
                "metadata": {"total_parameters": sum(s.numel for s in specs), "total_size": total_bytes},
                "weight_map": weight_map,
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2, sort_keys=True) + "\n")
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        marker = {"fingerprint": _fingerprint(size, i, seed, shard_bytes), "files": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        shutil.rmtree(paths[i], ignore_errors=True)
        tmp.rename(paths[i])
    if not quiet:
        params = sum(s.numel for s in specs)
        print(
            f"{', '.join(str(paths[i]) for i in todo)}: {params / 1e9:.3f} B params, {total_bytes / 1e9:.2f} GB "
            f"each in {n} shard(s), {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )


def ensure_models(
    size: str, root: Path = DEFAULT_ROOT, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES, quiet: bool = False
) -> list[Path]:
    """Make sure the three models of `size` exist (generating what is missing) and return their directories."""
    dirs = model_dirs(size, root)
    write_models(dirs, size, seed, shard_bytes, quiet=quiet)
    return dirs


def check_load(path: Path) -> None:
    """Load one generated model with ``AutoModelForCausalLM`` and run a forward pass: the layout is genuinely HF's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        logits = model(ids).logits
    n = sum(p.numel() for p in model.parameters())
    assert torch.isfinite(logits).all(), "non-finite logits"
    print(f"{path}: loaded by AutoModelForCausalLM ({type(model).__name__}, {n / 1e9:.3f} B params, "
          f"dtype {model.dtype}), logits {tuple(logits.shape)} finite", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="cache root (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="max bytes per safetensors shard")
    ap.add_argument("--check-load", action="store_true", help="load model0 with AutoModelForCausalLM afterwards")
    args = ap.parse_args(argv)
    dirs = ensure_models(args.size, args.root, args.seed, args.shard_bytes)
    if args.check_load:
        check_load(dirs[0])
    for d in dirs:
        print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
