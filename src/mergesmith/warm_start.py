"""Start reading a fresh merge's inputs while Python is still importing torch.

Why: a merge process spends its first seconds importing torch and planning (about 3 s here, a fifth of a
1 B-parameter linear merge that is bound by the disk), with the disk idle. The first tensors a merge needs
lie near the start of each input model's first shard (safetensors keeps tensors in name order, and the
plan starts with the embeddings and layer 0), so asking the kernel to read ahead those bytes from a
background thread, before the heavy imports, overlaps that startup with reading. Bounded (READ_AHEAD_BYTES
per model), read-only, best-effort: anything unexpected (a hub id, a missing path, an unreadable config) is
skipped silently, since the merge itself reports real problems; the executor's own read-ahead takes over
once it starts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

READ_AHEAD_BYTES = 1 << 30
"""Bytes read ahead from the start of each local input model's first shard (at most: see _budget)."""


def read_ahead_inputs(config_file: Path, out_dir: Path) -> threading.Thread | None:
    """Begin reading ahead the local input models of `config_file` in a daemon thread (None when nothing
    is started: no fadvise on this platform, or OUT_DIR already holds something, a rerun or resume that
    may need to read nothing)."""
    if not hasattr(os, "posix_fadvise") or _holds_something(out_dir):
        return None
    thread = threading.Thread(target=_read_ahead, args=(config_file,), name="warm-start", daemon=True)
    thread.start()
    return thread


def _holds_something(out_dir: Path) -> bool:
    """True unless OUT_DIR is missing or an empty directory (a file there is the merge's error to report)."""
    try:
        return out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir()))
    except OSError:
        return True


def _read_ahead(config_file: Path) -> None:
    try:
        import yaml

        config = yaml.safe_load(config_file.read_text())
        directories = list(dict.fromkeys(_local_model_dirs(config, config_file.parent)))
        each = _budget(len(directories))
        for directory in directories:
            shards = sorted(directory.glob("*.safetensors"))
            if shards:
                _advise_willneed(shards[0], each)
    except Exception:  # noqa: BLE001 - best-effort warm-up; the merge reports real errors itself
        return


def _budget(models: int) -> int:
    """Bytes to read ahead per model: READ_AHEAD_BYTES, or less so that all of it stays within a quarter of
    the available memory (read-ahead evicted before use would be read twice)."""
    import psutil

    return min(READ_AHEAD_BYTES, psutil.virtual_memory().available // (4 * max(1, models)))


def _local_model_dirs(node: Any, base: Path) -> Iterator[Path]:
    """Existing local directories named by `model` / `base_model` values anywhere in the config."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("model", "base_model") and isinstance(value, str):
                path = Path(value.split("+", 1)[0]).expanduser()
                for candidate in (path, base / path):
                    if candidate.is_dir():
                        yield candidate.resolve()
                        break
            else:
                yield from _local_model_dirs(value, base)
    elif isinstance(node, list):
        for item in node:
            yield from _local_model_dirs(item, base)


def _advise_willneed(path: Path, length: int) -> None:
    from .io.readahead import advise_in_pieces, piece_size

    fd = os.open(path, os.O_RDONLY)
    try:
        end = min(length, os.fstat(fd).st_size)
        advise_in_pieces(lambda at, n: os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED), 0, end, piece_size(fd))
    finally:
        os.close(fd)
