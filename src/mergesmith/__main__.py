"""`python -m mergesmith ...` runs the command line, as the `mergesmith` script does (for environments where
the script is not on PATH: a notebook's `!python -m mergesmith merge ...`, a venv used without activating it)."""

from .cli import run

run()
