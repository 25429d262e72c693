"""Shared pytest fixtures.

Deliberately light: nothing autouse, and transformers/torch are only imported when a fixture that needs them is
used, so unit tests that never build a model start fast.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

# Tests must never reach the Hugging Face hub; set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
# merges run in-process record their imports (import_manifest): keep the test process's list out of the real cache
os.environ["MERGESMITH_CACHE_DIR"] = tempfile.mkdtemp(prefix="mergesmith-test-cache-")
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# a merge's first use of a compiled kernel group waits for its compile here (merges outside the tests take the
# uncompiled path meanwhile): the comparisons of the two paths must run the compiled one, and no compile may
# outlive a test (kernels/compiled.py)
os.environ["MERGESMITH_KERNELS"] = "wait"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# A progress display that fails is a warning for users (display/guard.py) and an error in tests, also in the
# commands they start: no test passes over a broken display.
os.environ["MERGESMITH_DISPLAY_ERRORS"] = "raise"

if TYPE_CHECKING:
    from tests.model_factory import ModelCache


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> ModelCache:
    """Session-wide cache of tiny checkpoints: ``tiny_models("llama", seed=1, fmt="bin") -> Path``.

    Also ``tiny_models.derive(base_path, seed=2, scale=0.01) -> Path`` for fine-tune-like models sharing a base.
    Returned directories are shared between tests: treat them as read-only (copy before mutating).
    """
    from tests.model_factory import ModelCache

    return ModelCache(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def load_causal_lm() -> Callable[..., Any]:
    """Fixture form of :func:`tests.helpers.load_causal_lm` (loads and asserts no missing/unexpected keys)."""
    from tests.helpers import load_causal_lm

    return load_causal_lm


@pytest.fixture(scope="session")
def finite_logits() -> Callable[..., Any]:
    """Fixture form of :func:`tests.helpers.finite_logits` (one forward pass, asserts finite, returns logits)."""
    from tests.helpers import finite_logits

    return finite_logits
