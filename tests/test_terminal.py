"""Every command at a real terminal: each runs in a subprocess whose stdin, stdout and stderr are a
pseudo-terminal (os.openpty, as `script` or an ssh session gives), and the screen's text is checked: the
progress drawn, the last line saying where the output is, exit 0, no traceback.

Output sent to a pipe or a file (what capsys and subprocess.PIPE give every other test) takes another
path through the displays, which is how a crash at the terminal once reached every user and no test.
Also here: a 40-column terminal, TERM=dumb, NO_COLOR, output redirected to a file while stdin is a
terminal, a Jupyter kernel (faked: what display/notebook.py looks for) for the API's `progress=True`,
and `-q`, which hides progress only: warnings and errors still print.

The pty reader reads until the child has exited and the terminal is closed, with a generous timeout that
only keeps a hung child from hanging the suite (no timing is asserted).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import mergesmith
from tests.helpers import run_cli, write_config

SRC = Path(mergesmith.__file__).resolve().parents[1]  # the code under test, for the child processes too
TESTS = Path(__file__).parent
TOKENSURGEON = TESTS / "fixtures" / "tokensurgeon"
EVOLVE = TESTS / "fixtures" / "evolve"

# Everything that changes how rich, click or tqdm draw: a test sets what it tests, nothing leaks in.
DISPLAY_VARIABLES = (
    "TERM", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "COLORTERM", "TTY_COMPATIBLE",
    "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES", "TQDM_DISABLE", "MERGESMITH_PROGRESS_INTERVAL",
)
# CSI (colours, cursor moves, erase), OSC (titles, links), and two-character escapes.
ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
SGR = re.compile(r"\x1b\[([0-9;:]*)m")
CURSOR_CONTROL = re.compile(r"\x1b\[(?:\d*[A-HJK]|\?25[lh])")  # moves, erases, cursor hide/show: a redrawn bar


@dataclass
class Screen:
    """What a terminal received from a finished command."""

    code: int
    raw: str

    @property
    def text(self) -> str:
        """The characters shown, without escape sequences; a carriage return starts a new line here, so
        each redrawn frame of a bar is a line of its own."""
        return ANSI.sub("", self.raw).replace("\r\n", "\n").replace("\r", "\n")

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.text.splitlines() if line.strip()]

    def last_line(self) -> str:
        return self.lines[-1] if self.lines else ""


def child_env(columns: int = 100, rows: int = 30, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DISPLAY_VARIABLES}
    env.update(TERM="xterm-256color", COLUMNS=str(columns), LINES=str(rows))
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def at_terminal(
    args: list[str | Path],
    *,
    columns: int = 100,
    rows: int = 30,
    env: dict[str, str] | None = None,
    output: Path | None = None,
    stderr_output: bool = True,
    timeout: float = 300,
) -> Screen:
    """Run `args` with a pseudo-terminal of `columns` x `rows` as stdin, stdout and stderr (or with stdout, and
    stderr unless not `stderr_output`, sent to the file `output`); return what the terminal received."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    sink = open(output, "wb") if output is not None else None  # noqa: SIM115 - closed below, once the child has it
    try:
        proc = subprocess.Popen(
            [str(a) for a in args],
            stdin=slave,
            stdout=sink or slave,
            stderr=(sink if stderr_output else None) or slave,
            env=child_env(columns, rows) if env is None else env,
            start_new_session=True,  # its own session: a signal meant for the test run does not reach it
            close_fds=True,
        )
    finally:
        os.close(slave)
        if sink is not None:
            sink.close()
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                shown = Screen(-9, b"".join(chunks).decode(errors="replace")).text
                raise AssertionError(f"{args[:4]} still running after {timeout} s; the screen so far:\n{shown}")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError as exc:  # Linux: EIO once every holder of the terminal's other end has closed it
                    if exc.errno != errno.EIO:
                        raise
                    break
                if not data:  # macOS: end of file
                    break
                chunks.append(data)
                quiet_since = None
            elif proc.poll() is not None:
                # Exited, yet a process it started may still hold the terminal: stop once nothing more comes.
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 2:
                    break
    finally:
        os.close(master)
    code = proc.wait(timeout=60)
    return Screen(code, b"".join(chunks).decode(errors="replace"))


