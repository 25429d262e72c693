"""Ctrl-C during a command that writes a model: the first asks the run to stop at a resumable point (after the
tensors in flight), the second quits at once.

Why here and not in cli.py: every face that runs a merge in the foreground (the command line, a script driving
the same displays) needs the same two-step behaviour, and the library must not import the command line."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import click


class Interrupts:
    """First Ctrl-C asks the merge to stop after the tensors in flight; a second one exits at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, _signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            quit_at_once(_signum, _frame)
        self.stop.set()
        click.echo("\nstopping after the tensors in flight (Ctrl-C again to quit at once)...", err=True)

    def __exit__(self, *exc: Any) -> None:
        if self._previous is None:
            return
        if self.stop.is_set():
            # Shutdown after a stop (joining threads, atexit callbacks) can take a while; a Ctrl-C
            # there must quit at once, not print a KeyboardInterrupt traceback from an atexit hook.
            signal.signal(signal.SIGINT, quit_at_once)
        else:
            signal.signal(signal.SIGINT, self._previous)


def quit_at_once(_signum: int, _frame: Any) -> None:
    """The second Ctrl-C: leave now, without unwinding (the journal already holds what is finished)."""
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a half-written line must not keep us from exiting
        pass
    os.write(2, b"\ninterrupted again: quitting at once\n")
    os._exit(130)
