"""docs/options.md, generated from the options model: every command's options with their Python API keyword,
default and help, the way --help words them for that command.

Regenerate with `python -m mergesmith.options.docs` after changing an option; tests/test_options_model.py
fails while the file differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .families import API_EXCLUDE, API_FUNCTIONS, LAYOUTS
from .generate import api_defaults, click_params

_ROOT = Path(__file__).resolve().parents[3]
DOC_PATH = _ROOT / "docs" / "options.md"

_HEADER = """# Options of every command

Generated from the options model (`src/mergesmith/options/`) by `python -m mergesmith.options.docs`; do not edit.
Each option is a command-line flag and, for the commands with a Python function, the keyword argument of the
same name (`mergesmith.merge(config, out_dir, threads=4, max_memory="8GB")`), with the same default and checks.
"""


def _flags(param: Any) -> str:
    spellings = [*param.opts, *param.secondary_opts]
    return " ".join(f"`{s}`" for s in spellings)


def _default(value: Any) -> str:
    if value is None or value == ():
        return ""
    return f"`{value}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole of docs/options.md."""
    out = [_HEADER]
    for command in LAYOUTS:
        function = API_FUNCTIONS.get(command)
        keywords = api_defaults(command) if function else {}
        params = click_params(command)
        where = f"Python: `mergesmith.{function}(...)`" if function else "command line only"
        out.append(f"\n## mergesmith {command}\n\n{where}\n")
        if function and API_EXCLUDE.get(command):
            taken = ", ".join(f"`{n}`" for n in API_EXCLUDE[command])
            out.append(f"\nNot keywords of `mergesmith.{function}`: {taken} (positional arguments or printing).\n")
        out.append("\n| option | keyword | default | what it does |\n|---|---|---|---|\n")
        hidden = []
        for param in params:
            if param.hidden:
                hidden.append(f"`{param.opts[0]}`")
                continue
            keyword = f"`{param.name}`" if param.name in keywords else ""
            default = _default(keywords[param.name]) if param.name in keywords else _default(param.default)
            out.append(f"| {_flags(param)} | {keyword} | {default} | {_cell(param.help)} |\n")
        if hidden:
            names = ", ".join(hidden)
            out.append(f"\nAlso accepted from mergekit, with no effect here (each prints a note): {names}.\n")
    return "".join(out)


def main() -> None:
    """Write docs/options.md (or the path given)."""
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC_PATH
    target.write_text(render())
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