def mergesmith_cli(*args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "mergesmith.cli", *args]


def assert_finished(screen: Screen, last: str) -> None:
    """Exit 0, no traceback, no failed display, and `last` on the last line."""
    assert screen.code == 0, f"exit {screen.code}; screen:\n{screen.text}"
    assert "Traceback" not in screen.text and "error:" not in screen.text, screen.text
    assert "progress display failed" not in screen.text, screen.text
    assert last in screen.last_line(), f"last line {screen.last_line()!r}, expected {last!r}; screen:\n{screen.text}"


def merge_bar(screen: Screen) -> list[str]:
    """The frames of the merge bar drawn on the screen."""
    frames = [line for line in screen.lines if re.search(r"merging \d+/\d+ tensors", line)]
    assert frames, f"no merge bar on the screen:\n{screen.text}"
    return frames


# ----- inputs: tiny models, the committed fixtures; shared by the tests below -----------------------------


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, tiny_models: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("terminal")
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    linear = {"merge_method": "linear", "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in (a, b)]}
    ignored = {
        "merge_method": "linear",
        "models": [
            {"model": str(a), "parameters": {"weight": 1.0, "density": 0.5}},  # linear does not use density
            {"model": str(b), "parameters": {"weight": 1.0}},
        ],
    }
    moe = {
        "base_model": str(a),
        "gate_mode": "hidden",  # the router pass: a second progress bar before the merge's
        "experts": [
            {"source_model": str(a), "positive_prompts": ["tok10 tok11 tok12"]},
            {"source_model": str(b), "positive_prompts": ["tok60 tok61 tok62"]},
        ],
    }
    stages = [
        {"name": "first", **linear},
        {"name": "second", "merge_method": "slerp", "base_model": "first", "parameters": {"t": 0.3},
         "models": [{"model": "first"}, {"model": str(b)}]},
    ]
    (root / "multi.yml").write_text(yaml.safe_dump_all(stages, sort_keys=False))
    raw = []
    for seed in (1, 2):  # bare state dicts: no config.json
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(seed)
        path = root / f"net{seed}.safetensors"
        save_file({"encoder.weight": torch.randn(16, 6, generator=g), "head.weight": torch.randn(3, 16, generator=g)},
                  path)
        raw.append({"model": str(path), "parameters": {"weight": 1.0}})
    genome = {
        "genome": {"models": [str(EVOLVE / "add"), str(EVOLVE / "rev")], "merge_method": "task_arithmetic",
                   "base_model": str(EVOLVE / "base"), "layer_granularity": 2},
        "tasks": [{"name": "addition", "type": "exact_match", "data": str(EVOLVE / "add_eval.jsonl")}],
        "limit": 4,
    }
    return {
        "root": root,
        "a": a,
        "b": b,
        "base": tiny_models("llama", seed=0, layers=2),
        "linear": write_config(root / "linear.yml", linear),
        "ignored": write_config(root / "ignored.yml", ignored),
        "moe": write_config(root / "moe.yml", moe),
        "multi": root / "multi.yml",
        "raw": write_config(root / "raw.yml", {"merge_method": "linear", "models": raw}),
        "genome": write_config(root / "genome.yml", genome),
    }


# ----- 1. each command at a terminal -------------------------------------------------------------------


def test_merge_at_a_terminal_draws_its_bar_and_says_where_the_model_is(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out))
    assert_finished(screen, f"wrote {out}")
    frames = merge_bar(screen)
    assert re.search(r"merging (\d+)/\1 tensors", frames[-1]), frames  # the last frame: every tensor
    assert CURSOR_CONTROL.search(screen.raw), "a terminal gets a redrawn bar"
    assert re.search(r"\d+\.\d MB/s", frames[-1]), frames  # a merge shorter than rich's speed window has a rate too
    assert (out / "config.json").is_file()


