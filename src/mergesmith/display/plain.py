"""Progress where a bar cannot be redrawn (a pipe, a log file, a notebook's `!mergesmith`, TERM=dumb):
a plain `progress:` line on stderr every MERGESMITH_PROGRESS_INTERVAL seconds (default 30)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import click

PROGRESS_INTERVAL_ENV = "MERGESMITH_PROGRESS_INTERVAL"


def progress_interval() -> float:
    try:
        value = float(os.environ.get(PROGRESS_INTERVAL_ENV, "30"))
    except ValueError:
        return 30.0
    return value if value > 0 else 30.0


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainProgress:
    """A line on stderr every `interval` seconds (tensors done/total, MB/s, RSS, ETA), since a redrawn bar
    cannot work there. A merge that ends (or fails) before the first interval prints nothing. A line that
    cannot be made stops the lines; its error is raised at the next call on the merge's thread (where
    guard.py reports it), not printed as the printing thread's traceback."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._total_bytes = 0
        self._event: Any = None
        self._base: tuple[float, int] | None = None  # (time, bytes) of the first event: a resume starts there
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: Exception | None = None

    def __enter__(self) -> PlainProgress:
        return self

    def start(self, plan: Any) -> None:
        self.close()
        self._total_bytes = plan.total_size
        self._event, self._base = None, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mergesmith-progress", daemon=True)
        self._thread.start()

    def update(self, event: Any) -> None:
        self._raise_failure()
        with self._lock:
            if self._base is None:
                self._base = (time.monotonic(), event.bytes_written)
            self._event = event

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                line = self.line()
                if line:
                    click.echo(line, err=True)
            except Exception as exc:  # noqa: BLE001 - raised on the merge's thread, see the class docstring
                self.failure = exc
                return

    def _raise_failure(self) -> None:
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def line(self) -> str | None:
        import psutil

        with self._lock:
            event, base = self._event, self._base
        if event is None or base is None:
            return None
        elapsed = time.monotonic() - base[0]
        rate = (event.bytes_written - base[1]) / elapsed if elapsed > 0 else 0.0
        left = max(self._total_bytes - event.bytes_written, 0)
        eta = _clock(left / rate) if rate > 0 else "unknown"
        rss = psutil.Process().memory_info().rss
        return (
            f"progress: {event.tensors_done}/{event.tensors_total} tensors, {rate / 1e6:.1f} MB/s, "
            f"RSS {rss / 1e9:.2f} GB, ETA {eta}"
        )

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None
        self._raise_failure()

    def __exit__(self, *exc: Any) -> None:
        self.close()
