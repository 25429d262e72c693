"""The command line as a user meets it: usage errors, help text, pointers to the right command,
progress off a terminal, and `plan` on awkward output paths. Each error is one `error:` line, exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from mergesmith.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI run in-process."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else 1
    return code, captured.out, captured.err


def one_error_line(code: int, err: str, *names: str, exit_code: int = 2) -> str:
    """stderr is exactly one `error: ...` line naming each of `names`; the exit code is `exit_code`."""
    lines = err.strip("\n").splitlines()
    assert code == exit_code, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def write_yaml(path: Path, config: Any) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


# ----- 1. usage errors -----------------------------------------------------------------------


def test_no_arguments_prints_the_help_without_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert code in (0, 2)
    text = out + err
    assert "Usage: mergesmith" in text and "Commands:" in text
    assert "error:" not in text
    assert "mergesmith mergesmith" not in text


def test_unknown_command_is_one_line_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, "mrege")
    line = one_error_line(code, err, "mrege", "merge")
    assert "mergesmith mergesmith" not in line
    assert "`mergesmith --help`" in line


def test_usage_error_in_a_subcommand_points_to_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, "merge")
    line = one_error_line(code, err, "CONFIG_FILE")
    assert "`mergesmith merge --help`" in line
