"""Opening a model by the reference a config gives: a directory, a file, a hub id (downloaded when not
cached), or `model+lora`.

Why a module of its own: the plain reader (checkpoint.py) and the LoRA view over it (lora_adapter.py)
sit one above the other; the choice between them, by the form of the reference, sits above both.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import Checkpoint, resolve_model_path
from .lora_adapter import LoraCheckpoint, split_lora_ref
from .lora_cache import LoraMerge, merged_dir


def open_checkpoint(ref: str, lora: LoraMerge | None = None, cache_root: Path | None = None) -> Checkpoint:
    """Open `ref`, validating every header up front; `model+lora` reads as the model with the adapter merged in
    (the model part may itself be any reference): applied tensor by tensor as read, or, when `lora` asks for a
    cache directory or a dtype (mergekit's --lora-merge-cache/--lora-merge-dtype), merged once into a
    directory (under `cache_root` when `lora` names none) and read from there."""
    if "+" in ref and not Path(ref).expanduser().exists():
        model_ref, adapter_dir = split_lora_ref(ref)
        adapted = LoraCheckpoint.over(ref, open_checkpoint(model_ref), adapter_dir)
        if lora is None or not lora.materialise:
            return adapted
        if lora.cache is None and cache_root is None:
            raise ValueError("a LoRA dtype without a cache directory needs cache_root")
        try:
            where = merged_dir(adapted, lora, cache_root or Path("."))
        finally:
            adapted.close()
        merged = Checkpoint.open(str(where))
        merged.ref = ref  # messages name the input as the config does
        return merged
    return Checkpoint.open(ref)


def tokenizer_root(ref: str) -> Path:
    """The directory holding the tokenizer of the model `ref` names (of `model+lora`: the model's); a hub model
    not in the cache is fetched without its weights, which a tokenizer source does not need."""
    if "+" in ref and not Path(ref).expanduser().exists():
        ref = split_lora_ref(ref)[0]
    path = resolve_model_path(ref, weights=False)
    return path if path.is_dir() else path.parent
