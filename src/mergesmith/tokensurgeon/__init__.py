"""Tokenizer transplantation (mergekit-tokensurgeon's job): give a model another model's tokenizer.

`run_tokensurgeon` plans a copy of BASE whose embedding and output head are rebuilt for DONOR's
vocabulary (shared tokens keep BASE's rows, the others are approximated, by OMP by default) and
writes it through the shared executor. Importing this package is cheap (the root package imports it at
start-up for registration.py, what it adds to the engine): its names load on first use, and transformers
only when planning reads tokenizers.
"""

from __future__ import annotations

_EXPORTS = {"SurgeryOptions": "planner", "build_tokensurgeon_plan": "api", "run_tokensurgeon": "api"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
