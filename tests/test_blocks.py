"""Row-block execution: the same bytes as whole-tensor execution, whatever the block size."""

from __future__ import annotations

import pytest
import yaml

from mergesmith.engine.execution import blocks
from mergesmith.engine.plan import InputRef, TensorRecipe
from mergesmith.engine.planning.shared import MergeOptions, recipe_memory
from mergesmith.engine.run import run_merge
from tests.helpers import read_state_dict, weight_files


def test_row_blocks_cover_every_row_once():
    recipe = TensorRecipe("x", (1000, 700), "F32", "copy", (InputRef("m", "x"),))
    ranges = blocks.row_blocks(recipe, block_elements=7000)
    assert ranges[0] == (0, 10) and ranges[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_random_and_non_elementwise_recipes_are_never_split():
    big = (4096, 4096)
    dare = TensorRecipe("x", big, "F32", "merge", (InputRef("m", "x"),), "linear", None, ((),), (), seed=1)
    assert blocks.row_blocks(dare) == [(0, 4096)]
    small = TensorRecipe("x", (10, 10), "F32", "copy", (InputRef("m", "x"),))
    assert blocks.row_blocks(small) == [(0, 10)]


def test_block_memory_is_far_below_whole_tensor_memory():
    big = TensorRecipe(
        "x",
        (32000, 2048),
        "BF16",
        "merge",
        (InputRef("a", "x"), InputRef("b", "x")),
        "linear",
        None,
        ((("weight", 1.0),), (("weight", 1.0),)),
        (("normalize", True),),
    )
    assert recipe_memory(big, "F32") < 64 << 20
    assert big.numel() * 4 * 2 >= 500 << 20


@pytest.mark.parametrize("method", ["linear", "passthrough"])
def test_blocked_output_is_byte_identical(tmp_path, tiny_models, monkeypatch, method):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    if method == "linear":
        cfg = {
            "merge_method": "linear",
            "out_dtype": "bfloat16",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.3}},
                {"model": str(b), "parameters": {"weight": 0.9}},
            ],
        }
    else:
        cfg = {
            "merge_method": "passthrough",
            "dtype": "float16",
            "slices": [{"sources": [{"model": str(a), "layer_range": [0, 4], "parameters": {"scale": 0.5}}]}],
        }
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(cfg))
    run_merge(path, tmp_path / "whole", MergeOptions(threads=2))
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 64)
    assert max(len(blocks.row_blocks(r, 64)) for r in _recipes(path)) > 10
    run_merge(path, tmp_path / "blocked", MergeOptions(threads=2))
    for whole, blocked in zip(weight_files(tmp_path / "whole"), weight_files(tmp_path / "blocked")):
        assert whole.read_bytes() == blocked.read_bytes()
    assert read_state_dict(tmp_path / "blocked").keys() == read_state_dict(tmp_path / "whole").keys()


def _recipes(path):
    from mergesmith.engine.run import build_plan

    plan, _ = build_plan(path, MergeOptions())
    return plan.recipes
