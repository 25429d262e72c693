"""Start reading a fresh merge's inputs while Python is still importing torch.

Why: a merge process spends its first seconds importing torch and planning (2.5-4 s here with a cold
cache, a fifth of a 1 B-parameter linear merge that is bound by the disk). Reading the inputs meanwhile
overlaps that startup with I/O. A background thread, started before the heavy imports:
- first reads torch's own shared libraries in big pieces, so the import does not fault them in 128 KB at
  a time behind the inputs' reads;
- then reads each local input model from its start (its shards in order), one piece of each model in turn,
  since the merge needs the same tensors of every model at once; only the files the merge will read
  through the page cache: those on filesystems where it reads around the cache (`io.direct_read`) are
  left to the merge's own reader;
- keeps only IN_FLIGHT pieces queued at the disk, so the imports' many small reads are not stuck behind
  gigabytes of read-ahead.
Bounded (READ_AHEAD_BYTES per model, and half the available memory in all), read-only, best-effort:
anything unexpected (a hub id, a missing path, an unreadable config) is skipped silently, since the merge
itself reports real problems. The executor's own read-ahead takes over once it starts.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

READ_AHEAD_BYTES = 4 << 30
"""Bytes read ahead from the start of each local input model (at most: see _budget)."""

IN_FLIGHT = 6
"""Read-ahead pieces queued at once: 4 MB requests at depth 4 or more reach this disk's full rate
(about 2.3 GB/s, against 0.65 GB/s at depth 1), and a short queue lets the imports' reads through."""


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
        from ..io.safe_yaml import load_documents

        config = load_documents(config_file.read_text(), all_documents=False)  # refuses alias bombs unwalked
        directories = list(dict.fromkeys(_local_model_dirs(config, config_file.parent)))
        each = _budget(len(directories))
        models = [_paged_files(directory) for directory in directories]
        pieces = _torch_library_pieces() + _interleaved([_model_pieces(shards, each) for shards in models])
        _advise_paced(pieces)
    except Exception:  # noqa: BLE001 - best-effort warm-up; the merge reports real errors itself
        return


def _paged_files(directory: Path) -> list[Path]:
    """The model's safetensors files the merge will read through the page cache: not those on filesystems
    where it reads around it (io.direct_read), for which read-ahead into the cache would only cost (copying
    freshly read cache pages out again took 40% of the CPU of a 1 B linear merge on this VM)."""
    from ..io.direct_write import direct_io_supported

    return [f for f in sorted(directory.glob("*.safetensors")) if not direct_io_supported(f)]


Piece = tuple[Path, int, int]
"""(file, offset, length): one WILLNEED call, at most the device's read-ahead cap."""


def _file_pieces(path: Path, length: int) -> list[Piece]:
    from ..io.readahead import piece_ranges, piece_size

    end = min(length, path.stat().st_size)
    return [(path, offset, n) for offset, n in piece_ranges(0, end, piece_size(path))]


def _model_pieces(shards: list[Path], budget: int) -> list[Piece]:
    """A model's first `budget` bytes, its shards in name order (the order its tensors are planned)."""
    pieces: list[Piece] = []
    for shard in shards:
        if budget <= 0:
            break
        own = _file_pieces(shard, budget)
        pieces += own
        budget -= sum(n for _, _, n in own)
    return pieces


def _interleaved(models: list[list[Piece]]) -> list[Piece]:
    """One piece of each model in turn: the merge needs the same tensors of every model at once, so
    model 0 must not be read whole before model 2 begins."""
    out: list[Piece] = []
    for step in range(max((len(m) for m in models), default=0)):
        out += [m[step] for m in models if step < len(m)]
    return out


def _torch_library_pieces() -> list[Piece]:
    """torch's shared libraries, largest first: read in big sequential pieces now, the import that
    follows finds them cached instead of faulting them in 128 KB at a time behind the inputs' reads."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or spec.origin is None:
        return []
    libraries = sorted((Path(spec.origin).parent / "lib").glob("*.so*"), key=lambda p: -p.stat().st_size)
    return [piece for lib in libraries for piece in _file_pieces(lib, lib.stat().st_size)]


def _advise_paced(pieces: list[Piece]) -> None:
    """Advise WILLNEED piece by piece, keeping at most IN_FLIGHT pieces queued at the disk.

    The calls only queue reads. Queuing gigabytes at once would make every small read of the imports
    running meanwhile (thousands of .py and .so files) wait behind all of it, and delay the merge's
    start by seconds. Waiting for the oldest queued piece to arrive (a 1-byte read of its last byte)
    before queuing another keeps the disk busy and its queue short."""
    fds: dict[Path, int] = {}
    queued: deque[tuple[int, int]] = deque()
    try:
        for path, offset, length in pieces:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            queued.append((fd, offset + length - 1))
            if len(queued) > IN_FLIGHT:
                oldest, last_byte = queued.popleft()
                os.pread(oldest, 1, last_byte)
    finally:
        for fd in fds.values():
            os.close(fd)


def _budget(models: int) -> int:
    """Bytes to read ahead per model: READ_AHEAD_BYTES, or less so that all of it stays within half of the
    available memory (read-ahead evicted before use would be read twice; the merge releases each input's
    pages once it is merged, so what is read ahead does not pile up)."""
    import psutil

    return min(READ_AHEAD_BYTES, psutil.virtual_memory().available // (2 * max(1, models)))


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
