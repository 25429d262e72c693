"""Which compiled loops a merge will use, so they are compiled (or loaded from numba's cache) before it needs them.

The executor starts these in the background as a merge begins; `plan`'s time estimate asks the same question
(a first compile costs the merge time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...kernels import bf16_mix, introsort_replay, keyed_kernels
from ...kernels.compiled import START_ENTRIES, KernelGroup
from ...methods import get_method
from ...methods.task_arithmetic import FAMILY, KEYED, RANKED
from ..plan import TensorRecipe

TASK_VECTOR_METHODS = frozenset(member.name for member in FAMILY)
"""The methods whose merges use bf16_mix's loops (and, the ranking ones, introsort_replay's)."""


def kernel_groups(recipes: Sequence[TensorRecipe]) -> list[KernelGroup]:
    """The compiled loops a CPU merge of `recipes` starts: DARE's and DELLA's (keyed_kernels), the other task-vector
    methods' bf16 steps and, for those that rank magnitudes (TIES, breadcrumbs), the replay; only for merges with a
    tensor large enough for them to pay (compiled.START_ENTRIES). Only those: a compile the merge will not use
    only takes a core from it. `plan`'s time estimate asks it too (a first compile costs the merge time)."""
    if not keyed_kernels.AVAILABLE:
        return []
    merges = [r for r in recipes if r.op == "merge" and math.prod(r.shape) >= START_ENTRIES]
    keyed = [r for r in merges if r.seed is not None and getattr(get_method(r.method or ""), "keyed_random", False)]
    mixed = [r for r in merges if r.method in TASK_VECTOR_METHODS and not (r.seed is not None and r.method in KEYED)]
    groups = [keyed_kernels.KERNELS] if keyed else []
    if mixed:
        groups.append(bf16_mix.KERNELS)
    if any(r.method in RANKED for r in mixed):
        groups.append(introsort_replay.KERNELS)
    return groups
