"""Progress on a terminal: rich bars on stderr (the merge's tensors, MB/s, resident memory and ETA; a
count of prompts or modules for the steps before or beside a merge), and the choice of display for a
command (`merge_progress`): the bar on an interactive terminal, plain lines elsewhere, nothing with -q.

Each bar fits the terminal's width, frame by frame: a frame wider than the terminal wraps, and the next
redraw (which moves the cursor up one line per frame line it drew) then leaves broken lines behind. So on
a narrow terminal the least useful columns go first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psutil
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from rich.text import Text

from ..engine.execution.local_executor import ProgressEvent
from ..engine.plan import Plan
from .guard import Guarded
from .plain import PlainProgress, progress_interval

MIN_BAR = 10  # columns: a narrower bar says too little to be worth its place
BAR_WIDTH = 40  # rich's own default, where the terminal has room for it


class _RateColumn(ProgressColumn):
    """Bytes written per second. rich's own speed needs samples a second apart, so a merge that ends sooner
    (the quick start's) would end on `- MB/s`: a finished task shows its average over the time it ran."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed and task.finished and task.elapsed:
            speed = task.completed / task.elapsed
        return Text(f"{speed / 1e6:7.1f} MB/s" if speed else "      - MB/s", style="cyan")


class _RssColumn(ProgressColumn):
    max_refresh = 0.5

    def render(self, task: Task) -> Text:
        rss = psutil.Process().memory_info().rss
        return Text(f"RSS {rss / 1e9:5.2f} GB", style="magenta")


def _bar() -> BarColumn:
    return BarColumn(bar_width=None, table_column=Column(ratio=1))  # FittingProgress sets its width per frame


class FittingProgress(Progress):
    """A rich Progress given several column sets, widest first; each frame uses the first set that fits
    the console's width now (so a resized window is followed), the last set if none does.

    rich also draws from its own refresh thread, where a failure would print a thread's traceback and
    leave the bar frozen: a frame that fails is drawn empty and its error kept in `failure`, which
    `raise_failure` raises on the caller's thread (the guard reports it there)."""

    def __init__(self, column_sets: Sequence[Sequence[ProgressColumn]], console: Console) -> None:
        # set first: rich's __init__ already renders a first (empty) frame
        self._column_sets = [tuple(columns) for columns in column_sets]
        self._screen = console
        self.failure: Exception | None = None
        super().__init__(*column_sets[0], console=console, expand=True, transient=False)

    def get_renderable(self) -> RenderableType:
        try:
            return super().get_renderable()
        except Exception as exc:  # noqa: BLE001 - kept for the caller's thread, see the class docstring
            self.failure = self.failure or exc
            return Text("")

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def make_tasks_table(self, tasks: Iterable[Task]) -> Table:
        tasks = list(tasks)
        width = self._screen.width
        chosen, natural = self._column_sets[-1], 0
        for columns in self._column_sets:
            natural = self._natural_width(columns, tasks)
            if natural <= width:
                chosen = columns
                break
        # rich's usual 40-column bar where it fits; else the bar takes what the other columns leave
        roomy = natural - MIN_BAR + BAR_WIDTH <= width
        for column in chosen:
            if isinstance(column, BarColumn):
                column.bar_width = BAR_WIDTH if roomy else None
        self.expand = not roomy
        self.columns = chosen
        return super().make_tasks_table(tasks)

    def _natural_width(self, columns: Sequence[ProgressColumn], tasks: list[Task]) -> int:
        options = self._screen.options
        total = len(columns) - 1  # a space between columns
        for column in columns:
            if isinstance(column, BarColumn):
                total += MIN_BAR
                continue
            total += max((Measurement.get(self._screen, options, column(task)).maximum for task in tasks), default=0)
        return total


class _LiveBar:
    """What the live bars share: drawn on an interactive stderr only (a pipe, a file or TERM=dumb cannot be
    redrawn, and would keep one stale bar where an error must be one line), stopped once, and a failure of
    rich's refresh thread raised here, where display/guard.py turns it into one warning."""

    def __init__(self, enabled: bool) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal and not self.console.is_dumb_terminal
        self._progress: FittingProgress | None = None
        self._task: Any = None

    def __enter__(self) -> Any:
        return self

    def close(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()
            progress.raise_failure()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MergeProgress(_LiveBar):
    """Context manager fed by the executor's progress events; silent when disabled or not an interactive
    terminal (a pipe, a file, TERM=dumb: there rich cannot redraw, and would print one stale bar when the
    merge ends or fails, breaking the promise that an error is exactly one line on stderr)."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(enabled)
        self._last = 0.0

    def start(self, plan: Plan) -> None:
        self.close()  # a multi-stage run starts one bar per stage, and rich allows one live display at a time
        if not self.enabled:
            return
        label = TextColumn("[bold]merging[/bold] {task.fields[done]}/{task.fields[ntensors]} tensors")
        eta, remaining = TextColumn("ETA"), TimeRemainingColumn()
        self._progress = FittingProgress(
            [
                (label, _bar(), _RateColumn(), _RssColumn(), TimeElapsedColumn(), eta, remaining),
                (label, _bar(), _RateColumn(), eta, remaining),
                (label, _bar(), remaining),
                (label, _bar()),
            ],
            self.console,
        )
        self._progress.start()
        self._task = self._progress.add_task("merge", total=plan.total_size, done=0, ntensors=len(plan.recipes))
        self._last = 0.0
        self._progress.raise_failure()

    def update(self, event: ProgressEvent) -> None:
        if self._progress is None:
            return
        if not self._last:
            # The first event carries what a resumed run already finished: start the bar there (a reset,
            # so that jump is not taken for throughput and the ETA counts only the work left). Fields stay
            # out of reset(): given any, rich replaces them all, and the label's `ntensors` would be gone.
            self._progress.reset(self._task, completed=event.bytes_written)
        now = time.monotonic()
        if event.tensors_done < event.tensors_total and now - self._last < 0.1:
            return
        self._last = now
        self._progress.update(self._task, completed=event.bytes_written, done=event.tensors_done)
        self._progress.raise_failure()



class CountProgress(_LiveBar):
    """A bar over a count (`label ━━━ 3/12 unit`) for steps fed `(done, total)`: the MoE router pass over
    prompts, LoRA extraction over modules. Drawn on an interactive terminal only, from the first update."""

    def __init__(self, label: str, unit: str, enabled: bool = True) -> None:
        super().__init__(enabled)
        self.label = label
        self.unit = unit

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            label, count = TextColumn(f"[bold]{self.label}[/bold]"), MofNCompleteColumn()
            unit = TextColumn(self.unit)
            self._progress = FittingProgress(
                [(label, _bar(), count, unit, TimeElapsedColumn()), (label, _bar(), count, unit), (label, count)],
                self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=total)
        self._progress.update(self._task, completed=done, total=total)
        self._progress.raise_failure()



class StageProgress:
    """One display per stage that does work (`factory()` makes each); a stage that is already complete
    (a plan, then no progress event) shows none, where a bar would sit at 0/N."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self._plan: Any = None
        self._display: Any = None

    def __enter__(self) -> StageProgress:
        return self

    def start(self, plan: Any) -> None:
        self.close()
        self._plan = plan

    def update(self, event: Any) -> None:
        if self._display is None and self._plan is not None:
            self._display = self.factory().__enter__()
            self._display.start(self._plan)
        if self._display is not None:
            self._display.update(event)

    def close(self) -> None:
        if self._display is not None:
            self._display.__exit__(None, None, None)
        self._display = None
        self._plan = None

    def __exit__(self, *exc: Any) -> None:
        self.close()


def merge_progress(quiet: bool) -> Any:
    """A command's merge display: the live bar on an interactive terminal, plain periodic lines elsewhere,
    nothing with -q; guarded, so a failure inside it is a warning, never the end of the merge."""
    display = MergeProgress(enabled=not quiet)
    if quiet or display.enabled:
        return Guarded(display)
    return Guarded(PlainProgress(progress_interval()))


def count_progress(label: str, unit: str, enabled: bool = True) -> Any:
    """A guarded CountProgress."""
    return Guarded(CountProgress(label, unit, enabled))
