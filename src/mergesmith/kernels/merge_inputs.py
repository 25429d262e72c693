"""What a merge call is handed, as plain data: the tensors of one output tensor, their parameters, the keyed stream.

Why here, below the methods: the blocked machinery (magnitude_blocks' totals pass) folds the same inputs a method
sees, and kernels import nothing from methods/. methods.registry re-exports every name of this module, so a method
(or a third-party plugin) imports them from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .keyed_random import MaskStream


@dataclass
class MergeInputs:
    """What a method sees for one output tensor.

    `tensors` holds one tensor per contributing model in config order, all in the compute dtype
    and on the compute device, the base model's among them at `base_index` (None without a base).
    `model_params[i]` are the resolved per-model parameters of `tensors[i]`; `params` the global ones.
    `generator` is seeded by (random seed, output tensor name) for randomised methods, else None. It is
    always a CPU generator: a method draws on the CPU and moves the draw to its tensors' device, so a seed
    gives the same bytes on every device.

    `stream` (methods with `keyed_random`) is the same seed's position-keyed generator (keyed_random.py): a
    method that has it draws from it instead of `generator`, entry j of `tensors` being entry `offset + j` of
    the whole output tensor (in C order), so a row block draws what the whole tensor would at those entries.
    `totals` is what the method's `totals` pass gathered over all row blocks of the tensor (None when the
    tensor is merged whole, or the pass is not needed: the method then computes them itself).
    `whole_numel` is the entry count of the whole output tensor, whose row block `tensors` may be (0: unknown).
    `depth` is (output layer index, output layer count) of a tensor of the output's layer stack, None for one
    outside it (embeddings, final norm, head) or where the planner knows no layers (raw state dicts): see
    engine.plan.TensorRecipe.depth.
    """

    tensors: Sequence[torch.Tensor]
    base_index: int | None
    model_params: Sequence[dict[str, Any]]
    params: dict[str, Any]
    generator: torch.Generator | None = None
    tensor_name: str = ""
    release: Callable[[int], None] | None = None
    stream: MaskStream | None = None
    offset: int = 0
    totals: Any = None
    whole_numel: int = 0
    depth: tuple[int, int] | None = None

    def done_with(self, index: int) -> None:
        """Say that `tensors[index]` will not be read again by this call.

        Inputs are memory-mapped views of the checkpoint files; their pages count in the process's
        resident memory until dropped. A method that consumes an input early (the task-vector methods
        turn each into a difference at once) calls this so the executor drops those pages then, not
        after the whole tensor is merged: on an embedding-sized TIES recipe that is hundreds of MB of
        peak memory. Reading the tensor again stays correct (the pages are read back), only slower."""
        if self.release is not None:
            self.release(index)

    @property
    def base(self) -> torch.Tensor | None:
        return None if self.base_index is None else self.tensors[self.base_index]

    def others(self) -> list[int]:
        """Indices of the non-base models (the task vectors' owners)."""
        return [i for i in range(len(self.tensors)) if i != self.base_index]


MergeFn = Callable[[MergeInputs], torch.Tensor]


MERGE_WHOLE = "merge the tensor whole"
"""What a TotalsPass's `finish` returns where the blocked pass cannot go on (TIES: sort_select's replay gave up
on keys it had already reordered): the executor then merges that tensor whole, by the method's own path."""


@dataclass(frozen=True)
class TotalsPass:
    """A first pass over a tensor's row blocks for a method that is elementwise except for a few per-tensor
    numbers (DARE's and DELLA's rescaling by the whole task vector's L1 norm).

    `needed(params)` says, from the resolved global parameters, whether the pass is needed at all;
    `gather(state, inputs)` folds one row block (handed over in row order; `state` is None for the first) and
    returns the new state; `finish(state)` turns it into `MergeInputs.totals` for the second pass, which then
    writes each block exactly as the whole-tensor merge would have written those rows. `memory(n_inputs, numel,
    compute dtype size)`, where given, is (the bytes the pass holds at its peak, the bytes its result keeps
    through the merge pass) over a tensor of `numel` entries (TIES' magnitudes, then its packed masks): see
    engine.planning.shared.recipe_memory.
    """

    needed: Callable[[dict[str, Any]], bool]
    gather: Callable[[Any, MergeInputs], Any]
    finish: Callable[[Any], Any]
    memory: Callable[[int, int, int], tuple[int, int]] | None = None


def check_same_shape(inputs: MergeInputs, method: str) -> None:
    """Raise ValueError naming the tensor when the inputs' shapes differ.

    Every method merges tensors of one shape; the planner aligns vocabulary rows before a method runs, so any
    other mismatch is a real error and is reported with the tensor's name rather than as a broadcast error deep
    inside torch."""
    shapes = [tuple(t.shape) for t in inputs.tensors]
    if any(s != shapes[0] for s in shapes[1:]):
        name = inputs.tensor_name or "<unnamed tensor>"
        raise ValueError(f"{method}: tensor {name!r}: the models' shapes differ: {shapes}")


def require_base(inputs: MergeInputs, method: str) -> int:
    """The base's index; a missing base reaching a method is a planner bug, reported clearly."""
    if inputs.base_index is None:
        raise ValueError(f"{method}: tensor {inputs.tensor_name!r}: this method requires a base model")
    return inputs.base_index
