"""Tokenizer merging: output vocabularies, chat templates, and re-indexing embeddings onto them.

Importing this package is cheap: transformers is loaded only when a config asks for tokenizer work
(see planning.py), so a plain merge never pays for it.
"""

from __future__ import annotations

from .templates import BUILTIN_TEMPLATES, resolve_chat_template

__all__ = ["BUILTIN_TEMPLATES", "resolve_chat_template"]