def test_plan_at_a_terminal(inputs: dict[str, Path], tmp_path: Path):
    screen = at_terminal(mergesmith_cli("plan", inputs["linear"], tmp_path / "out"))
    assert_finished(screen, "estimated time")
    assert any(line.startswith("method: linear") or "linear" in line for line in screen.lines), screen.text


def test_moe_at_a_terminal_draws_the_router_pass_and_the_merge(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "moe"
    screen = at_terminal(mergesmith_cli("moe", inputs["moe"], out), env=child_env(
        MERGESMITH_CACHE_DIR=str(tmp_path / "cache")))
    assert_finished(screen, f"wrote {out}")
    assert any("router weights" in line and "prompts" in line for line in screen.lines), screen.text
    merge_bar(screen)


def test_multi_at_a_terminal_draws_each_stage(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "stages"
    screen = at_terminal(mergesmith_cli("multi", inputs["multi"], "--out-dir", out))
    assert_finished(screen, f"second: wrote {out / 'second'}")
    assert len(merge_bar(screen)) >= 2 and any(f"first: wrote {out / 'first'}" in ln for ln in screen.lines)


def test_merge_raw_at_a_terminal(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "raw"
    screen = at_terminal(mergesmith_cli("merge-raw", inputs["raw"], out))
    assert_finished(screen, f"wrote {out}")
    merge_bar(screen)


def test_tokensurgeon_at_a_terminal(tmp_path: Path):
    out = tmp_path / "surgery"
    screen = at_terminal(mergesmith_cli("tokensurgeon", TOKENSURGEON / "base", TOKENSURGEON / "donor", out, "--k", "8"))
    assert_finished(screen, f"wrote {out}")
    merge_bar(screen)


def test_extract_lora_at_a_terminal_draws_its_bar(inputs: dict[str, Path], tiny_models: Any, tmp_path: Path):
    base = inputs["base"]
    tuned = tiny_models.derive(base, seed=11, scale=0.02)
    out = tmp_path / "adapter"
    args = ["extract-lora", "--model", tuned, "--base", base, "--out", out, "--max-rank", "4"]
    screen = at_terminal(mergesmith_cli(*args))
    assert_finished(screen, f"wrote {out}")
    assert any(re.search(r"extracting .*\d+/\d+ modules", line) for line in screen.lines), screen.text


def test_evolve_at_a_terminal_draws_its_table(inputs: dict[str, Path], tmp_path: Path):
    pytest.importorskip("cma", reason="cma is not installed (pip install 'mergesmith[evolve]')")
    storage = tmp_path / "search"
    screen = at_terminal(mergesmith_cli("evolve", inputs["genome"], "--storage-path", storage, "--max-fevals", "2",
                                        "--popsize", "2"))
    assert_finished(screen, "best_config.yml")
    assert any("evaluations 2/2" in line for line in screen.lines), screen.text  # the live table's title
    assert any(line.startswith("best fitness") for line in screen.lines), screen.text


# ----- 2. terminals of another kind ------------------------------------------------------------------------


def test_a_40_column_terminal_gets_a_bar_that_fits(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "narrow"
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out), columns=40)
    assert_finished(screen, f"wrote {out}")
    for frame in merge_bar(screen):
        assert len(frame) <= 40, f"a frame wider than the terminal wraps and breaks the redraw: {frame!r}"
    assert re.search(r"merging (\d+)/\1 tensors", merge_bar(screen)[-1]), screen.text


def test_term_dumb_gets_plain_lines_and_no_cursor_control(inputs: dict[str, Path], tmp_path: Path):
    """A dumb terminal (Emacs' shell, some CI consoles) cannot move the cursor: the periodic `progress:`
    lines of a pipe, never a redrawn bar."""
    out = tmp_path / "dumb"
    env = child_env(TERM="dumb", MERGESMITH_PROGRESS_INTERVAL="0.2", MERGESMITH_TEST_SLOW="0.03")
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out, "--threads", "1"), env=env)
    assert_finished(screen, f"wrote {out}")
    assert not CURSOR_CONTROL.search(screen.raw), repr(screen.raw[:400])
    assert any(re.match(r"progress: \d+/\d+ tensors", line) for line in screen.lines), screen.text


