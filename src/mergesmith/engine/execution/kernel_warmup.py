"""Which compiled loops a merge will use, so they are compiled (or loaded from numba's cache) before it needs them.

The executor starts these in the background as a merge begins; `plan`'s time estimate asks the same question
(a first compile costs the merge time). Each method says which groups its merge uses (MethodSpec.warm_up), so this
module names no method and no kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...kernels.compiled import AVAILABLE, START_ENTRIES, KernelGroup
from ...methods import get_method
from ..plan import TensorRecipe


def kernel_groups(recipes: Sequence[TensorRecipe]) -> list[KernelGroup]:
    """The compiled loops a CPU merge of `recipes` starts, as their methods announce them, in the order they are
    first named; only for merges with a tensor large enough for them to pay (compiled.START_ENTRIES). Only those:
    a compile the merge will not use only takes a core from it."""
    if not AVAILABLE:
        return []
    groups: list[KernelGroup] = []
    for recipe in recipes:
        if math.prod(recipe.shape) < START_ENTRIES:
            continue
        for group in _groups_of(recipe):
            if all(group is not g for g in groups):
                groups.append(group)
    return groups


def recipes_using(recipes: Sequence[TensorRecipe], group: KernelGroup) -> list[TensorRecipe]:
    """The recipes whose merge uses `group` where it is compiled, whatever their size."""
    return [recipe for recipe in recipes if any(g is group for g in _groups_of(recipe))]


def _groups_of(recipe: TensorRecipe) -> list[KernelGroup]:
    """The compiled loops the merge of `recipe` uses, as its method announces them."""
    if recipe.op != "merge":
        return []
    spec = get_method(recipe.method or "")
    return [] if spec is None else spec.kernel_groups(dict(recipe.params), recipe.seed is not None)
