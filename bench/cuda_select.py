"""A pytest plugin for bench/gpu_check.py: keep only the suite's CUDA tests, and log each result as it ends.

    python -m pytest -p cuda_select tests/test_a.py tests/test_b.py    # with bench/ on PYTHONPATH
    GPU_CHECK_RESULTS=results.jsonl  (where each finished test's outcome is appended, one JSON object a line)

Why a plugin rather than `-k cuda`: the suite marks its device tests in several ways (a `skipif` whose reason names
CUDA or a GPU, a parameter or a name with "cuda" in it, a `cuda`/`gpu` marker), and the check must find tests
added later without a list to keep up to date. Why a results file written test by test: the check gives the tests
a time limit and kills pytest when it passes; the tests that finished by then are still reported.
"""

from __future__ import annotations

import json
import os
import re

import pytest

_DEVICE = re.compile(r"cuda|gpu", re.IGNORECASE)


def is_cuda_test(item: pytest.Item) -> bool:
    """A test of the CUDA path: named for it, marked for it, or skipped for want (or presence) of a device."""
    if "cuda" in item.nodeid.lower():
        return True
    for mark in item.iter_markers():
        if mark.name in ("cuda", "gpu"):
            return True
        if mark.name == "skipif" and _DEVICE.search(str(mark.kwargs.get("reason", ""))):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = [i for i in items if is_cuda_test(i)]
    dropped = [i for i in items if not is_cuda_test(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def _append(line: dict[str, object]) -> None:
    path = os.environ.get("GPU_CHECK_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def _message(report: pytest.CollectReport | pytest.TestReport) -> str:
    text = str(report.longrepr).strip() if report.longrepr else ""
    return text.splitlines()[-1][:300] if text else ""


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test file that cannot be imported (a missing package on the GPU machine) is an error of the check."""
    if report.failed:
        _append({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "message": _message(report)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append the test's outcome once it is known: a failure or skip in setup, else the call's outcome."""
    final = report.when == "call" or (report.when == "setup" and not report.passed)
    if not final and not (report.when == "teardown" and report.failed):
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 3)}
    if report.failed:
        line["message"] = _message(report)
    _append(line)
