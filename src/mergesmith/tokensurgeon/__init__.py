"""Tokenizer transplantation (mergekit-tokensurgeon's job): give a model another model's tokenizer.

`run_tokensurgeon` plans a copy of BASE whose embedding and output head are rebuilt for DONOR's
vocabulary (shared tokens keep BASE's rows, the others are approximated, by OMP by default) and
writes it through the shared executor. Importing this package never imports transformers; planning
does (tokenizers are read with it).
"""

from __future__ import annotations

from .api import build_tokensurgeon_plan, run_tokensurgeon
from .planner import SurgeryOptions

__all__ = ["SurgeryOptions", "build_tokensurgeon_plan", "run_tokensurgeon"]
