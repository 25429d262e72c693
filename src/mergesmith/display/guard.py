"""A progress display that fails must not take the merge with it.

A display is decoration around hours of work: a rich version that renders differently, a terminal that
reports an odd size, a notebook front end without widgets. Whatever goes wrong inside one is reported in
one `warning:` line and the display is switched off; the merge goes on and finishes. KeyboardInterrupt
and other BaseExceptions still pass (a Ctrl-C raised while drawing must stop the merge).

The test suite sets MERGESMITH_DISPLAY_ERRORS=raise (tests/conftest.py), so there a display's failure
is the error it is and no test passes over a broken display.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..errors import display_errors_raise


class Guarded:
    """Wraps a display (any object with methods: start/update/close/__enter__/__exit__, or the router
    bar's update(done, total)); every call goes through `_call`, which turns the first failure into one
    warning, closes the display as far as it can (a live bar restores the cursor) and ignores every later
    call. Attributes that are not methods are read through."""

    def __init__(self, display: Any, what: str = "progress display") -> None:
        self._display = display
        self._what = what
        self.failed = False

    @property
    def inner(self) -> Any:
        return self._display

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._display, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(attr, *args, **kwargs)

        return call

    def __enter__(self) -> Guarded:
        self._call(self._display.__enter__)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._call(self._display.__exit__, *exc)

    def _call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return None
        try:
            return method(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - see the module docstring; the tests' switch re-raises
            if display_errors_raise():
                raise
            self.failed = True
            self._shut()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            sys.stderr.write(
                f"warning: the {self._what} failed ({exc.__class__.__name__}: {first}); going on without it\n"
            )
            sys.stderr.flush()
            return None

    def _shut(self) -> None:
        """Stop what the failed display started (a live bar's refresh thread, a hidden cursor), if it can."""
        for name in ("close", "__exit__"):
            method = getattr(self._display, name, None)
            if method is None:
                continue
            try:
                method(None, None, None) if name == "__exit__" else method()
            except Exception:  # noqa: BLE001, S110 - it has failed once already; the warning says so
                pass
            return
