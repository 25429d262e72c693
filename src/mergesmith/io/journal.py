"""The resume journal: `<out>/.cache/huggingface/mergesmith/journal.json`.

Why there: a finished output directory is what gets published (`huggingface-cli upload`,
`HfApi.upload_folder`), and the Hub client's own rules skip `.cache/huggingface/` (its
DEFAULT_IGNORE_PATTERNS; the Hub refuses any `.cache/` path besides), where it keeps its own
download and upload bookkeeping; a `.gitignore` of `*` there keeps it out of a git push too. The
journal must outlive the merge (a rerun of a complete merge trusts it and does nothing, `--verify`
and `multi`'s skipping of finished stages read it), so it goes where uploads never look rather than
being deleted. Earlier versions kept it in `<out>/.mergesmith/`: such a directory is moved here
by the next run, so a merge an older version started still resumes. Deleting the state of a complete
merge is safe: the model files never need it; a rerun into the directory then finds it "not empty" and
asks for `--overwrite` instead of saying "already complete". (Deleted mid-merge, the merge cannot resume.)

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

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

from ..errors import OutputError
from . import safe_fs
from .safetensors_writer import write_file_atomic

STATE_PARTS = (".cache", "huggingface", "mergesmith")
"""The state directory's path below the output directory, one component at a time (for safe_fs)."""
STATE_DIR = "/".join(STATE_PARTS)
STATE_TOP = STATE_PARTS[0]
"""The entry of the output directory that holds the state (tests and listings leave it out)."""
LEGACY_STATE_DIR = ".mergesmith"
"""Where earlier versions kept the state; moved to STATE_DIR by the next run (`adopt_legacy_state`)."""
JOURNAL_NAME = "journal.json"
PARTIAL_DIR = "partial"
LOCK_NAME = "lock"
_HUB_DIR_ENTRIES = frozenset({STATE_PARTS[2], ".gitignore", "CACHEDIR.TAG"})
"""What `.cache/huggingface/` may hold for the directory to count as only mergesmith's state."""


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
        is one reached through a link (a state directory or the journal itself: never read as ours).

        An older version's journal (`.mergesmith/`) is the one read when there is one, as the next run
        adopts it (`adopt_legacy_state`): it can only be newer than ours, since every run moves it here.
        """
        text = _read_journal(out_dir, (LEGACY_STATE_DIR,))
        if text is None:
            text = _read_journal(out_dir, STATE_PARTS)
        if text is None:
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


def _read_journal(out_dir: Path, parts: tuple[str, ...]) -> bytes | None:
    try:
        with safe_fs.opened_dir(out_dir, parts) as dfd:
            return safe_fs.read_regular(dfd, JOURNAL_NAME, limit=1 << 30)
    except (OSError, OutputError):
        return None


def state_path(out_dir: Path) -> Path:
    return out_dir.joinpath(*STATE_PARTS)


def journal_path(out_dir: Path) -> Path:
    return state_path(out_dir) / JOURNAL_NAME


def partial_path(out_dir: Path, shard: str) -> Path:
    return state_path(out_dir) / PARTIAL_DIR / f"{shard}.partial"


def is_state_only(entry: Path) -> bool:
    """Whether `entry` (a top-level entry of `out_dir`) is mergesmith's state and nothing else: the legacy
    `.mergesmith` directory, or `.cache` holding only `huggingface/` with only our state (and the ignore
    and cache-tag files) in it. A `.cache` with anything else is somebody's (a download's bookkeeping)."""
    if entry.name == LEGACY_STATE_DIR:
        return entry.is_dir() and not entry.is_symlink()
    if entry.name != STATE_TOP or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        hub = entry / STATE_PARTS[1]
        if [p.name for p in entry.iterdir()] != [STATE_PARTS[1]] or hub.is_symlink():
            return False
        return {p.name for p in hub.iterdir()} <= _HUB_DIR_ENTRIES
    except OSError:
        return False


def foreign_entries(out_dir: Path) -> list[Path]:
    """The entries of `out_dir` that are not mergesmith's state (what makes it "not empty")."""
    return [p for p in out_dir.iterdir() if not is_state_only(p)]


def refuse_non_directory(out_dir: Path) -> None:
    """The one-line refusal of an output path that exists as something other than a directory, checked
    before any tensor is read."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: output path exists and is not a directory")


def ensure_writable_dir(out_dir: Path) -> None:
    """Create the output directory and its state directory, or say in one line why it cannot be used
    (a link on the way included: see safe_fs; a link inside it is for `--overwrite` to remove or the
    writer to refuse). `.cache/huggingface/` gets the `.gitignore` the Hub client itself writes there."""
    refuse_non_directory(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # the directory the user named: links allowed there
        os.close(safe_fs.open_dir(out_dir, STATE_PARTS, create=True))
        with safe_fs.opened_dir(out_dir, STATE_PARTS[:2]) as hub:
            if not os.path.lexists(out_dir.joinpath(*STATE_PARTS[:2], ".gitignore")):
                try:
                    safe_fs.write_new_file(hub, ".gitignore", b"*\n")
                except FileExistsError:
                    pass
    except PermissionError:
        raise OutputError(f"{out_dir}: permission denied creating the output directory") from None
    except OSError as exc:
        raise OutputError(f"{out_dir}: cannot create the output directory ({exc.strerror or exc})") from None


def adopt_legacy_state(out_dir: Path) -> None:
    """Move an older version's state (`<out>/.mergesmith/`: journal, partial shards) to STATE_DIR, so a
    merge it started resumes and nothing of it is left where an upload would publish it.

    Called by a run that holds the new lock. The old lock is taken too, so a run of the older version
    still writing here is refused rather than robbed of its files. A `.mergesmith` that is a link is not
    ours to read: it is left for `--overwrite` (which removes the link, never what it points to).
    """
    legacy = out_dir / LEGACY_STATE_DIR
    if legacy.is_symlink() or not legacy.is_dir():
        return
    with safe_fs.opened_dir(out_dir, (LEGACY_STATE_DIR,)) as old, safe_fs.opened_dir(out_dir, STATE_PARTS) as new:
        lock = safe_fs.open_lock_file(old, LOCK_NAME)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OutputError(
                        f"{out_dir}: another mergesmith process (an older version, using {LEGACY_STATE_DIR}/) is "
                        "writing to this directory; wait for it or stop it first"
                    ) from None
            names = set(os.listdir(old)) - {LOCK_NAME}
            if JOURNAL_NAME in names and not safe_fs.is_link(old, JOURNAL_NAME):
                for name in os.listdir(new):  # ours is older than the legacy journal (see Journal.load)
                    if name != LOCK_NAME:
                        safe_fs.remove_tree(new, name)
                for name in sorted(names):
                    os.rename(name, name, src_dir_fd=old, dst_dir_fd=new)
                safe_fs.fsync_fd(new)
        finally:
            os.close(lock)
    with safe_fs.opened_dir(out_dir) as root:
        safe_fs.remove_tree(root, LEGACY_STATE_DIR)
