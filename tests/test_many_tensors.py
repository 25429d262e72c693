"""A merge's work per tensor must not grow with the number of tensors: checkpoints with tens of thousands of
tensors are common (a mixture of experts stored one expert per tensor: ~18,900 in Qwen3-30B-A3B, ~91,000 in
DeepSeek-V3), and a step that looks at every recipe once per recipe turns them into hours.

Found on a merge of three 18,003-tensor checkpoints (llama-shaped, 2,000 layers of hidden 16; 10 MB of output):
358 s, then 26 s once the read-ahead's end was a binary search instead of a walk over every later recipe, the
progress events stopped rebuilding the plan's recipe list, and a resume stopped comparing every recipe with
every written one (41.8 s for 14,700 tensors left, then 22.1 s). The test counts mergesmith's own Python calls
(a count, not a time, so a slow machine cannot fail it) for a merge of n and 2n layers, fresh and resumed: they
must grow about linearly (1.99x here). With the walk and the comparisons back (the commit before) they grew
3.07x fresh and 2.59x resumed. (The progress events' rebuilt list was one call each, so no count shows it.)
`python bench/many_tensors.py` times such merges against mergekit.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mergesmith
from mergesmith import python_api
from mergesmith.errors import MergeInterrupted
from tests.helpers import BENCH, bench_module

PACKAGE = str(Path(mergesmith.__file__).parent) + "/"
SMALL, LARGE = 40, 80
"""Layers of the two sizes compared (9 tensors a layer): large enough that a quadratic step dominates the count."""


def _config(tmp: Path, layers: int) -> dict[str, Any]:
    models = bench_module("many_tensors").models_of(tmp, layers)
    return {"merge_method": "ties", "base_model": str(models[0]), "dtype": "bfloat16",
            "models": [{"model": str(m), "parameters": {"weight": 1.0, "density": 0.5}} for m in models]}


def _counted(run: Callable[[], object]) -> int:
    """mergesmith's Python calls (in every thread) while `run` runs."""
    calls = itertools.count()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            next(calls)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return next(calls)


def _fresh_and_resumed(tmp: Path, layers: int) -> tuple[int, int]:
    """(calls of a whole merge, calls of a rerun that resumes one stopped halfway). The stopped merge runs first,
    uncounted: it also loads the compiled kernels, whose load would otherwise be counted in the first size only."""
    config = _config(tmp, layers)
    stop = threading.Event()

    def halfway(event: Any) -> None:
        if event.tensors_done * 2 >= event.tensors_total:
            stop.set()

    with pytest.raises(MergeInterrupted):
        python_api.merge(config, tmp / f"resumed{layers}", threads=2, progress=halfway, stop=stop)
    resumed = _counted(lambda: python_api.merge(config, tmp / f"resumed{layers}", threads=2))
    fresh = _counted(lambda: python_api.merge(config, tmp / f"fresh{layers}", threads=2))
    assert (tmp / f"resumed{layers}" / "model.safetensors").read_bytes() == (
        tmp / f"fresh{layers}" / "model.safetensors").read_bytes()
    return fresh, resumed


def test_a_merge_costs_about_the_same_per_tensor_at_any_tensor_count(tmp_path: Path) -> None:
    small_fresh, small_resumed = _fresh_and_resumed(tmp_path, SMALL)
    large_fresh, large_resumed = _fresh_and_resumed(tmp_path, LARGE)
    # twice the tensors: about twice the calls (a little less: the fixed cost of a merge is in both)
    assert large_fresh / small_fresh < 2.25, (small_fresh, large_fresh)
    assert large_resumed / small_resumed < 2.25, (small_resumed, large_resumed)


def test_the_bench_prints_a_row_per_size(tmp_path: Path) -> None:
    """bench/many_tensors.py end to end at two tiny sizes, mergesmith only: its models, its merges, its table."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(BENCH / "many_tensors.py"), "--layers", "2,4", "--models-root", str(tmp_path / "models"),
         "--out-root", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line[:1].isdigit()]
    assert [row[:2] for row in rows] == [["2", "21"], ["4", "39"]], done.stdout
    assert all("ms/tensor" in " ".join(row) and row[-2:] == ["not", "run"] for row in rows), done.stdout
    assert not list((tmp_path / "out").glob("many-mergesmith-*"))  # the outputs are removed


def test_a_moe_assembly_costs_about_the_same_per_tensor_at_any_layer_count(tmp_path: Path) -> None:
    """`moe` too: its planner asked the router weights for one layer's tensor at a time, and each ask built every
    layer's (assemblies of 9,503 and 19,003 output tensors took 15.5 and 55.7 s; now 5.0 and 11.0 s)."""

    def assembly(layers: int) -> dict[str, Any]:
        models = bench_module("many_tensors").models_of(tmp_path, layers)
        return {"base_model": str(models[0]), "gate_mode": "random", "dtype": "bfloat16",
                "experts": [{"source_model": str(m)} for m in (models[1], models[2], models[0], models[1])]}

    python_api.moe(assembly(SMALL // 2), tmp_path / "warm", random_seed=1)  # loads what a first run loads
    small = _counted(lambda: python_api.moe(assembly(SMALL), tmp_path / "small", random_seed=1))
    large = _counted(lambda: python_api.moe(assembly(LARGE), tmp_path / "large", random_seed=1))
    assert large / small < 2.25, (small, large)
