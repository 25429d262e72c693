"""The method registry: each merge method is a pure function plus a small spec of its parameters.

Why a spec: the planner validates configs, resolves parameters and estimates memory from it
without running any math; the math module stays a plain function of tensors and numbers.

A method module only defines its specs; methods/__init__.py lists the built-in ones and registers them
(then the third-party ones). MergeInputs, MergeFn, TotalsPass and MERGE_WHOLE are defined one layer
down (kernels.merge_inputs: the blocked machinery there folds the same inputs) and re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..kernels.compiled import KernelGroup
from ..kernels.merge_inputs import MERGE_WHOLE, MergeFn, MergeInputs, TotalsPass

__all__ = [
    "MERGE_WHOLE",
    "MergeFn",
    "MergeInputs",
    "MethodSpec",
    "ModelCount",
    "ParamSpec",
    "TotalsPass",
    "WarmUp",
    "WorkingMemory",
    "get_method",
    "method_names",
    "register",
]

_SWITCH_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n"}


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name and default (`required=True` means no default).

    `non_base=True` marks a per-model parameter that only the non-base models take (mergekit's
    NON_BASE scope, e.g. `weight` and `density` of the task-vector methods): the base model is
    neither required to have it nor given it, and a value set on the base is ignored.
    `check`, where given, says why a value of the right kind is still out of range (None when it is not),
    e.g. a fraction outside (0, 1] or a negative iteration count: see `at_least` and `fraction`.
    """

    name: str
    default: Any = None
    required: bool = False
    non_base: bool = False
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None

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
            if not ok:
                return f"must be a number, got {value!r}"
        return self.check(value) if self.check is not None else None


def at_least(low: float, integer: bool = False) -> Callable[[Any], str | None]:
    """A ParamSpec check: a number >= `low` (a whole number with `integer`)."""

    def check(value: Any) -> str | None:
        if integer and float(value) != int(value):
            return f"must be a whole number, got {value!r}"
        return None if float(value) >= low else f"must be at least {low}, got {value!r}"

    return check


def fraction(value: Any) -> str | None:
    """A ParamSpec check: a fraction in (0, 1]."""
    return None if 0 < float(value) <= 1 else f"must be in (0, 1], got {value!r}"


def within(low: float, high: float) -> Callable[[Any], str | None]:
    """A ParamSpec check: a number in [low, high], both included."""

    def check(value: Any) -> str | None:
        return None if low <= float(value) <= high else f"must lie in [{low}, {high}], got {value!r}"

    return check


def positive(value: Any) -> str | None:
    """A ParamSpec check: a number > 0."""
    return None if float(value) > 0 else f"must be greater than 0, got {value!r}"


@dataclass(frozen=True, kw_only=True)
class ModelCount:
    """How many models a method takes. `min_models`/`max_models` count all contributing models, the base
    included; `min_non_base`/`max_non_base` bound the models other than the base (None: no bound), for methods
    whose base is optional, e.g. nuslerp takes exactly two models besides an optional base."""

    min_models: int = 1
    max_models: int | None = None
    min_non_base: int | None = None
    max_non_base: int | None = None

    def problem(self, method: str, contributing: int, has_base: bool) -> str | None:
        """Why `contributing` models (the base, when `has_base`, among them) cannot feed `method`, or None."""
        if contributing < self.min_models:
            return f"method {method!r} needs at least {self.min_models} models, got {contributing}"
        if self.max_models is not None and contributing > self.max_models:
            plural = "s" if self.max_models != 1 else ""
            return f"method {method!r} takes at most {self.max_models} model{plural}, got {contributing}"
        others = contributing - int(has_base)
        if self.min_non_base is not None and others < self.min_non_base:
            return f"method {method!r} needs at least {self.min_non_base} models besides the base, got {others}"
        if self.max_non_base is not None and others > self.max_non_base:
            return f"method {method!r} takes at most {self.max_non_base} models besides the base, got {others}"
        return None


@dataclass(frozen=True, kw_only=True)
class WorkingMemory:
    """The working memory of one call over n inputs of e elements, besides the output:

        e * (c * (per_input * n + fixed) + bytes)  +  min(e, chunk_elements) * c * (chunked[0] * n + chunked[1])

    c the compute dtype's size. The first term: the inputs (read or converted), the method's stacked copies and
    temporaries, and dtype-independent ones (int64 sort indices, float32 magnitudes). The second, for a method
    that does part of its work in chunks of at most `chunk_elements` entries (the task-vector family mixes in
    chunks): that part's compute-dtype temporaries, per input and fixed (on the 65 M-entry embedding of a 1 B
    model a tensor-wide charge tripled TIES's estimate). Measured peaks of the allocations (torch profiler) plus
    the inputs at the compute width, with a margin; see `engine.planning.shared.recipe_memory` and
    tests/test_planner_checks2.py. `work_size`: a method that computes in float32 whatever the compute dtype
    (bf16 inputs upcast) sets 4, and c is then at least that."""

    per_input: float = 2.0
    fixed: float = 3.0
    bytes: int = 0
    chunked: tuple[float, float] = (0.0, 0.0)
    chunk_elements: int = 0
    work_size: int = 0

    def of(self, n_inputs: int, numel: int, compute_size: int) -> int:
        """Bytes one call holds at its peak over `n_inputs` tensors of `numel` elements, the output aside."""
        compute_size = max(compute_size, self.work_size)
        per_element = compute_size * (self.per_input * n_inputs + self.fixed) + self.bytes
        chunk = min(numel, self.chunk_elements) if self.chunk_elements else numel
        per_chunk_element = compute_size * (self.chunked[0] * n_inputs + self.chunked[1])
        return int(numel * per_element + chunk * per_chunk_element)


