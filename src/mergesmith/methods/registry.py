"""The method registry: each merge method is a pure function plus a small spec of its parameters.

Why a spec: the planner validates configs, resolves parameters and estimates memory from it
without running any math; the math module stays a plain function of tensors and numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.keyed_random import MaskStream

_SWITCH_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name and default (`required=True` means no default).

    `non_base=True` marks a per-model parameter that only the non-base models take (mergekit's
    NON_BASE scope, e.g. `weight` and `density` of the task-vector methods): the base model is
    neither required to have it nor given it, and a value set on the base is ignored.
    """

    name: str
    default: Any = None
    required: bool = False
    non_base: bool = False
    choices: tuple[str, ...] | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` cannot be this parameter's value (checked at plan time, before any tensor is read),
        or None. The kind is the default's: a switch, a number, or one of `choices`."""
        if value is None:
            return None if not self.required else "a value is required"
        if self.choices is not None:
            return None if str(value) in self.choices else f"must be one of {', '.join(self.choices)}, got {value!r}"
        if isinstance(self.default, bool):
            ok = isinstance(value, bool) or value in (0, 1) or str(value).strip().lower() in _SWITCH_WORDS
            return None if ok else f"must be true or false, got {value!r}"
        if self.required or isinstance(self.default, int | float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            return None if ok else f"must be a number, got {value!r}"
        return None


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


@dataclass(frozen=True)
class MethodSpec:
    """How the planner and executor treat a method.

    - `params`: global parameters (one value per output tensor, from slice or top-level `parameters`);
    - `model_params`: per-model parameters (from source, slice, model or top-level `parameters`);
    - `requires_base`: validation fails early without a `base_model`;
    - `min_models`/`max_models`: counted over all contributing models, the base included;
    - `randomized`: the executor passes a generator seeded per output tensor;
    - `elementwise`: the output row block depends only on the same row block of the inputs, so
      huge tensors may be merged in row blocks to cap memory;
    - `totals`: a first pass (see TotalsPass) after which the method is elementwise: such a method also runs
      in row blocks, reading each block's inputs twice (engine/execution/input_feed.py: from the disk, once per pass);
    - `keyed_random`: a randomised method that draws only from `MergeInputs.stream`, by entry position, so
      its row blocks draw what the whole tensor would (randomised methods without it run whole);
    - `uses_base_in_models`: whether the base model contributes even when not listed in `models`;
    - `min_non_base`/`max_non_base`: bounds on the models other than the base (None: no bound), for
      methods whose base is optional, e.g. nuslerp takes exactly two models besides an optional base;
    - `model_params_problem`: a check of one model's resolved parameters together (e.g. DELLA's density
      +/- epsilon), run at plan time;
    - `memory_per_input`, `memory_fixed`, `memory_bytes`: the working memory of one call over n inputs of
      e elements is e * (c * (memory_per_input * n + memory_fixed) + memory_bytes) bytes besides the output,
      c the compute dtype's size: the inputs (read or converted), the method's stacked copies and
      temporaries, and dtype-independent ones (int64 sort indices, float32 magnitudes). Measured peaks of
      the allocations (torch profiler) plus the inputs at the compute width, with a margin; see
      `engine.planning.shared.recipe_memory` and tests/test_planner_checks2.py.
    - `memory_chunked`, `memory_chunk_elements`: for a method that does part of its work in chunks of at
      most `memory_chunk_elements` entries (the task-vector family mixes in chunks), that part's temporaries
      are (per input, fixed) compute-dtype copies over min(e, chunk) entries, not over the whole tensor.
      On the 65 M-entry embedding of a 1 B model a tensor-wide charge tripled TIES's estimate.
    """

    name: str
    merge: MergeFn
    params: tuple[ParamSpec, ...] = ()
    model_params: tuple[ParamSpec, ...] = ()
    requires_base: bool = False
    min_models: int = 1
    max_models: int | None = None
    randomized: bool = False
    elementwise: bool = True
    uses_base_in_models: bool = True
    description: str = ""
    aliases: tuple[str, ...] = field(default=())
    min_non_base: int | None = None
    max_non_base: int | None = None
    memory_per_input: float = 2.0
    memory_fixed: float = 3.0
    memory_bytes: int = 0
    memory_chunked: tuple[float, float] = (0.0, 0.0)
    memory_chunk_elements: int = 0
    model_params_problem: Callable[[dict[str, Any]], str | None] | None = None
    totals: TotalsPass | None = None
    keyed_random: bool = False

    def model_problem(self, params: dict[str, Any]) -> str | None:
        """Why one model's resolved parameters, taken together, cannot be used (None when they can):
        checked by the planner per model and tensor, after each parameter's own check."""
        return self.model_params_problem(params) if self.model_params_problem is not None else None

    def working_memory(self, n_inputs: int, numel: int, compute_size: int) -> int:
        """Bytes one call holds at its peak over `n_inputs` tensors of `numel` elements, the output aside."""
        per_element = compute_size * (self.memory_per_input * n_inputs + self.memory_fixed) + self.memory_bytes
        chunk = min(numel, self.memory_chunk_elements) if self.memory_chunk_elements else numel
        per_chunk_element = compute_size * (self.memory_chunked[0] * n_inputs + self.memory_chunked[1])
        return int(numel * per_element + chunk * per_chunk_element)

    def param_names(self) -> set[str]:
        return {p.name for p in self.params} | {p.name for p in self.model_params}

    def count_problem(self, contributing: int, has_base: bool) -> str | None:
        """Why `contributing` models (the base, when `has_base`, among them) cannot feed this method, or None."""
        if self.requires_base and not has_base:
            return f"method {self.name!r} requires a base model"
        if contributing < self.min_models:
            return f"method {self.name!r} needs at least {self.min_models} models, got {contributing}"
        if self.max_models is not None and contributing > self.max_models:
            plural = "s" if self.max_models != 1 else ""
            return f"method {self.name!r} takes at most {self.max_models} model{plural}, got {contributing}"
        others = contributing - int(has_base)
        if self.min_non_base is not None and others < self.min_non_base:
            return f"method {self.name!r} needs at least {self.min_non_base} models besides the base, got {others}"
        if self.max_non_base is not None and others > self.max_non_base:
            return f"method {self.name!r} takes at most {self.max_non_base} models besides the base, got {others}"
        return None


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add a method (and its aliases) to the registry; names are unique."""
    for name in (spec.name, *spec.aliases):
        if name in _REGISTRY:
            raise ValueError(f"merge method {name!r} registered twice")
        _REGISTRY[name] = spec
    return spec


def get_method(name: str) -> MethodSpec | None:
    return _REGISTRY.get(name)


def method_names() -> list[str]:
    return sorted(_REGISTRY)
