"""Tokenizer merging: output vocabularies, chat templates, and re-indexing embeddings onto them.

Importing this package is cheap: the root package imports it at start-up for registration.py (what it adds to
the engine), so its names load on first use, and transformers is loaded only when a config asks for tokenizer
work (see planning.py), so a plain merge never pays for it.
"""

from __future__ import annotations

__all__ = ["BUILTIN_TEMPLATES", "resolve_chat_template"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import templates

        return getattr(templates, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
