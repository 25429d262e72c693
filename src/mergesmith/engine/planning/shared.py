"""What every planner shares: the options that shape a plan, shards, estimates, per-tensor seeds, memory budget.

The merge planner (planner.py), the MoE, tokensurgeon and raw planners and the executor all use these, so
they sit below all of them: a planner of a feature (tokensurgeon/, moe/) imports them without importing
the merge planner, and the merge planner can call into such features without a circle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ...io.checkpoint import Checkpoint
from ...io.direct_read import pool_bytes
from ...io.dtypes import dtype_size, is_float, parse_config_dtype
from ...io.lora_cache import LoraMerge
from ...runtime.devices import resolve_device
from ..plan import Estimate, InputRef, ShardPlan, TensorRecipe

DEFAULT_SHARD_SIZE = 5_000_000_000


@dataclass
class MergeOptions:
    """Command-line options that shape the plan (and so belong in its fingerprint when they change bytes)."""

    out_shard_size: int = DEFAULT_SHARD_SIZE
    random_seed: int | None = None
    copy_tokenizer: bool = True
    write_model_card: bool = True
    allow_crimes: bool = False
    trust_remote_code: bool = False
    threads: int = 1
    max_memory: int | None = None
    # --max-gpu-memory: device bytes in flight on CUDA (None: the device's free memory less a margin); no bytes change
    max_gpu_memory: int | None = None
    device: str = "cpu"
    executor: str = "local"  # "local" (thread pool) or "ray" (one task per shard); never changes output bytes
    ray_address: str | None = None
    strict: bool = False  # --strict: every warning (config keys and parameters, plan, non-finite inputs) is an error
    # --unsafe-truncate-embeddings: vocabularies of different sizes keep their first rows (else refused, as mergekit)
    unsafe_truncate_embeddings: bool = False
    # --lora-merge-cache/--lora-merge-dtype: `model+lora` inputs merged once into a directory (None: applied as read)
    lora_merge: LoraMerge | None = None
    # set when planning drew `random_seed` itself (none given, none to resume): that seed is this plan's only, so
    # `plan` must not print it as the one a later `merge` will use (that merge draws its own)
    seed_drawn: bool = False
    # --out-quantization: write the tensors stored quantized in the inputs (FP8, MXFP4) quantized again
    # (engine/planning/quantization.py); "none" writes them in the output dtype
    out_quantization: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)

    def open_input(self, ref: str) -> Checkpoint:
        """Open one input as these options say (a `model+lora` one merged into the LoRA cache when asked)."""
        from ...io.references import open_checkpoint

        if self.lora_merge is None or not self.lora_merge.materialise:
            return open_checkpoint(ref)
        from ...runtime.cache_root import cache_root

        return open_checkpoint(ref, self.lora_merge, cache_root())


class ModelPlanner:
    """What the planners of a whole model (a merge, an MoE assembly) start from: the config, the opened
    checkpoints, the options with their device checked, and where the config came from."""

    base: Checkpoint  # the checkpoint whose config.json and tensor names the output follows (set by the planner)

    def __init__(self, config: Any, checkpoints: dict[str, Checkpoint], options: MergeOptions, source: str) -> None:
        self.config = config
        self.ckpts = checkpoints
        # `auto` resolved, cuda/mps checked here, before any output is written (not for Ray: its workers hold the GPUs)
        options.device = resolve_device(options.device, check=options.executor != "ray")
        self.options = options
        self.source = source

    def base_dtype(self) -> str:
        """The output dtype when the config names none: the one the base's config.json names (`torch_dtype`, or
        `text_config`'s), else the most common float dtype among its tensors."""
        cfg = self.base.config or {}
        named = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
        if isinstance(named, str):
            try:
                return parse_config_dtype(named, "torch_dtype")
            except ConfigError:
                pass
        float_dtypes = [i.dtype for i in self.base.tensors.values() if is_float(i.dtype)]
        return max(set(float_dtypes), key=float_dtypes.count) if float_dtypes else "F32"

    def input_identities(self, refs: Sequence[str]) -> dict[str, list[list[Any]]]:
        """The identities (files, sizes, mtimes, header hashes) of the inputs `refs`, for the plan's fingerprint."""
        return {ref: [list(x) for x in self.ckpts[ref].identity()] for ref in refs}


