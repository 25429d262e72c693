"""The resume journal: `<out>/.mergesmith/journal.json`.

It records the plan's fingerprint, the random seed, every finished shard (size and checksum), and
for shards in progress the tensors already durable in their partial file (name -> CRC). It is only
ever replaced atomically, and only after the bytes it vouches for were fsync'ed, so after any kill
the journal never claims more than what is on disk.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import OutputError
from . import safe_fs
from .safetensors_writer import write_file_atomic

STATE_DIR = ".mergesmith"
JOURNAL_NAME = "journal.json"
PARTIAL_DIR = "partial"


@dataclass
class Journal:
    out_dir: Path
    fingerprint: str
    random_seed: int | None = None
    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    partial: dict[str, dict[str, int]] = field(default_factory=dict)
    complete: bool = False

    @property
    def path(self) -> Path:
        return journal_path(self.out_dir)

    def save(self) -> None:
        data = {
            "format": 1,
            "fingerprint": self.fingerprint,
            "random_seed": self.random_seed,
            "finished": self.finished,
            "partial": self.partial,
            "complete": self.complete,
        }
        write_file_atomic(self.path, json.dumps(data, indent=1, sort_keys=True).encode(), root=self.out_dir)

    @classmethod
    def load(cls, out_dir: Path) -> Journal | None:
        """The journal in `out_dir`, or None if there is none; a corrupt one is treated as absent, and so
        is one reached through a link (`.mergesmith` or the journal itself: never read as ours)."""
        try:
            with safe_fs.opened_dir(out_dir, (STATE_DIR,)) as dfd:
                text = safe_fs.read_regular(dfd, JOURNAL_NAME, limit=1 << 30)
        except (OSError, OutputError):
            return None
        try:
            data = json.loads(text.decode("utf-8"))
            return cls(
                out_dir=out_dir,
                fingerprint=str(data["fingerprint"]),
                random_seed=data.get("random_seed"),
                finished=dict(data.get("finished") or {}),
                partial={k: {n: int(c) for n, c in v.items()} for k, v in (data.get("partial") or {}).items()},
                complete=bool(data.get("complete")),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None


def journal_path(out_dir: Path) -> Path:
    return out_dir / STATE_DIR / JOURNAL_NAME


def partial_path(out_dir: Path, shard: str) -> Path:
    return out_dir / STATE_DIR / PARTIAL_DIR / f"{shard}.partial"


def refuse_non_directory(out_dir: Path) -> None:
    """The one-line refusal of an output path that exists as something other than a directory, checked
    before any tensor is read."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: output path exists and is not a directory")


def ensure_writable_dir(out_dir: Path) -> None:
    """Create the output directory and its `.mergesmith`, or say in one line why it cannot be used
    (`.mergesmith` a link included: see safe_fs; a link inside it is for `--overwrite` to remove or the
    writer to refuse)."""
    refuse_non_directory(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # the directory the user named: links allowed there
        os.close(safe_fs.open_dir(out_dir, (STATE_DIR,), create=True))
    except PermissionError:
        raise OutputError(f"{out_dir}: permission denied creating the output directory") from None
    except OSError as exc:
        raise OutputError(f"{out_dir}: cannot create the output directory ({exc.strerror or exc})") from None
