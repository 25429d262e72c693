"""Progress for Python callers: a live bar under Jupyter/Colab, the terminal bar or plain lines elsewhere.

The library shows nothing unless asked (`progress=True`). Asked, it picks what the place can show:
- under a Jupyter kernel (Colab, Kaggle, JupyterLab), a tqdm.auto bar (a widget where ipywidgets is
  installed, a redrawn text line otherwise) with tensors done, bytes, resident memory against what
  this process may use, and ETA; rich's live display would need a terminal there;
- on a terminal, the command line's rich bar (terminal.MergeProgress);
- anywhere else (a log file, a pipe, a batch job), the command line's periodic `progress:` lines.
Either way the last line says where the model is. A failure inside our display is a warning, never the
end of the merge (guard.py); the caller's own callable is the caller's, and what it raises propagates.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..sizes import human_size
from .guard import Guarded

NOTEBOOK_REFRESH_S = 0.25


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (Colab included). IPython is never imported here: a
    kernel has already imported it."""
    if "google.colab" in sys.modules:
        return True
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an odd IPython: not a notebook we know how to draw in
        return False
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")


class NotebookProgress:
    """A tqdm.auto bar over the bytes written; its postfix shows tensors, RSS against the memory this
    process may use, and tqdm computes the rate and ETA (from the first event, so a resumed merge's
    rate counts only this run's work)."""

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self._bar: Any = None
        self._plan: Any = None
        self._limit = 0
        self._last = 0.0
        self._write = write or print

    def __enter__(self) -> NotebookProgress:
        return self

    def start(self, plan: Any) -> None:
        import psutil

        from ..runtime.memory_limits import memory_room

        self.close()
        self._plan = plan
        self._limit = psutil.Process().memory_info().rss + memory_room().available

    def update(self, event: Any) -> None:
        if self._plan is None:
            return
        import psutil

        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self._plan.total_size,
                initial=event.bytes_written,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc="merging",
                dynamic_ncols=True,
                mininterval=NOTEBOOK_REFRESH_S,
            )
        now = time.monotonic()
        if event.tensors_done < event.tensors_total and now - self._last < NOTEBOOK_REFRESH_S:
            return
        self._last = now
        rss = psutil.Process().memory_info().rss
        self._bar.set_postfix_str(
            f"{event.tensors_done}/{event.tensors_total} tensors, RSS {human_size(rss)} of {human_size(self._limit)}",
            refresh=False,
        )
        self._bar.update(event.bytes_written - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CallbackProgress:
    """`progress=callable`: the caller's function gets every executor ProgressEvent."""

    def __init__(self, callback: Callable[[Any], None]) -> None:
        self.callback = callback

    def __enter__(self) -> CallbackProgress:
        return self

    def start(self, plan: Any) -> None:
        pass

    def update(self, event: Any) -> None:
        self.callback(event)

    def __exit__(self, *exc: Any) -> None:
        pass


class Silent(CallbackProgress):
    def __init__(self) -> None:
        super().__init__(lambda _event: None)


def choose_display(progress: bool | Callable[[Any], None] | None) -> Any:
    """The display for `progress`: None/False nothing, a callable itself, True what this place can show."""
    if progress is None or progress is False:
        return Silent()
    if callable(progress):
        return CallbackProgress(progress)
    if in_notebook():
        return Guarded(NotebookProgress())
    from .terminal import merge_progress

    return merge_progress(quiet=False)  # rich on a terminal, periodic `progress:` lines elsewhere (guarded)


def final_line(out_dir: Path, result: Any) -> str:
    """The last line of a shown merge: where the model is (and what it holds)."""
    plan = result.plan
    if result.already_complete:
        return f"{out_dir}: already complete (same config and inputs); nothing to do"
    seed = f", random seed {plan.random_seed}" if plan.random_seed is not None else ""
    return (
        f"model written to {Path(out_dir).resolve()} ({len(plan.recipes)} tensors in {len(plan.shards)} shard(s), "
        f"{human_size(plan.total_size)}) in {result.seconds:.1f}s{seed}"
    )


def result_lines(out_dir: Path, result: Any, prefix: str = "") -> list[str]:
    """What a shown run prints at its end, as the command line does: `resumed: ...` when it continued an
    earlier run, then the final line."""
    resumed = result.resume_line()
    lines = [resumed] if resumed is not None and not result.already_complete else []
    return [prefix + line for line in [*lines, final_line(out_dir, result)]]
