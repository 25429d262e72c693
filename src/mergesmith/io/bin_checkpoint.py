"""PyTorch `.bin`/`.pt` checkpoints: loaded memory-mapped with `weights_only` (so a file can never run code),
and, when torch cannot load one, the one line that says what the file is instead.

Apart from checkpoint.py because safetensors, the format nearly every model ships in, needs none of it: the
diagnosis of a failed `torch.load` (zip or pickle, text, empty, a foreign opcode) is most of this module.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path

import torch

from ..errors import CheckpointError
from .map_guard import GUARD


def load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint, memory-mapped, with `weights_only` so it can never run code.

    Anything `torch.load` raises becomes one line naming the file: torch's own errors on a file that
    is not a checkpoint at all (a text file, random bytes) are internal KeyErrors and IndexErrors of
    its unpickler, and its warnings span several lines, so neither reaches the user as is.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    is_zip = zipfile.is_zipfile(path)
    looks_zip = is_zip or head.startswith(b"PK\x03\x04")  # a zip's first entry (a truncated one has no directory)
    is_pickle = head.startswith(b"\x80")  # the PROTO opcode every pickle of protocol 2+ starts with
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": several lines, not actionable
            state = torch.load(path, map_location="cpu", mmap=is_zip, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises anything on a file it cannot parse
        raise CheckpointError(_bin_failure(path, exc, head, looks_zip, is_pickle)) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{path}: key {name!r} is a {type(name).__name__}, not a tensor name")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor")
    return state


def _bin_failure(path: Path, exc: Exception, head: bytes, is_zip: bool, is_pickle: bool) -> str:
    """The one-line message for a `.pt`/`.bin` file torch could not load."""
    text = str(exc)
    if not (is_zip or is_pickle):
        return f"{path}: not a PyTorch checkpoint ({_what_it_is(head)})"
    operand = re.search(r"Unsupported operand (\d+)", text)
    if isinstance(exc, pickle.UnpicklingError) and operand is None:
        return f"{path}: refused: the file holds objects other than tensors (loaded with weights_only=True)"
    if operand is not None:
        detail = f"unsupported pickle opcode {operand.group(1)}: corrupt, or not written by torch.save"
    else:
        detail = _first_sentence(text) or exc.__class__.__name__
    return f"{path}: cannot load PyTorch checkpoint ({detail})"


def _what_it_is(head: bytes) -> str:
    """What a file that is neither a zip nor a pickle seems to be, from its first bytes."""
    if not head:
        return "the file is empty"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = head[: exc.start].decode("utf-8") if exc.start >= len(head) - 3 else ""  # a character cut off?
    if text and len(text) >= len(head) - 3 and all(c.isprintable() or c in "\t\n\r\f\v" for c in text):
        return "it is a text file"
    return "neither a zip archive nor a pickle"


def _first_sentence(text: str, limit: int = 160) -> str:
    lines = text.strip().splitlines()
    line = lines[0].strip() if lines else ""
    cut = line.find(". ")
    if cut > 0:
        line = line[:cut]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def guard_bin(path: Path, state: dict[str, torch.Tensor]) -> int | None:
    """Register the memory map torch.load(mmap=True) made of a `.bin` (the span of its tensors' storages);
    its start address, or None when there is nothing to guard."""
    spans = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in state.values() if t.device.type == "cpu"
    ]
    spans = [(p, n) for p, n in spans if p and n]
    if not spans:
        return None
    start = min(p for p, _ in spans)
    GUARD.register(path, start, max(p + n for p, n in spans))
    return start
