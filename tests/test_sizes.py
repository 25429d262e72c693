"""Byte counts as printed everywhere (`mergesmith.sizes.human_size`): the unit follows the size, so a
427 KB merge is never `0.00 GB` (issue 29), and fixed decimals where two figures are compared."""

from __future__ import annotations

import pytest

from mergesmith.sizes import human_size


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 KB"),
        (427_000, "427 KB"),
        (427_449, "427 KB"),
        (9_996, "10.0 KB"),
        (42_700_000, "42.7 MB"),
        (999_700, "1.00 MB"),  # not "1000 KB"
        (4_270_000_000, "4.27 GB"),
        (140e12, "140 TB"),
    ],
)
def test_three_figures_in_the_unit_that_fits(n: float, text: str) -> None:
    assert human_size(n) == text


def test_fixed_decimals_keep_nearby_figures_apart() -> None:
    """The disk check says `needs X, has Y free`: X and Y must not print alike when they differ."""
    assert human_size(16_780_000, 2) == "16.78 MB" and human_size(16_770_000, 2) == "16.77 MB"
    assert human_size(999_700, 2) == "999.70 KB"
    assert human_size(123_456, 2) == "123.46 KB"
