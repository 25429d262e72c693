"""The progress display: tensors done/total, throughput, resident memory and ETA, on stderr."""

from __future__ import annotations

import time
from typing import Any

import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from ..engine.executor import ProgressEvent
from ..engine.plan import Plan


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed / 1e6:7.1f} MB/s" if speed else "      - MB/s", style="cyan")


class _RssColumn(ProgressColumn):
    max_refresh = 0.5

    def render(self, task: Task) -> Text:
        rss = psutil.Process().memory_info().rss
        return Text(f"RSS {rss / 1e9:5.2f} GB", style="magenta")


class MergeProgress:
    """Context manager fed by the executor's progress events; silent when disabled or not a terminal."""

    def __init__(self, enabled: bool = True) -> None:
        self.console = Console(stderr=True)
        # Off a terminal rich cannot redraw, so it would print one stale bar when the merge ends or
        # fails, breaking the promise that an error is exactly one line on stderr.
        self.enabled = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._total = 0
        self._last = 0.0

    def __enter__(self) -> MergeProgress:
        return self

    def start(self, plan: Plan) -> None:
        if not self.enabled:
            return
        self._total = len(plan.recipes)
        self._progress = Progress(
            TextColumn("[bold]merging[/bold] {task.fields[done]}/{task.fields[ntensors]} tensors"),
            BarColumn(),
            _RateColumn(),
            _RssColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("merge", total=plan.total_size, done=0, ntensors=self._total)

    def update(self, event: ProgressEvent) -> None:
        if self._progress is None:
            return
        if not self._last:
            # The first event carries what a resumed run already finished: start the bar there (a reset,
            # so that jump is not taken for throughput and the ETA counts only the work left).
            self._progress.reset(self._task, completed=event.bytes_written, done=event.tensors_done)
        now = time.monotonic()
        if event.tensors_done < event.tensors_total and now - self._last < 0.1:
            return
        self._last = now
        self._progress.update(self._task, completed=event.bytes_written, done=event.tensors_done)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