def test_no_color_means_no_colour_codes(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "plain"
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out), env=child_env(NO_COLOR="1"))
    assert_finished(screen, f"wrote {out}")
    merge_bar(screen)
    for params in SGR.findall(screen.raw):
        codes = [int(c) for c in re.split(r"[;:]", params) if c]
        colours = [c for c in codes if 30 <= c <= 38 or 40 <= c <= 48 or 90 <= c <= 97 or 100 <= c <= 107]
        assert not colours, f"colour code {params!r} under NO_COLOR"


def test_output_redirected_to_a_file_while_stdin_is_a_terminal(inputs: dict[str, Path], tmp_path: Path):
    out, log = tmp_path / "out", tmp_path / "merge.log"
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out), output=log)
    assert screen.code == 0 and screen.raw == ""
    written = log.read_text()
    assert "\x1b" not in written, repr(written)  # a file gets no terminal codes and no stale bar
    assert written.strip().splitlines()[-1].startswith(f"wrote {out}"), written
    assert "Traceback" not in written and "error" not in written


def test_stdout_redirected_keeps_the_bar_on_the_terminal_and_the_last_line_in_the_file(
    inputs: dict[str, Path], tmp_path: Path
):
    """`mergesmith merge ... > merge.log` at a terminal: the bar (stderr) stays on the screen, the file gets the
    line saying where the model is, and nothing of the bar."""
    out, log = tmp_path / "out", tmp_path / "merge.log"
    screen = at_terminal(mergesmith_cli("merge", inputs["linear"], out), output=log, stderr_output=False)
    assert screen.code == 0, screen.text
    merge_bar(screen)
    assert log.read_text().splitlines() == [log.read_text().strip()] and log.read_text().startswith(f"wrote {out}")


# ----- 3. the Python API's progress=True ------------------------------------------------------------------

_API_SCRIPT = """
import sys, types
if sys.argv[3] == "notebook":
    # What a Jupyter kernel has: IPython imported, get_ipython() a ZMQInteractiveShell with an IPKernelApp config.
    class ZMQInteractiveShell:
        config = {"IPKernelApp": {}}
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: ZMQInteractiveShell()
    sys.modules["IPython"] = fake
import mergesmith
if sys.argv[4:] == ["multi"]:
    mergesmith.multi(sys.argv[1], sys.argv[2], progress=True)
else:
    mergesmith.merge(sys.argv[1], sys.argv[2], progress=True)
"""


