"""The command line tunes its own process (huge pages for torch's buffers, a frozen garbage collector) and
leaves a user's explicit choice alone; the library never touches the host process."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys

import pytest

from mergesmith import cli
from mergesmith.display.command_output import warn_then
from mergesmith.runtime import process_tuning


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
        "import os, gc, mergesmith.engine.run, mergesmith.cli; "
        f"assert {process_tuning.HUGE_PAGES_VARIABLE!r} not in os.environ; assert gc.get_freeze_count() == 0"
    )
    env = {k: v for k, v in os.environ.items() if k != process_tuning.HUGE_PAGES_VARIABLE}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_the_plan_callback_freezes_what_is_alive() -> None:
    started: list[object] = []
    on_plan = warn_then(started.append)
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


class _Exited(Exception):
    pass


@pytest.mark.parametrize("raised,code", [(SystemExit(0), 0), (SystemExit(2), 2), (SystemExit(None), 0), (None, 0)])
def test_the_console_script_leaves_with_mains_exit_code(monkeypatch: pytest.MonkeyPatch, raised, code) -> None:
    def fake_main() -> None:
        if raised is not None:
            raise raised

    def fake_exit(status: int) -> None:
        raise _Exited(status)

    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(process_tuning, "_numba_blas_wanted", True)  # run() clears it: put back after the test
    monkeypatch.setattr(process_tuning.os, "_exit", fake_exit)
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(process_tuning.atexit, "_run_exitfuncs", lambda: None)
    with pytest.raises(_Exited) as exited:
        cli.run()
    assert exited.value.args == (code,)


def test_with_ray_loaded_the_exit_is_a_normal_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", object())
    monkeypatch.setattr(cli, "main", lambda: None)
    monkeypatch.setattr(process_tuning, "_numba_blas_wanted", True)
    with pytest.raises(SystemExit) as exited:
        cli.run()
    assert exited.value.code == 0


def test_the_quick_exit_runs_atexit_handlers_and_flushes(tmp_path) -> None:
    """Real process: output written just before the exit arrives, atexit handlers run, the status is kept."""
    code = (
        "import atexit, sys; from mergesmith.cli import run; "
        "atexit.register(lambda: print('atexit ran', flush=False)); "
        "sys.argv = ['mergesmith', 'merge', sys.argv[1], sys.argv[2]]; run()"
    )
    bad = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "missing.yml"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "missing.yml" in bad.stderr and bad.stderr.count("\n") == 1
    assert bad.stdout == "atexit ran\n"
    show_version = "import sys; from mergesmith.cli import run; sys.argv = ['mergesmith', '--version']; run()"
    version = subprocess.run(
        [sys.executable, "-c", show_version],
        capture_output=True,
        text=True,
    )
    assert version.returncode == 0 and "mergesmith" in version.stdout


class _CollectorCheck:
    """A command that records the collector's thresholds before and after the plan's freeze."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def main(self, **_kw: object) -> None:
        self.seen.append(gc.get_threshold())
        process_tuning.freeze_long_lived_objects()
        self.seen.append(gc.get_threshold())


def test_the_collector_runs_less_often_until_the_plan_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    before = gc.get_threshold()
    command = _CollectorCheck()
    monkeypatch.setattr(cli, "cli", command)
    _run_main(["anything"])
    assert command.seen == [process_tuning.STARTING_THRESHOLDS, before]
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_command_that_builds_no_plan_gets_its_collector_back_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(cli, "cli", type("NoPlan", (), {"main": lambda self, **_kw: seen.append(gc.get_threshold())})())
    _run_main(["anything"])
    assert seen == [process_tuning.STARTING_THRESHOLDS] and gc.get_threshold() == before


def test_the_refused_import_is_the_importing_threads_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside numba_without_blas (once the command asked for it), the probe module cannot be imported by the thread
    that imports numba; another thread imports it as usual, and afterwards so does this one."""
    name = "mergesmith_probe_module_for_a_test"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(process_tuning, "NUMBA_BLAS_PROBE", name)
    monkeypatch.delitem(sys.modules, name, raising=False)
    with process_tuning.numba_without_blas():  # not asked for: nothing refused
        assert __import__(name).VALUE == 1
    del sys.modules[name]
    monkeypatch.setattr(process_tuning, "_numba_blas_wanted", False)
    other: list[object] = []
    with process_tuning.numba_without_blas():
        with pytest.raises(ModuleNotFoundError):
            __import__(name)
        import threading

        thread = threading.Thread(target=lambda: other.append(__import__(name)))
        thread.start()
        thread.join(10)
    assert other and getattr(other[0], "VALUE", None) == 1
    assert __import__(name).VALUE == 1 and not any(
        isinstance(finder, process_tuning._RefusedInThread) for finder in sys.meta_path
    )
    del sys.modules[name]


def test_the_command_loads_numba_without_scipys_blas() -> None:
    """A process where the command asked for it loads the compiled loops without importing scipy.linalg, and they
    work; one where it did not (the library's default) leaves numba's import as it is."""
    pytest.importorskip("numba")
    if importlib.util.find_spec("scipy") is None:
        pytest.skip("scipy is not installed: numba never imports it")
    code = (
        "import sys; from mergesmith.runtime import process_tuning as p\n"
        "if sys.argv[1] == 'command': p.skip_numba_blas()\n"
        "from mergesmith.kernels import keyed_kernels, introsort_replay, weighted_sum, bf16_mix\n"
        "assert all(m.KERNELS.wait() for m in (keyed_kernels, introsort_replay, weighted_sum, bf16_mix))\n"
        "print('scipy.linalg' in sys.modules)"
    )
    env = {**os.environ, "MERGESMITH_KERNELS": "wait"}
    found = {
        how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, env=env, check=True)
        for how in ("command", "library")
    }
    assert found["command"].stdout.strip() == "False", found["command"].stderr
    assert found["library"].stdout.strip() == "True", found["library"].stderr
