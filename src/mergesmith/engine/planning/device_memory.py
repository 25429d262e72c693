"""Device (GPU) memory of a plan: what each recipe holds on the device, the peak with several in flight, and the
plan-time refusal of a tensor that cannot fit the device budget.

Why here, beside shared.recipe_memory: on `--device cuda` a merge recipe's inputs, the method's temporaries and
its output all live on the device, so its device working set is the host estimate of the same recipe (over its
largest row block: a large elementwise tensor is already merged in blocks of blocks.BLOCK_ELEMENTS, a few MB,
whatever its size). A copy never touches the device. A recipe merged whole (SVD methods, quantized output) whose
working set exceeds the budget cannot be cut smaller, so it is refused before a tensor is read, one line naming
it and the budget, instead of a CUDA out-of-memory error halfway through the merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...io.dtypes import dtype_size
from ...runtime.device_memory import DeviceLimit
from ...sizes import human_size
from ..plan import TensorRecipe
from .shared import recipe_memory


def device_recipe_memory(recipe: TensorRecipe, compute_dtype: str) -> int:
    """Device bytes one recipe holds at once on the GPU path (0 for copies and non-merge ops, which run on the CPU)."""
    if recipe.op != "merge":
        return 0
    return recipe_memory(recipe, compute_dtype)


def staging_bytes(recipes: Sequence[TensorRecipe], compute_dtype: str, cap: int) -> int:
    """Pinned bytes one worker's staging pool grows to (device_transfer.PinnedPool): a buffer per input position and
    one for the output, each the power of two that holds the largest block seen there (the recipe's output dtype
    standing for its inputs' stored one), in all at most `cap` (larger blocks are copied without staging)."""
    from ...io.dtypes import to_torch
    from ..execution.blocks import block_numel
    from ..execution.device_transfer import OUTPUT_SLOT, slot_size, staging_dtype

    largest: dict[object, int] = {}
    compute = to_torch(compute_dtype)
    for recipe in recipes:
        if recipe.op != "merge":
            continue
        numel = block_numel(recipe)
        wire = staging_dtype(to_torch(recipe.dtype), compute).itemsize
        for index in range(len(recipe.inputs)):
            largest[index] = max(largest.get(index, 0), numel * wire)
        largest[OUTPUT_SLOT] = max(largest.get(OUTPUT_SLOT, 0), numel * dtype_size(recipe.dtype))
    return min(cap, sum(slot_size(nbytes, cap) for nbytes in largest.values()))


@dataclass(frozen=True)
class DeviceEstimate:
    """The device memory a merge holds: at peak with `threads` recipes in flight, and its largest recipe."""

    peak: int
    largest_tensor: str
    largest_bytes: int
    limit: DeviceLimit | None


def device_estimate(
    recipes: Sequence[TensorRecipe], compute_dtype: str, threads: int, limit: DeviceLimit | None
) -> DeviceEstimate:
    """The `threads` largest device working sets at once, capped by the budget but never below the largest
    one (as shared.estimate_plan counts host memory); the CUDA context and the allocator's cache come on top."""
    costs = sorted(((device_recipe_memory(r, compute_dtype), r.name) for r in recipes), reverse=True) or [(0, "")]
    peak = sum(c for c, _ in costs[: max(1, threads)])
    if limit is not None:
        peak = min(peak, max(limit.limit, costs[0][0]))
    return DeviceEstimate(peak, costs[0][1], costs[0][0], limit)


def check_device_budget(recipes: Sequence[TensorRecipe], compute_dtype: str, limit: DeviceLimit | None) -> None:
    """Refuse (ConfigError, one line) a recipe whose device working set alone exceeds the device budget: it is
    merged whole, or even its row blocks do not fit."""
    if limit is None:
        return
    from ..execution.blocks import BLOCK_ELEMENTS, blockable

    for recipe in recipes:
        cost = device_recipe_memory(recipe, compute_dtype)
        if cost <= limit.limit:
            continue
        how = f"merged whole by {recipe.method}"
        if blockable(recipe):
            how = f"even in row blocks of {BLOCK_ELEMENTS:,} entries"
        raise ConfigError(
            f"tensor {recipe.name!r} needs {human_size(cost)} of GPU memory ({how}), over {limit.describe()}; "
            "raise --max-gpu-memory, free the GPU, or merge on --device cpu"
        )
