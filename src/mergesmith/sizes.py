"""Byte counts as people read them (`427 KB`, `1.23 GB`), the one spelling every message uses.

It sits at the base of the package because every layer prints sizes: the command line's final line, the
API's, `plan`'s report, the disk-space and memory refusals. One helper keeps them alike; a fixed unit
(the Python API once printed a 427 KB merge as `0.00 GB`) hides small outputs and reads badly.
"""

from __future__ import annotations

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_size(n: float, digits: int | None = None) -> str:
    """`n` bytes in decimal units (1 KB = 1000 B, as disks and the Hub count them).

    Whole bytes below 1 KB. Above, three significant figures by default (`427 KB`, `42.7 MB`, `4.27 GB`),
    or `digits` places after the point where two nearby figures must print differently (the disk check's
    `needs 16.78 MB, has 16.77 MB free`).
    """
    value = float(n)
    limit = 1000 if digits is not None else 999.5  # 999.7 KB at three figures is `1.00 MB`, not `1000 KB`
    for unit in _UNITS:
        if abs(value) < limit or unit == _UNITS[-1]:
            break
        value /= 1000
    if unit == "B":
        return f"{int(n)} B"
    if digits is not None:
        return f"{value:.{digits}f} {unit}"
    places = 0 if abs(value) >= 99.95 else 1 if abs(value) >= 9.995 else 2
    return f"{value:.{places}f} {unit}"
