"""Where mergesmith keeps what it may rebuild: MoE router weights, the import list of the last merge.

One place for the rule, so every cache follows $MERGESMITH_CACHE_DIR the same way (tests point it at a
temporary directory to keep their files out of the user's cache).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MERGESMITH_CACHE_DIR"


def cache_root() -> Path:
    """$MERGESMITH_CACHE_DIR, else $XDG_CACHE_HOME/mergesmith, else ~/.cache/mergesmith."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mergesmith"
