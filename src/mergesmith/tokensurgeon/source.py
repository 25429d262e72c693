"""`tokenizer_source: transplant:<donor>`: how a merge config asks for a transplant, read without heavy imports
(registration.py reads it at start-up to decide whether its step applies; merge.py plans it)."""

from __future__ import annotations

TYPE_CHECKING = False  # not `from typing import ...`: imported at start-up

if TYPE_CHECKING:
    from ..config import MergeConfiguration

PREFIX = "transplant:"


def transplant_source(config: MergeConfiguration) -> str | None:
    """A `transplant:<donor>` tokenizer source (in `tokenizer_source` or `tokenizer.source`), else None."""
    source = config.tokenizer.source if config.tokenizer is not None else config.tokenizer_source
    return source if isinstance(source, str) and source.startswith(PREFIX) else None


def transplant_donor(source: str | None) -> str | None:
    """The donor of a `transplant:<donor>` tokenizer source, else None."""
    if isinstance(source, str) and source.startswith(PREFIX):
        return source[len(PREFIX) :]
    return None