def test_api_progress_in_a_jupyter_kernel(inputs: dict[str, Path], tmp_path: Path):
    """A kernel's stdout and stderr are no terminals (they go to the browser): pipes here."""
    out = tmp_path / "nb"
    proc = subprocess.run(
        [sys.executable, "-c", _API_SCRIPT, str(inputs["linear"]), str(out), "notebook"],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "progress display failed" not in proc.stderr, proc.stderr
    assert re.search(r"merging.*\d+/\d+ tensors, RSS", proc.stderr), proc.stderr  # the tqdm bar
    assert proc.stdout.strip().splitlines()[-1].startswith(f"model written to {out.resolve()}"), proc.stdout


def test_api_progress_at_a_terminal(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "api"
    screen = at_terminal([sys.executable, "-c", _API_SCRIPT, inputs["linear"], out, "terminal"])
    assert_finished(screen, f"model written to {out.resolve()}")
    merge_bar(screen)


def test_api_multi_progress_at_a_terminal_draws_a_bar_per_stage(inputs: dict[str, Path], tmp_path: Path):
    """One live display at a time: each stage's bar ends before the next one starts."""
    out = tmp_path / "stages"
    screen = at_terminal([sys.executable, "-c", _API_SCRIPT, inputs["multi"], out, "terminal", "multi"])
    assert_finished(screen, f"second: model written to {(out / 'second').resolve()}")
    done = {frame for frame in merge_bar(screen) if re.search(r"merging (\d+)/\1 tensors", frame)}
    assert len(re.findall(r"\x1b\[\?25l", screen.raw)) == 2 and done, screen.text  # two bars, each finished


# ----- 4. -q hides progress, never warnings ------------------------------------------------------------------


def test_quiet_at_a_terminal_hides_the_bar_not_the_warnings(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "quiet"
    screen = at_terminal(mergesmith_cli("merge", inputs["ignored"], out, "-q"))
    assert_finished(screen, f"wrote {out}")
    assert any(line.startswith("warning:") and "does not use 'density'" in line for line in screen.lines), screen.text
    assert not any("merging" in line for line in screen.lines), screen.text
    assert not CURSOR_CONTROL.search(screen.raw)


@pytest.mark.parametrize("command", ["merge", "multi", "merge-raw"])
def test_quiet_keeps_the_warnings_of_every_merging_command(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
):
    if command == "merge":
        args = ["merge", inputs["ignored"], tmp_path / "out"]
    elif command == "merge-raw":
        doc = yaml.safe_load(inputs["raw"].read_text())
        doc["models"][0]["parameters"]["density"] = 0.5
        args = ["merge-raw", write_config(tmp_path / "raw.yml", doc), tmp_path / "out"]
    else:
        doc = yaml.safe_load(inputs["ignored"].read_text())
        (tmp_path / "m.yml").write_text(yaml.safe_dump_all([{"name": "only", **doc}]))
        args = ["multi", tmp_path / "m.yml", "--out-dir", tmp_path / "out"]
    code, out, err = run_cli(capsys, *args, "-q")
    assert code == 0, err
    assert "warning:" in err and "does not use 'density'" in err, err
    assert "progress:" not in err and "wrote" in out


def test_quiet_keeps_tokensurgeons_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, out, err = run_cli(capsys, "tokensurgeon", TOKENSURGEON / "base", TOKENSURGEON / "donor", tmp_path / "o",
                             "--k", "48", "-q")
    assert code == 0, err
    assert "warning: --k 48 is not below the hidden size" in err, err


def test_readme_says_quiet_hides_progress_only():
    readme = (TESTS.parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("|") and "`-q`" in line]
    assert rows and all("progress" in row and "warning" in row for row in rows), rows


# ----- 5. a display that fails never takes the merge with it ---------------------------------------------------

_BROKEN = textwrap.dedent(
    """
    import sys
    from mergesmith.display import terminal
    def broken(self, event):
        raise KeyError("ntensors")
    terminal.MergeProgress.update = broken
    from mergesmith.cli import main
    main(sys.argv[1:])
    """
)


def test_a_failing_display_warns_once_and_the_merge_finishes(inputs: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    env = child_env()
    env.pop("MERGESMITH_DISPLAY_ERRORS", None)  # the test suite's switch that turns such a failure into an error
    screen = at_terminal([sys.executable, "-c", _BROKEN, "merge", inputs["linear"], out], env=env)
    assert screen.code == 0, screen.text
    warnings = [line for line in screen.lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "progress display failed" in warnings[0] and "KeyError" in warnings[0], screen.text
    assert screen.last_line().startswith(f"wrote {out}") and (out / "config.json").is_file()
    # The test suite's switch: the same failure is an error there, so no test passes over a broken display.
    screen = at_terminal([sys.executable, "-c", _BROKEN, "merge", inputs["linear"], tmp_path / "o2"],
                         env={**env, "MERGESMITH_DISPLAY_ERRORS": "raise"})
    assert screen.code == 1 and "KeyError" in screen.text, screen.text


class _Exploding:
    """A display whose update fails; records what the guard calls."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.calls = error, []

    def __enter__(self) -> _Exploding:
        return self

    def start(self, plan: Any) -> None:
        self.calls.append("start")

    def update(self, event: Any) -> None:
        self.calls.append("update")
        raise self.error

    def close(self) -> None:
        self.calls.append("close")

    def __exit__(self, *exc: Any) -> None:
        self.calls.append("exit")


def test_the_guard_warns_once_closes_the_display_and_lets_interrupts_through(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from mergesmith.display.guard import Guarded

    monkeypatch.delenv("MERGESMITH_DISPLAY_ERRORS")
    inner = _Exploding(ValueError("bad width"))
    with Guarded(inner) as display:
        display.start(None)
        display.update(None)
        display.update(None)  # switched off: not called again
    assert inner.calls == ["start", "update", "close"], inner.calls
    err = capsys.readouterr().err
    assert err == "warning: the progress display failed (ValueError: bad width); going on without it\n", err

    with pytest.raises(KeyboardInterrupt), Guarded(_Exploding(KeyboardInterrupt())) as display:
        display.update(None)  # Ctrl-C while drawing stops the merge, as anywhere else

    monkeypatch.setenv("MERGESMITH_DISPLAY_ERRORS", "raise")
    with pytest.raises(ValueError, match="bad width"), Guarded(_Exploding(ValueError("bad width"))) as display:
        display.update(None)


def test_a_frame_that_fails_in_richs_refresh_thread_is_raised_on_the_callers_thread():
    """rich redraws from its own thread too; a failure there would print a thread's traceback and freeze the
    bar. It is kept and raised at the next call on the merge's thread, where the guard reports it."""
    import io

    from rich.console import Console
    from rich.progress import ProgressColumn

    from mergesmith.display.terminal import FittingProgress

    class Broken(ProgressColumn):
        def render(self, task: Any) -> Any:
            raise KeyError("ntensors")

    progress = FittingProgress([(Broken(),)], Console(file=io.StringIO(), force_terminal=True, width=40))
    progress.add_task("x", total=1)
    frame = progress.get_renderable()  # what the refresh thread calls
    assert frame is not None and isinstance(progress.failure, KeyError)
    with pytest.raises(KeyError, match="ntensors"):
        progress.raise_failure()


@pytest.mark.parametrize(("width", "shown"), [(120, "RSS"), (60, "MB/s"), (40, "merging")])
def test_the_merge_bar_drops_columns_to_fit_the_width(width: int, shown: str):
    import io

    from rich.console import Console

    from mergesmith.display.terminal import MergeProgress

    display = MergeProgress()
    display.console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    display.enabled = True
    plan = type("Plan", (), {"total_size": 10**9, "recipes": [None] * 2911})()
    display.start(plan)
    display.update(type("Event", (), {"bytes_written": 10**8, "tensors_done": 291, "tensors_total": 2911})())
    display.close()
    frames = [ANSI.sub("", f).rstrip() for f in display.console.file.getvalue().replace("\r", "\n").splitlines()]
    frames = [f for f in frames if "merging" in f]
    assert frames and all(len(f) <= width and shown in f for f in frames), frames
    assert "merging 291/2911 tensors" in frames[-1]


def test_a_plain_line_that_fails_is_raised_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch):
    from mergesmith.display.plain import PlainProgress

    def broken() -> str:
        raise OSError("no /proc")

    progress = PlainProgress(0.01)
    monkeypatch.setattr(progress, "line", broken)
    progress.start(type("Plan", (), {"total_size": 1})())
    assert progress._thread is not None
    progress._thread.join()  # the printing thread stops at its first line
    with pytest.raises(OSError, match="no /proc"):
        progress.close()


def test_api_quiet_hides_the_bar_not_the_warnings(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    result = mergesmith.merge(inputs["ignored"], tmp_path / "out", progress=True, quiet=True)
    out, err = capsys.readouterr()
    assert any(line.startswith("warning:") and "does not use 'density'" in line for line in out.splitlines()), out
    assert out.strip().splitlines()[-1].startswith("model written to ") and "progress" not in err, (out, err)
    assert any("density" in w for w in result.plan.warnings)