def tensor_seed(global_seed: int, tensor_name: str) -> int:
    """A per-tensor seed from (global seed, output tensor name): output bytes ignore execution order."""
    digest = hashlib.sha256(f"{global_seed}:{tensor_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def cut_shards(recipes: list[TensorRecipe], limit: int) -> list[ShardPlan]:
    """Cut recipes into shards as transformers names them: a new shard starts when the next tensor
    would take the current one past `limit` bytes of tensor data (a larger tensor gets its own)."""
    groups: list[list[TensorRecipe]] = [[]]
    size = 0
    for r in recipes:
        if groups[-1] and size + r.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(r)
        size += r.nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [ShardPlan(name, group) for name, group in zip(names, groups)]


def distinct_input_bytes(recipes: Sequence[TensorRecipe], input_bytes: Callable[[InputRef], int]) -> int:
    """Bytes the recipes read, each input tensor counted once however many recipes read it."""
    seen: set[tuple[str, str]] = set()
    total = 0
    for r in recipes:
        for ref in r.inputs:
            if (ref.model, ref.tensor) not in seen:
                seen.add((ref.model, ref.tensor))
                total += input_bytes(ref)
    return total


def estimate_plan(
    recipes: list[TensorRecipe],
    input_bytes: Callable[[InputRef], int],
    compute_dtype: str,
    threads: int,
    max_memory: int | None,
) -> Estimate:
    """Bytes read (each input tensor once) and written, and peak working memory for `threads` recipes
    in flight: the largest working sets, capped by the budget but never below the single largest, plus the
    input feed's read-ahead buffers (io.direct_read.pool_bytes, grown where two-pass recipes' blocks are kept
    between their passes, see execution/input_feed.py; or all the bytes the recipes read if that is less: the feed
    may read a small merge's inputs all ahead)."""
    bytes_read = distinct_input_bytes(recipes, input_bytes)
    costs = [(recipe_memory(r, compute_dtype), r) for r in recipes] or [(0, None)]
    costs.sort(key=lambda c: c[0], reverse=True)
    threads = max(1, threads)
    peak = sum(c for c, _ in costs[:threads])
    budget = max_memory or automatic_budget([c for c, _ in costs], threads)
    from ..execution.input_feed import keeping_pool

    def block_bytes(recipe: TensorRecipe, ref: InputRef, rows: tuple[int, int]) -> int:
        return input_bytes(ref) * (rows[1] - rows[0]) // max(recipe.shape[0], 1)

    pool = pool_bytes(max_memory, keeping_pool(recipes, block_bytes))  # grown to keep two-pass blocks
    read_ahead = min(pool, sum(input_bytes(ref) for r in recipes for ref in r.inputs))
    peak = max(min(peak, budget), costs[0][0]) + read_ahead
    largest = costs[0][1]
    return Estimate(
        bytes_read,
        sum(r.nbytes for r in recipes),
        peak,
        largest.name if largest else "",
        costs[0][0],
        threads,
        read_ahead,
    )


def automatic_budget(costs: Sequence[int], threads: int) -> int:
    """The memory budget of a merge run without --max-memory: the largest recipe plus, for every other
    thread, a typical one (the size-weighted median: half of all working bytes are in recipes no larger).

    Why not unlimited: then the peak is the `threads` largest recipes at once, in a language model the
    embedding and the output head (the largest tensors by far), while hundreds of layer tensors could
    keep the other threads just as busy. With this budget the giants take turns and layer tensors fill the
    other threads (the executor looks past a recipe that does not fit, see ADMISSION_WINDOW); a model whose
    tensors are all alike still runs `threads` of them at once.
    """
    ordered = sorted(c for c in costs if c > 0)
    if not ordered:
        return 0
    half, running, typical = sum(ordered) / 2, 0, ordered[-1]
    for cost in ordered:
        running += cost
        if running >= half:
            typical = cost
            break
    return ordered[-1] + (max(1, threads) - 1) * typical


def recipe_memory(recipe: TensorRecipe, compute_dtype: str) -> int:
    """Working bytes of one recipe: its inputs (read or converted to the compute dtype), the method's
    copies and temporaries (its spec's measured working memory, see MethodSpec), and the output.

    Counted over the largest row block the recipe holds at once; the memory budget uses it to decide
    how many recipes may run at once. Inputs stored wider than the compute dtype map more pages than
    counted here (page cache the kernel may reclaim).
    """
    from ...methods import get_method
    from ..execution.blocks import block_numel, two_pass

    numel = block_numel(recipe)
    if recipe.op == "copy":
        return numel * (dtype_size(recipe.dtype) + dtype_size(compute_dtype))
    n = len(recipe.inputs)
    spec = get_method(recipe.method or "") if recipe.op == "merge" else None
    if spec is None:  # other ops (tokenizer surgery, MoE gates): the generic bound
        return numel * dtype_size(compute_dtype) * (2 * n + 3) + numel * dtype_size(recipe.dtype)
    if spec.shaped_memory is not None:  # inputs of other shapes than the output's (regmean's Grams): merged whole
        return spec.shaped_memory(n, recipe.shape, dict(recipe.params), dtype_size(compute_dtype)) + recipe.nbytes
    block = spec.working_memory(n, numel, dtype_size(compute_dtype)) + numel * dtype_size(recipe.dtype)
    if spec.totals is not None and spec.totals.memory is not None and two_pass(recipe):
        # a totals pass over the whole tensor (TIES' magnitudes) peaks before the first block is merged; what it
        # keeps (the packed masks) is held beside every block's working set
        peak, kept = spec.totals.memory(n, recipe.numel(), dtype_size(compute_dtype))
        return max(peak, block + kept)
    return block
