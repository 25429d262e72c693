"""The command line tunes its own process (huge pages for torch's buffers, a frozen garbage collector) and
leaves a user's explicit choice alone; the library never touches the host process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from mergesmith import cli, process_tuning


def _run_main(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(args)


def test_cli_turns_huge_pages_on_before_torch_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(process_tuning.HUGE_PAGES_VARIABLE, raising=False)
    _run_main(["--help"])
    assert os.environ[process_tuning.HUGE_PAGES_VARIABLE] == "1"


def test_a_users_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(process_tuning.HUGE_PAGES_VARIABLE, "0")
    _run_main(["--help"])
    assert os.environ[process_tuning.HUGE_PAGES_VARIABLE] == "0"


def test_importing_the_library_changes_nothing() -> None:
    code = (
        "import os, gc, mergesmith.api, mergesmith.cli; "
        f"assert {process_tuning.HUGE_PAGES_VARIABLE!r} not in os.environ; assert gc.get_freeze_count() == 0"
    )
    env = {k: v for k, v in os.environ.items() if k != process_tuning.HUGE_PAGES_VARIABLE}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_the_plan_callback_freezes_what_is_alive() -> None:
    started: list[object] = []
    on_plan = cli._warn_then(True, started.append)
    try:
        on_plan(type("Plan", (), {"warnings": []})())
        assert started and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_command_thaws_the_collector_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "cli", _FreezingCommand())
    _run_main(["anything"])
    assert gc.get_freeze_count() == 0


class _FreezingCommand:
    def main(self, **_kw: object) -> None:
        process_tuning.freeze_long_lived_objects()
        assert gc.get_freeze_count() > 0
