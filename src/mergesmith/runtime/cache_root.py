"""Where mergesmith keeps what it may rebuild: MoE router weights, the import list of the last merge.

One place for the rule, so every cache follows $MERGESMITH_CACHE_DIR the same way (tests point it at a
temporary directory to keep their files out of the user's cache). And one place for the link rule
(io/safe_fs.py): the base the user chose ($MERGESMITH_CACHE_DIR, $XDG_CACHE_HOME or ~/.cache) is
trusted as given, links included; the directories mergesmith makes below it (`mergesmith/`,
`moe-router/`, `imports/`) are opened without following links, so a link planted there is refused
instead of receiving our files.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..io import safe_fs

CACHE_ENV = "MERGESMITH_CACHE_DIR"


def _base_and_parts() -> tuple[Path, tuple[str, ...]]:
    """The trusted base directory and the components mergesmith owns below it."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]), ()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache"), ("mergesmith",)


def cache_root() -> Path:
    """$MERGESMITH_CACHE_DIR, else $XDG_CACHE_HOME/mergesmith, else ~/.cache/mergesmith."""
    base, parts = _base_and_parts()
    return base.joinpath(*parts)


def open_cache_dir(*parts: str, create: bool = True) -> int:
    """A descriptor of `cache_root()/parts...` (made when missing with `create`): the user's base opened
    as given, everything mergesmith made below it without following links (a link raises LinkError)."""
    base, own = _base_and_parts()
    if create:
        base.mkdir(parents=True, exist_ok=True)
    return safe_fs.open_dir(base, (*own, *parts), create=create)
