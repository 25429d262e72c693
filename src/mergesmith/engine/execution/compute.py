"""Computing one recipe: its inputs loaded (or taken from the input feed), the op or merge method run on them
with the recipe's seed, the result checked against the planned shape and converted to the output dtype.

Shared by every executor (LocalExecutor's workers, hence the Ray tasks too) and by what computes tensors
without an output directory (raw/in_memory.py, evolve/). A method that refuses its inputs raises MethodError,
one line naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError
from ...io.checkpoint import Checkpoint
from ...io.dtypes import to_torch
from ...kernels.keyed_random import MaskStream
from ...methods import MergeInputs, require_method
from ..plan import InputRef, TensorRecipe
from .device_transfer import lane_for
from .nonfinite import NonFiniteMonitor


def load_input(ckpt: Checkpoint, ref: InputRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """An input tensor, its rows truncated or zero-padded to `ref.rows` when vocabularies differ; with `rows`,
    only those rows of it.

    A quantized input (io/quantized.py) is dequantized here: for a row block, only the quantization blocks
    holding those rows, so a tensor merged in blocks is not dequantized whole once per block."""
    if rows is not None and ref.tensor in ckpt.quantized:
        have = ckpt.info(ref.tensor).shape[0] if ref.rows is None else min(ref.rows, ckpt.info(ref.tensor).shape[0])
        part = ckpt.get(ref.tensor, (min(rows[0], have), min(rows[1], have)))
        if part.shape[0] == rows[1] - rows[0]:
            return part
        padded = torch.zeros((rows[1] - rows[0], *part.shape[1:]), dtype=part.dtype)
        padded[: part.shape[0]] = part
        return padded
    tensor = ckpt.get(ref.tensor)
    if ref.rows is not None and tensor.shape[0] > ref.rows:
        tensor = tensor[: ref.rows]
    elif ref.rows is not None and tensor.shape[0] < ref.rows:
        padded = torch.zeros((ref.rows, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        tensor = padded
    return tensor if rows is None else tensor[rows[0] : rows[1]]


class MethodError(ConfigError):
    """A merge method raised ValueError for one tensor: one line naming the tensor and method (a plain
    message, so the exception pickles: Ray hands a worker's error back to the driver)."""

    @classmethod
    def of(cls, recipe: TensorRecipe, exc: ValueError) -> MethodError:
        text = " ".join(str(exc).split()) or exc.__class__.__name__
        where = "" if recipe.name in text else f"tensor {recipe.name!r}: "
        return cls(f"{where}method {recipe.method!r} failed: {text}")


def _check_shape(recipe: TensorRecipe, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise RuntimeError(
            f"recipe {recipe.op}:{recipe.method} returned shape {list(tensor.shape)} for {recipe.name!r}, "
            f"planned {list(shape)}"
        )


def compute(
    recipe: TensorRecipe,
    checkpoints: dict[str, Checkpoint],
    compute_dtype: torch.dtype,
    explicit_dtype: bool,
    device: torch.device,
    rows: tuple[int, int] | None = None,
    loaded: Sequence[torch.Tensor | None] | None = None,
    spent: Callable[[int], None] | None = None,
    totals: Any = None,
    gather: Gathered | None = None,
    monitor: NonFiniteMonitor | None = None,
    lend_output: bool = False,
) -> torch.Tensor | None:
    """The output tensor of one recipe (or of its rows [start, end)), in its output dtype, on the CPU.

    `loaded`: inputs of these rows already read (by the executor's input feed), per input in recipe order;
    the others (None) are read from their checkpoint's memory map. `spent(index)` is called once a loaded
    input will not be read again (converted to the compute dtype, or done with by the method), so that
    its memory can go back early, as a mapped input's pages are dropped. `monitor` counts the non-finite values
    of every input as it is loaded and of the output before it is returned (engine/execution/nonfinite.py).

    Two-pass methods (blocks.two_pass): with `gather` the rows are folded into `gather.state` by the method's
    totals pass and nothing is returned; `totals` hands the finished totals to the second pass.

    On CUDA a merge goes through this thread's lane (device_transfer.py: its own stream, pinned staging buffers,
    asynchronous copies; the same bytes). `lend_output`: the caller is done with the returned tensor before this
    thread computes again (the executor's writer copies it out), so on CUDA it may be the lane's pinned buffer."""
    out_dtype = to_torch(recipe.dtype)
    shape = recipe.shape if rows is None else (rows[1] - rows[0], *recipe.shape[1:])

    def streamed(index: int) -> bool:
        return loaded is not None and loaded[index] is not None

    def load(ref: InputRef, index: int | None = None) -> torch.Tensor:
        if index is not None and streamed(index):
            tensor = loaded[index]  # type: ignore[index]
        else:
            tensor = load_input(checkpoints[ref.model], ref, rows)
        if monitor is not None:
            monitor.check_input(ref.model, ref.tensor, tensor, None if rows is None else rows[0])
        return tensor

    def checked(out: torch.Tensor) -> torch.Tensor:
        if monitor is not None:
            monitor.check_output(recipe.name, [(ref.model, ref.tensor) for ref in recipe.inputs], out)
        return out

    if recipe.op == "copy":
        tensor = load(recipe.inputs[0], 0)
        same = tensor.dtype == out_dtype and not explicit_dtype
        if explicit_dtype and tensor.is_floating_point():
            tensor = tensor.to(compute_dtype)  # mergekit loads in `dtype` first; the rounding must match
        return tensor.to(out_dtype) if same else checked(tensor.to(out_dtype))  # a conversion may overflow
    if recipe.op != "merge":
        from .ops import get_op

        out = get_op(recipe.op)(recipe, load).to(out_dtype).cpu().contiguous()
        _check_shape(recipe, out, shape)
        return checked(out)
    spec = require_method(recipe.method or "")

    def release_input(index: int, ref: InputRef) -> None:
        if streamed(index):
            if spent is not None:
                spent(index)
        else:
            advise_inputs(recipe, checkpoints, "dontneed", rows, only=ref)

    lane = lane_for(device)  # None off CUDA: the plain path
    with lane.active() if lane is not None else nullcontext():  # this thread's stream made current
        tensors: list[torch.Tensor] = []
        mapped_refs: dict[int, InputRef] = {}  # inputs the method reads straight from a mapping or a feed buffer
        for index, ref in enumerate(recipe.inputs):
            mapped = load(ref, index)
            if lane is None:
                tensor = mapped.to(device=device, dtype=compute_dtype)
            else:  # copied through a pinned staging buffer on this thread's stream
                tensor = lane.to_device(mapped, compute_dtype, index)
            if tensor.data_ptr() == mapped.data_ptr():
                mapped_refs[index] = ref
            else:  # converted or moved: the mapped pages (or the feed's buffer) are spent already
                release_input(index, ref)
            tensors.append(tensor)

        def release(index: int) -> None:
            if index in mapped_refs:
                release_input(index, mapped_refs[index])

        generator = None
        if recipe.seed is not None:
            # Always a CPU generator, whatever the compute device: methods draw their random masks on the
            # CPU and move them over, so the output bytes of a seed do not depend on the device (which is
            # not in the plan's fingerprint, so a resume on another device must draw the same masks).
            generator = torch.Generator(device="cpu")
            generator.manual_seed(recipe.seed)
        # Methods that draw by entry position get the seed's keyed stream, and where these rows start.
        offset = 0 if rows is None else rows[0] * (recipe.numel() // max(recipe.shape[0], 1))
        end = offset + math.prod(shape)  # where these rows end: the stream draws no further ahead
        stream = MaskStream(recipe.seed, end) if recipe.seed is not None and spec.keyed_random else None
        inputs = MergeInputs(
            tensors=tensors,
            base_index=recipe.base_index,
            model_params=[dict(p) for p in recipe.model_params],
            params=dict(recipe.params),
            generator=generator,
            tensor_name=recipe.name,
            release=release,
            stream=stream,
            offset=offset,
            totals=totals,
            whole_numel=recipe.numel(),
            depth=recipe.depth,
        )
        try:
            if gather is not None:
                assert spec.totals is not None
                gather.state = spec.totals.gather(gather.state, inputs)
                if lane is not None:
                    lane.settle()  # the state is finished outside the lane, on the thread's default stream
                return None
            merged = spec.merge(inputs)
        except ValueError as exc:
            # A method refuses its inputs or parameters (the plan-time checks catch what they can): the user's
            # merge, not a bug; one line naming the tensor. Finished shards stay journaled for a rerun.
            raise MethodError.of(recipe, exc) from exc
        _check_shape(recipe, merged, shape)
        if lane is not None:
            return checked(lane.to_host(merged, out_dtype, lend_output))
        return checked(merged.to(dtype=out_dtype).cpu())


@dataclass
class Gathered:
    """The state of a method's totals pass between row blocks (see registry.TotalsPass)."""

    state: Any = None


def advise_inputs(
    recipe: TensorRecipe,
    checkpoints: dict[str, Checkpoint],
    advice: str,
    rows: tuple[int, int] | None = None,
    only: InputRef | None = None,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Read-ahead ("willneed") or release ("dontneed", "uncache": see Checkpoint.advise) the input bytes a recipe
    (or row block) uses
    (`only`: those of one of its inputs; `skip`: not those of these input indices, which are read
    around the memory map)."""
    for index, ref in enumerate(recipe.inputs if only is None else (only,)):
        if only is None and index in skip:
            continue
        ckpt = checkpoints[ref.model]
        info = ckpt.tensors.get(ref.tensor)
        if info is None:
            continue
        if rows is None or not info.shape:
            ckpt.advise(ref.tensor, advice)
            continue
        row_bytes = info.nbytes // max(info.shape[0], 1)
        start, end = min(rows[0], info.shape[0]), min(rows[1], info.shape[0])
        if end > start:
            ckpt.advise(ref.tensor, advice, start * row_bytes, end * row_bytes)
