"""Test package; being a package lets tests import ``tests.model_factory`` and ``tests.helpers`` from the repo root."""
