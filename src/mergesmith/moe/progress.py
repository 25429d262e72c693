"""Progress of the router-weights pass (a base-model forward pass over every prompt) on stderr."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RouterProgress:
    """Context manager fed `(prompts done, prompts total)`; silent when disabled or never fed."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> RouterProgress:
        return self

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            self._progress = Progress(
                TextColumn(f"[bold]{self.label}[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("prompts"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._progress.start()
            self._task = self._progress.add_task("router", total=total)
        self._progress.update(self._task, completed=done, total=total)

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
