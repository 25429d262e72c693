"""Row blocks: how large elementwise recipes are computed and written piece by piece.

An elementwise method's output rows depend only on the same rows of its inputs, so a 500 MB
embedding can be merged in blocks of about a million elements: memory per recipe drops to a few MB,
and each block's conversions and arithmetic stay in the CPU cache instead of streaming every
intermediate through RAM. The output bytes are identical whatever the block size.
"""

from __future__ import annotations

from ...methods import get_method
from ..plan import TensorRecipe

BLOCK_ELEMENTS = 1 << 20


def blockable(recipe: TensorRecipe) -> bool:
    """Whether the recipe may run in row blocks: copies, and merges by methods that are elementwise (maybe
    after a totals pass), and either not random or drawing by entry position (`keyed_random`)."""
    if len(recipe.shape) == 0 or recipe.quantize:  # quantized output: its scales need the whole tensor
        return False
    if recipe.op == "copy":
        return True
    if recipe.op != "merge":
        return False
    spec = get_method(recipe.method or "")
    if spec is None or (recipe.seed is not None and not spec.keyed_random):
        return False
    return spec.elementwise or spec.totals is not None


def two_pass(recipe: TensorRecipe) -> bool:
    """Whether the recipe runs in several row blocks and its method needs a totals pass over them first: its
    inputs are then read twice (by the input feed, once per pass, or through the memory maps)."""
    spec = get_method(recipe.method or "") if recipe.op == "merge" else None
    if spec is None or spec.totals is None or not spec.totals.needed(dict(recipe.params)):
        return False
    return len(row_blocks(recipe)) > 1


def row_blocks(recipe: TensorRecipe, block_elements: int | None = None) -> list[tuple[int, int]]:
    """[start, end) row ranges covering dim 0; a single range when the tensor is small or not blockable.

    `block_elements` defaults to BLOCK_ELEMENTS as it is at the call (tests shrink it to cut tiny models)."""
    block_elements = block_elements or BLOCK_ELEMENTS
    rows = recipe.shape[0] if recipe.shape else 1
    numel = recipe.numel()
    if not blockable(recipe) or numel <= 2 * block_elements or rows <= 1:
        return [(0, rows)]
    per_row = max(1, numel // rows)
    step = max(1, block_elements // per_row)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def block_numel(recipe: TensorRecipe) -> int:
    """Elements of the largest block the recipe will hold at once (what its memory cost scales with)."""
    start, end = row_blocks(recipe)[0]
    rows = recipe.shape[0] if recipe.shape else 1
    return recipe.numel() * (end - start) // max(rows, 1)
