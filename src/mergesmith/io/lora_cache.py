"""`--lora-merge-cache` / `--lora-merge-dtype`: a `model+lora` input merged once into a directory of its own.

Why: by default a LoRA input is applied tensor by tensor as the merge reads (io/lora_adapter.py), which
costs nothing on disk. mergekit instead writes each LoRA-merged model into `--lora-merge-cache` and reads
it from there (in `--lora-merge-dtype`), and users rely on that directory: it is reused by the next
run and by other tools. With either flag mergesmith does the same: the merged model is written once,
one tensor at a time (memory holds one tensor), as `model.safetensors` beside the base's config.json
(its `torch_dtype` updated) and the tokenizer the input would use, under a name that changes whenever
the base's or the adapter's files or the dtype change; a complete directory is reused as it is.
Without a cache directory (only `--lora-merge-dtype`) it goes under mergesmith's cache, in `lora-merge/`.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .dtypes import from_torch, is_float, to_torch
from .lora_adapter import LoraCheckpoint
from .model_files import TOKENIZER_FILES
from .safetensors_writer import ShardWriter, write_file_atomic

MERGED_FILE = "model.safetensors"
_DTYPE_NAMES = {"float32": "F32", "fp32": "F32", "float16": "F16", "fp16": "F16", "bfloat16": "BF16", "bf16": "BF16"}


@dataclass(frozen=True)
class LoraMerge:
    """How `model+lora` inputs are read: applied as read (both None), or merged into `cache` in `dtype`."""

    cache: Path | None = None
    dtype: str | None = None  # safetensors dtype name (F32, F16, BF16)

    @property
    def materialise(self) -> bool:
        return self.cache is not None or self.dtype is not None


def lora_merge_settings(cache: str | Path | None, dtype: str | None) -> LoraMerge:
    """The settings from the flags' values (`dtype` as mergekit spells it: bfloat16, float16, float32)."""
    code = None
    if dtype is not None:
        code = _DTYPE_NAMES.get(str(dtype).lower())
        if code is None:
            raise ConfigError(f"`--lora-merge-dtype`: unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return LoraMerge(Path(cache).expanduser() if cache is not None else None, code)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/"))[-60:] or "model"


def cache_key(ck: LoraCheckpoint, dtype: str | None) -> str:
    """The directory name: readable (base and adapter names) and changed by any change of their files."""
    identity = json.dumps([[list(x) for x in ck.identity()], dtype], sort_keys=True, default=str)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    base = _slug(Path(str(ck.base_checkpoint.root)).name)
    adapter = _slug(ck.adapter_dir.name)
    return f"{base}+{adapter}-{dtype or 'own'}-{digest}"


def merged_dir(ck: LoraCheckpoint, settings: LoraMerge, default_root: Path) -> Path:
    """The directory holding `ck` merged (written now unless a complete one is there)."""
    root = settings.cache if settings.cache is not None else default_root / "lora-merge"
    target = root / cache_key(ck, settings.dtype)
    if (target / MERGED_FILE).is_file():
        return target
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"`--lora-merge-cache {root}`: cannot create {target} ({exc.strerror or exc})") from None
    _write(ck, target, settings.dtype)
    return target


def _write(ck: LoraCheckpoint, target: Path, dtype: str | None) -> None:
    """The merged tensors (float ones in `dtype` when given), then config and tokenizer files; the weights
    file is renamed into place last of all, so its presence means the directory is complete."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        source = Path(ck.tokenizer_root) / name
        if not source.is_file() and name == "generation_config.json":
            source = ck.root / name
        if source.is_file():
            shutil.copyfile(source, target / name)
    if ck.config is not None:
        config = dict(ck.config)
        if dtype is not None:
            config["torch_dtype"] = str(to_torch(dtype)).removeprefix("torch.")
        write_file_atomic(target / "config.json", (json.dumps(config, indent=2) + "\n").encode())

    def out_dtype(stored: str) -> str:
        return dtype if dtype is not None and is_float(stored) else stored

    entries = [(n, out_dtype(i.dtype), tuple(i.shape)) for n, i in ck.tensors.items()]
    writer = ShardWriter(target / MERGED_FILE, target / f".{MERGED_FILE}.partial", entries)
    try:
        for name, code, _shape in entries:
            tensor = ck.get(name)
            if from_torch(tensor.dtype) != code:
                tensor = tensor.to(to_torch(code))
            writer.write(name, tensor.contiguous())
        writer.finish()
    except BaseException:
        writer.abort()
        raise