WarmUp = Callable[[dict[str, Any], bool], Sequence[KernelGroup]]
"""(a recipe's resolved global parameters, whether it is seeded) -> the compiled kernel groups its merge uses
(kernels.compiled.KernelGroup), which the executor starts compiling as a merge begins and `plan` prices."""


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """How the planner and executor treat a method (keyword-only; only `name` and `merge` are required).

    What it is:
    - `name`, `aliases`, `description`; `merge`: the function of a MergeInputs that returns the output tensor.

    What it takes:
    - `params`: global parameters (one value per output tensor, from slice or top-level `parameters`);
    - `model_params`: per-model parameters (from source, slice, model or top-level `parameters`);
    - `model_params_problem`: a check of one model's resolved parameters together (e.g. DELLA's density
      +/- epsilon), run at plan time;
    - `requires_base`: validation fails early without a `base_model`;
    - `uses_base_in_models`: whether the base model contributes even when not listed in `models`;
    - `models`: how many models (ModelCount);
    - `task_vector`: the output is the base plus a merged task vector (a difference of each model from the
      base), so options that act on the merged task vector (LiNeS' layer-increasing scaling) apply to it.

    How it runs:
    - `randomized`: the executor passes a generator seeded per output tensor;
    - `keyed_random`: a randomised method that draws only from `MergeInputs.stream`, by entry position, so
      its row blocks draw what the whole tensor would (randomised methods without it run whole);
    - `elementwise`: the output row block depends only on the same row block of the inputs, so
      huge tensors may be merged in row blocks to cap memory;
    - `totals`: a first pass (see TotalsPass) after which the method is elementwise: such a method also runs
      in row blocks, reading each block's inputs twice (engine/execution/input_feed.py: from the disk, once per
      pass);
    - `memory`: its working memory (WorkingMemory), which the memory budget admits recipes by;
    - `shaped_memory`: instead of `memory`, for a method whose inputs are not all the output's shape (regmean's
      Gram matrices are in x in beside an out x in weight): (input count, output shape, the recipe's global
      parameters, compute dtype size) -> its peak bytes besides the output;
    - `warm_up`: the compiled kernel groups a recipe's merge will use (WarmUp), None for none: the executor
      starts them as a merge begins, so it names no method (engine/execution/kernel_warmup.py);
    - `svd_work`: for a method whose time goes into SVDs (tsv, iso_c, iso_cts), (tensor shape, number of task
      vectors) -> its units of SVD work, the sum of m n min(m, n) over the SVDs one call makes, which `plan`
      prices at a measured rate (engine/time_estimate.py); None for the others.
    """

    name: str
    merge: MergeFn
    description: str = ""
    aliases: tuple[str, ...] = ()
    params: tuple[ParamSpec, ...] = ()
    model_params: tuple[ParamSpec, ...] = ()
    model_params_problem: Callable[[dict[str, Any]], str | None] | None = None
    requires_base: bool = False
    uses_base_in_models: bool = True
    models: ModelCount = ModelCount()
    task_vector: bool = False
    randomized: bool = False
    keyed_random: bool = False
    elementwise: bool = True
    totals: TotalsPass | None = None
    memory: WorkingMemory = WorkingMemory()
    shaped_memory: Callable[[int, tuple[int, ...], dict[str, Any], int], int] | None = None
    warm_up: WarmUp | None = None
    svd_work: Callable[[tuple[int, ...], int], float] | None = None

    # the model-count bounds, read where they were flat fields
    @property
    def min_models(self) -> int:
        return self.models.min_models

    @property
    def max_models(self) -> int | None:
        return self.models.max_models

    @property
    def min_non_base(self) -> int | None:
        return self.models.min_non_base

    @property
    def max_non_base(self) -> int | None:
        return self.models.max_non_base

    def model_problem(self, params: dict[str, Any]) -> str | None:
        """Why one model's resolved parameters, taken together, cannot be used (None when they can):
        checked by the planner per model and tensor, after each parameter's own check."""
        return self.model_params_problem(params) if self.model_params_problem is not None else None

    def working_memory(self, n_inputs: int, numel: int, compute_size: int) -> int:
        """Bytes one call holds at its peak over `n_inputs` tensors of `numel` elements, the output aside."""
        return self.memory.of(n_inputs, numel, compute_size)

    def kernel_groups(self, params: dict[str, Any], seeded: bool) -> list[KernelGroup]:
        """The compiled kernel groups a merge of one recipe with these parameters uses (see `warm_up`)."""
        return list(self.warm_up(params, seeded)) if self.warm_up is not None else []

    def param_names(self) -> set[str]:
        return {p.name for p in self.params} | {p.name for p in self.model_params}

    def count_problem(self, contributing: int, has_base: bool) -> str | None:
        """Why `contributing` models (the base, when `has_base`, among them) cannot feed this method, or None."""
        if self.requires_base and not has_base:
            return f"method {self.name!r} requires a base model"
        return self.models.problem(self.name, contributing, has_base)


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
