"""Writing a plan's output: one writer per shard in progress, each shard finished (fsync + rename) and journaled
as soon as its last tensor lands, and the tensors written so far made durable and journaled every second by a
background thread, so a kill loses little and a rerun resumes after them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...io.journal import Journal, partial_path
from ...io.safetensors_writer import ShardWriter
from ..plan import ShardPlan

JOURNAL_INTERVAL_S = 1.0


class ShardOutputs:
    """The output shards in progress in `out_dir`, and the journal that records what of them is durable."""

    def __init__(self, out_dir: Path, journal: Journal) -> None:
        self.out_dir = out_dir
        self.journal = journal
        self._lock = threading.Lock()
        self._writers: dict[str, ShardWriter] = {}

    def open(self, shard: ShardPlan) -> ShardWriter:
        """The writer of `shard`, resuming from the tensors the journal holds of it."""
        writer = ShardWriter(
            self.out_dir / shard.filename,
            partial_path(self.out_dir, shard.filename),
            [stored for r in shard.recipes for stored in r.stored()],
            resume=self.journal.partial.get(shard.filename),
            root=self.out_dir,
        )
        with self._lock:
            self._writers[shard.filename] = writer
        return writer

    def writer(self, filename: str) -> ShardWriter:
        with self._lock:
            return self._writers[filename]

    def finish(self, filename: str) -> None:
        """Finish shard `filename` (its last tensor written) and journal it as done."""
        with self._lock:
            writer = self._writers.pop(filename)
        checksum = writer.finish()
        with self._lock:
            self.journal.finished[filename] = {"size": writer.size, "checksum": checksum}
            self.journal.partial.pop(filename, None)
            self.journal.save()

    def journal_progress(self) -> None:
        """Record the durable tensors of shards in progress (fdatasync outside the lock)."""
        with self._lock:
            writers = list(self._writers.items())
        synced = {name: writer.sync() for name, writer in writers}
        with self._lock:
            for name, crcs in synced.items():
                if name not in self.journal.finished:
                    self.journal.partial[name] = crcs
            self.journal.save()

    def close(self) -> None:
        """Close the unfinished shards' files and writer threads (they stay journaled for a rerun)."""
        with self._lock:
            writers = list(self._writers.values())
        for writer in writers:
            writer.close()

    @contextmanager
    def flushing(self, on_error: Callable[[BaseException], None]) -> Iterator[None]:
        """Background writeback while the body runs: every interval, make written tensors durable and journal
        them. Doing this off the worker threads overlaps the disk's writeback with reading and merging
        (instead of one long fsync per shard at the end) and never stalls a worker on the disk. An OSError
        (e.g. ENOSPC at writeback) goes to `on_error` and ends the loop."""
        done = threading.Event()

        def loop() -> None:
            while not done.wait(JOURNAL_INTERVAL_S):
                try:
                    self.journal_progress()
                except OSError as exc:
                    on_error(exc)
                    return

        flusher = threading.Thread(target=loop, name="merge-flush", daemon=True)
        flusher.start()
        try:
            yield
        finally:
            done.set()
            flusher.join()
