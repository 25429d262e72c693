"""The search journal under the storage path: resumable, crash-consistent, one writer at a time.

- `evolve.json`: the search's fingerprint (genome, tasks, data, seed, options that change scores);
- `optimizer.pkl`: the CMA-ES state after the last finished generation (written atomically);
- `history.jsonl`: one line per scored candidate, appended and fsync'ed as each finishes; a torn last
  line (a kill mid-write) is dropped on load;
- `best_config.yml`: the best candidate's merge config so far, replaced atomically.
A rerun reloads the optimiser, asks it for the same generation again (its random generator is part of
the pickled state) and scores only the candidates the history lacks: with the same seed the history is
the one an uninterrupted run writes.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import yaml

from ..errors import OutputError
from ..io._test_hooks import kill_point
from ..io.safetensors_writer import write_file_atomic

STATE_NAME = "evolve.json"
OPTIMIZER_NAME = "optimizer.pkl"
HISTORY_NAME = "history.jsonl"
BEST_NAME = "best_config.yml"
OWNED = (STATE_NAME, OPTIMIZER_NAME, HISTORY_NAME, BEST_NAME, "summary.json", "search.png", "candidate")


class SearchJournal:
    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self, fingerprint: str, describe: dict[str, Any], overwrite: bool) -> bool:
        """Open (or start) the journal; True when resuming. A different search is refused unless `overwrite`."""
        if self.root.is_symlink():
            raise OutputError(f"{self.root}: is a symbolic link; give the storage path itself")
        if self.root.exists() and not self.root.is_dir():
            raise OutputError(f"{self.root}: storage path exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        state_path = self.root / STATE_NAME
        if state_path.is_file():
            previous = json.loads(state_path.read_text())
            if previous.get("fingerprint") == fingerprint and not overwrite:
                return True
            if not overwrite:
                raise OutputError(
                    f"{self.root}: holds a search with a different genome, tasks or options; use --overwrite to "
                    "start over"
                )
        if overwrite:
            for name in OWNED:
                path = self.root / name
                if path.is_dir() and not path.is_symlink():
                    import shutil

                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
        write_file_atomic(state_path, (json.dumps({"fingerprint": fingerprint, **describe}, indent=2) + "\n").encode())
        return False

    # -- optimiser ----------------------------------------------------------------------------------------
    def load_optimizer(self) -> Any | None:
        path = self.root / OPTIMIZER_NAME
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - our own file, in the user's own storage path

    def save_optimizer(self, state: Any) -> None:
        write_file_atomic(self.root / OPTIMIZER_NAME, pickle.dumps(state))

    # -- history ------------------------------------------------------------------------------------------
    def history(self) -> list[dict[str, Any]]:
        path = self.root / HISTORY_NAME
        if not path.is_file():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line: the candidate is scored again
        return sorted(rows, key=lambda r: r["evaluation"])

    def append(self, row: dict[str, Any]) -> None:
        path = self.root / HISTORY_NAME
        self._drop_torn_tail(path)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        kill_point("evolve_candidate")  # crash tests: SIGKILL after the n-th journaled candidate

    @staticmethod
    def _drop_torn_tail(path: Path) -> None:
        """A kill mid-append leaves a line without its newline; cut it before appending."""
        if not path.is_file():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            write_file_atomic(path, keep)

    def rewrite_history(self, rows: list[dict[str, Any]]) -> None:
        """History in evaluation order (parallel scoring appends in finishing order)."""
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        write_file_atomic(self.root / HISTORY_NAME, text.encode())

    def save_best(self, config: dict[str, Any]) -> None:
        write_file_atomic(self.root / BEST_NAME, yaml.safe_dump(config, sort_keys=False).encode())

    def save_summary(self, summary: dict[str, Any]) -> None:
        write_file_atomic(self.root / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
