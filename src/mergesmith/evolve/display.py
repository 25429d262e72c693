"""What a user sees during a search: a live rich table on a terminal, one line per candidate otherwise.

The table is decoration around a search that may run for hours: if drawing it fails, one `warning:` line
says so and the search goes on with the plain lines (as display/guard.py does for the merge bars; the
test suite's MERGESMITH_DISPLAY_ERRORS=raise makes such a failure the error it is there).
"""

from __future__ import annotations

import time
from typing import Any

import click

from ..errors import display_errors_raise
from ..sizes import human_size


def _interactive_stdout() -> bool:
    """Whether stdout is a terminal that can redraw (not a pipe, a file or TERM=dumb), as rich decides."""
    from rich.console import Console

    console = Console()
    return console.is_terminal and not console.is_dumb_terminal


def estimate_lines(est: dict[str, Any]) -> list[str]:
    where = "in memory (nothing written)" if est["in_memory"] else "on disk, one reused directory"
    return [
        f"genome: {est['parameters']} parameters (layer groups x models x parameter sets x method parameters = "
        f"{' x '.join(map(str, est['shape']))})",
        f"per candidate: reads {human_size(est['bytes_read'])}, merges {human_size(est['merged_bytes'])} {where}; "
        f"memory about {human_size(est['memory_bytes'])}; disk {human_size(est['disk_bytes'])}; merge about "
        f"{est['merge_seconds']:.1f} s from the read speed (evaluation time is measured on the first candidate)",
    ]


class SearchDisplay:
    """Receives the search's events; draws a rich Live table when stdout is a terminal."""

    def __init__(self, quiet: bool = False, live: bool | None = None) -> None:
        self.quiet = quiet
        self.live_enabled = (_interactive_stdout() if live is None else live) and not quiet
        self.live: Any = None
        self.recent: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.done = 0
        self.max_fevals = 0
        self.started = time.monotonic()
        self.first_done = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "warning":
            click.echo(f"warning: {data['text']}", err=True)
        elif kind == "estimate" and not self.quiet:
            for line in estimate_lines(data):
                click.echo(line)
        elif kind == "start":
            self.done = self.first_done = data["done"]
            self.best = data["best"]
            self.max_fevals = data["max_fevals"]
            if not self.quiet:
                what = f"resuming after {data['done']} candidates" if data["resumed"] else "starting"
                click.echo(f"{what}: population {data['popsize']}, up to {data['max_fevals']} evaluations")
            if self.live_enabled:
                self._draw(start=True)
        elif kind == "candidate":
            row = data["row"]
            self.done, self.best = data["done"], data["best"]
            self.recent = (self.recent + [row])[-6:]
            if self.live is not None:
                self._draw()
            if self.live is None and not self.quiet:
                click.echo(
                    f"[{row['evaluation']:>4}] gen {row['generation']:>3} fitness {row['fitness']:.4f} "
                    f"({row['seconds']:.1f} s)  best {self.best['fitness']:.4f} (#{self.best['evaluation']})"
                )

    def _draw(self, start: bool = False) -> None:
        """Start or redraw the live table; on a failure, one warning and the plain lines from here on."""
        try:
            if start:
                from rich.live import Live

                self.live = Live(self._table(), refresh_per_second=2, transient=False)
                self.live.start()
            elif self.live is not None:
                self.live.update(self._table())
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            if display_errors_raise():
                raise
            try:
                self.close()
            except Exception:  # noqa: BLE001, S110 - it has failed once already; the warning says so
                self.live = None
            self.live_enabled = False
            click.echo(f"warning: the progress display failed ({exc.__class__.__name__}: {exc}); going on without it",
                       err=True)

    def close(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            live.stop()

    def _eta(self) -> str:
        fresh = self.done - self.first_done
        if fresh <= 0:
            return "-"
        per = (time.monotonic() - self.started) / fresh
        return f"{max(0, self.max_fevals - self.done) * per:.0f} s"

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title=f"evaluations {self.done}/{self.max_fevals}   ETA {self._eta()}")
        table.add_column("#", justify="right")
        table.add_column("gen", justify="right")
        table.add_column("fitness", justify="right")
        table.add_column("scores")
        table.add_column("s", justify="right")
        for row in self.recent:
            scores = ", ".join(f"{t}: {next(iter(m.values())):.3f}" for t, m in row["scores"].items())
            table.add_row(str(row["evaluation"]), str(row["generation"]), f"{row['fitness']:.4f}", scores,
                          f"{row['seconds']:.1f}")
        if self.best is not None:
            params = ", ".join(f"{k}={v:.3f}" for k, v in list(self.best["named_params"].items())[:8])
            table.caption = f"best {self.best['fitness']:.4f} (#{self.best['evaluation']}): {params}"
        return table
