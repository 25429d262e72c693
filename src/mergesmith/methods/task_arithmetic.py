"""The task-vector family: task arithmetic, TIES, DARE, DELLA and Model Breadcrumbs as one procedure.

Ilharco et al. 2023, "Editing Models with Task Arithmetic" (arXiv:2212.04089): a fine-tuned model x_i
differs from its base by a task vector d_i = x_i - base, and task vectors add:

    out = base + lambda * sum_i w_i d_i / Z            (Z = sum_i w_i with `normalize`, else 1)

The later papers change two steps of this sum, and mergekit 0.1.5 implements them all as one
procedure, reproduced here:

1. sparsify each task vector, keeping about a `density` fraction p of its n entries:
   - TIES "trim" (Yadav et al. 2023, arXiv:2306.01708): keep the max(1, floor(p n)) entries of largest |d|;
   - DARE "drop" (Yu et al. 2023, arXiv:2311.03099): keep each entry independently with probability p;
   - Model Breadcrumbs (Davari & Belilovsky 2023, arXiv:2312.06795): drop the floor(gamma n) largest |d| and
     enough of the smallest that floor(p n) remain (fewer outliers where gamma and p ask for more than n);
   - DELLA "MagPrune" (Deep et al. 2024, arXiv:2406.11617): keep the entry of magnitude rank r (0 = smallest)
     in its row of m entries with probability p_r = p - epsilon + 2 epsilon r / (m - 1);
   with `rescale`, the survivors are multiplied by |d|_1 / |d * keep|_1, so the vector keeps its L1 norm
   (mergekit's form of the papers' 1/p, equal in expectation for DARE); p >= 1 keeps d untouched;
2. weight: d_i <- w_i d_i;
3. with sign consensus (TIES "elect" and "disjoint merge"), per entry the majority sign is the sign of
   sum_i w_i d_i (`consensus_method: sum`, the paper's rule and mergekit's) or of the count of positive
   minus negative entries (`count`); only entries of that sign (zeros never) are summed, and with
   `normalize` divided by the sum of the weights of the models that contributed to that entry (1 where
   none did). Without consensus, Z is the sum of all weights (1 where it is ~0).

The output is base + lambda * (mixed delta). `int8_mask` only picks the dtype of the sign mask (a memory
saving in mergekit); the result is the same either way.

Per-method defaults (mergekit 0.1.5): normalize is on for ties and della, off for the rest; rescale is on
for the DARE and DELLA methods, off for the rest. A model's `weight` is required; its `density` defaults
to 1 (no sparsification), `gamma` (breadcrumbs) to 0.01, `epsilon` (DELLA) to 0.15. These per-model
parameters belong to the non-base models only.

How it is computed lives one layer down, in kernels/: the magnitude windows are found by sort_select (torch's
sort order without the whole sort) through selection.py; the mix of step 3 is task_vector_mix.py (mergekit's
stepwise rounding, in chunks; bf16_mix's compiled loop); a seeded DARE or DELLA draws its masks from the keyed
stream and computes in float32 (keyed_merge.py), and tensors too large to merge whole run in row blocks after a
totals pass (magnitude_blocks.py for TIES and Breadcrumbs, keyed_merge's L1 norms for DARE and DELLA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import bf16_mix, introsort_replay, keyed_kernels, keyed_merge, magnitude_blocks, task_vector_mix
from ..kernels.compiled import KernelGroup
from ..kernels.selection import (
    KEEP_ALL,
    ZEROS,
    Selection,
    Window,
    apply_selection,
    cpu_bernoulli,
    keep_l1_norm,
    work_dtype_of,
)
from ..kernels.task_vector_mix import CONSENSUS_METHODS, MIX_CHUNK
from .common import as_bool, check_same_shape, require_base, require_generator
from .registry import MergeInputs, MethodSpec, ParamSpec, TotalsPass, WorkingMemory

# ----- step 1: the sparsification rules -------------------------------------------------------------------------


def magnitude_window(n: int, density: float) -> Selection:
    """TIES trim: the max(1, floor(density * n)) largest magnitudes."""
    if density >= 1:
        return KEEP_ALL
    if density <= 0 or n == 0:
        return ZEROS
    return Window(0, max(1, int(density * n)), descending=True)


def outliers_window(n: int, density: float, gamma: float) -> Selection:
    """Breadcrumbs: drop the floor(gamma * n) largest magnitudes and the smallest, keeping floor(density * n)."""
    if density >= 1:
        return KEEP_ALL
    keep = int(density * n)
    top = int(gamma * n)
    bottom = max(0, n - keep - top)
    return Window(bottom, bottom + keep, descending=False)


def magnitude(delta: torch.Tensor, density: float, rescale: bool = False, in_place: bool = False) -> torch.Tensor:
    """TIES trim: keep the max(1, floor(density * n)) largest-magnitude entries (written over `delta` with
    `in_place`)."""
    return apply_selection(delta, magnitude_window(delta.numel(), density), rescale, in_place)


def magnitude_outliers(
    delta: torch.Tensor, density: float, gamma: float = 0.01, rescale: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Breadcrumbs: drop the gamma largest-magnitude entries and the smallest, keeping floor(density * n)
    (written over `delta` with `in_place`)."""
    return apply_selection(delta, outliers_window(delta.numel(), density, gamma), rescale, in_place)


def random_drop(delta: torch.Tensor, density: float, generator: torch.Generator, rescale: bool = True) -> torch.Tensor:
    """DARE: keep each entry with probability `density` (one Bernoulli draw per entry, on the CPU)."""
    if density >= 1:
        return delta
    dtype = work_dtype_of(delta)
    probs = torch.full(delta.shape, fill_value=density, dtype=dtype)  # on the CPU, where the draw is made
    mask = torch.bernoulli(probs, generator=generator).to(delta.device)
    return keep_l1_norm(delta.to(dtype), mask, rescale).to(delta.dtype)


def della_problem(density: float, epsilon: float) -> str | None:
    """Why DELLA cannot draw with this density and epsilon (None when it can): with 0 < density < 1 the keep
    probabilities density - epsilon and density + epsilon must lie strictly inside (0, 1)."""
    if not 0 < density < 1:
        return None  # 0 drops everything, 1 or more keeps everything: nothing is drawn
    if density + epsilon >= 1 or density - epsilon <= 0:
        return f"density ({density}) +/- epsilon ({epsilon}) must stay inside (0, 1); choose a smaller epsilon"
    return None


def della_magprune(
    delta: torch.Tensor, density: float, epsilon: float, generator: torch.Generator | None, rescale: bool = True
) -> torch.Tensor:
    """DELLA MagPrune: keep probability linear in the magnitude rank within each row.

    The smallest entry of a row is kept with probability density - epsilon, the largest with density + epsilon;
    both must lie in (0, 1). A 1-D tensor is one row.
    """
    if density >= 1:
        return delta
    if density <= 0:
        return torch.zeros_like(delta)
    problem = della_problem(density, epsilon)
    if problem:
        raise ValueError(f"della: {problem}")
    dtype = work_dtype_of(delta)
    shape = delta.shape
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    probs = della_probabilities(rows, density, epsilon)
    mask = cpu_bernoulli(probs, generator).to(dtype)
    return keep_l1_norm(rows.to(dtype), mask, rescale).to(delta.dtype).reshape(shape)


def della_probabilities(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """MagPrune's keep probability of every entry of `rows` (ranked along dim 1), in the work dtype.

    The inverse of the sorting permutation gives each entry's rank; that is argsort(argsort(.)) (mergekit's
    call) with one sort fewer, and the same ranks, since argsort of a permutation is its unique inverse."""
    dtype = work_dtype_of(rows)
    order = torch.argsort(rows.abs(), dim=1, descending=False)
    # rank as mergekit rounds it: the 0-based position converted to the work dtype, then + 1 in that dtype
    column = [1, rows.shape[1]] + [1] * (rows.dim() - 2)  # ranks run along dim 1, also of 3-D tensors
    positions = (torch.arange(rows.shape[1], device=rows.device).to(dtype) + 1).view(column).expand_as(order)
    ranks = torch.empty(order.shape, dtype=dtype, device=rows.device).scatter_(1, order, positions)
    # Each row's ranks are a permutation of `positions`, whose smallest and largest are its first and last (the
    # rounding to the work dtype is monotone): mergekit's min and max over the ranks, without two more passes.
    lowest = positions[:, :1]
    highest = positions[:, -1:]
    span = highest - lowest
    # A one-entry row has no spread of ranks; it is kept with probability `density` (mergekit would divide 0 by 0).
    position = torch.where(span > 0, (ranks - lowest) / torch.where(span > 0, span, 1), 0.5).clamp(0, 1)
    return (density - epsilon) + position * 2 * epsilon


# Each member's rule as (its task vector, its model's parameters, rescale, the generator, the tensor's name) ->
# the sparsified task vector (possibly written over the given one, which is the merge's own scratch).
Sparsifier = Callable[[torch.Tensor, dict, bool, "torch.Generator | None", str], torch.Tensor]


def _keep_all(delta, params, rescale, generator, name):
    return delta


def _trim(delta, params, rescale, generator, name):
    return magnitude(delta, float(params["density"]), rescale, in_place=True)


def _drop(delta, params, rescale, generator, name):
    if float(params["density"]) >= 1:
        return delta
    return random_drop(delta, float(params["density"]), require_generator(generator, "dare", name), rescale)


def _breadcrumbs(delta, params, rescale, generator, name):
    return magnitude_outliers(delta, float(params["density"]), float(params["gamma"]), rescale, in_place=True)


def _magprune(delta, params, rescale, generator, name):
    density = float(params["density"])
    if 0 < density < 1:  # outside (0, 1) nothing is drawn
        generator = require_generator(generator, "della", name)
    return della_magprune(delta, density, float(params["epsilon"]), generator, rescale)


def _trim_window(params: dict, n: int) -> Selection:
    return magnitude_window(n, float(params["density"]))


def _breadcrumbs_window(params: dict, n: int) -> Selection:
    return outliers_window(n, float(params["density"]), float(params["gamma"]))


def _della_params_problem(params: dict) -> str | None:
    """DELLA's density +/- epsilon, checked at plan time (the base model has neither)."""
    if "density" not in params or "epsilon" not in params:
        return None
    try:
        density, epsilon = float(params["density"]), float(params["epsilon"])
    except (TypeError, ValueError):
        return None  # not numbers: each parameter's own check says so
    return della_problem(density, epsilon)


# The same draws from the keyed stream, by entry position (keyed_merge.py): model params -> DELLA's epsilon, or
# None for DARE's uniform drop.
KeyedMask = Callable[[dict], "float | None"]


def _dare_keyed(params):
    return None


def _della_keyed(params):
    density, epsilon = float(params["density"]), float(params["epsilon"])
    problem = della_problem(density, epsilon)
    if problem:
        raise ValueError(f"della: {problem}")
    return epsilon


# ----- the procedure ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TaskVectorMethod:
    """One member of the family: its sparsification rule, whether it elects signs, and its default switches.

    `window` (TIES, Breadcrumbs) is the rule as a selection of the magnitude sort, which the row-block path
    makes over the whole tensor first; `keyed` (DARE, DELLA) the rule as draws from the keyed stream, which a
    seeded merge uses. `memory` is the measured working memory (see WorkingMemory)."""

    name: str
    description: str
    sparsify: Sparsifier
    elects_sign: bool
    normalize: bool
    rescale: bool
    memory: WorkingMemory
    extra_model_params: tuple[ParamSpec, ...] = ()
    randomized: bool = False
    window: Callable[[dict, int], Selection] | None = None
    keyed: KeyedMask | None = None
    model_params_problem: Callable[[dict], str | None] | None = None

    def merge(self, inputs: MergeInputs) -> torch.Tensor:
        """base + lambda * mix(sparsified task vectors), for one tensor or one row block of it."""
        if inputs.stream is not None and self.keyed is not None:
            return self._merge_keyed(inputs)
        check_same_shape(inputs, self.name)
        base_index = require_base(inputs, self.name)
        base = inputs.tensors[base_index]
        others = inputs.others()
        if not others:
            return base
        if isinstance(inputs.totals, magnitude_blocks.Selected):  # one row block of a ranked tensor
            return self._mix(inputs, base, magnitude_blocks.sparsified(inputs, inputs.totals))
        rescale = as_bool(inputs.params["rescale"], "rescale")
        deltas = base.new_empty((len(others), *base.shape))
        for row, i in enumerate(others):
            delta = deltas[row]
            bf16_mix.subtract(inputs.tensors[i], base, delta)  # no tensor-sized temporary for the difference
            inputs.done_with(i)
            kept = self.sparsify(delta, inputs.model_params[i], rescale, inputs.generator, inputs.tensor_name)
            if kept is not delta:  # without sparsification the difference is already in place
                delta.copy_(kept)
        return self._mix(inputs, base, deltas)

    def _consensus(self, params: dict) -> str | None:
        """The sign-election rule of a method that elects signs (`consensus_method`), None for the others."""
        if not self.elects_sign:
            return None
        consensus = str(params.get("consensus_method", "sum"))
        if consensus not in CONSENSUS_METHODS:
            raise ValueError(
                f"{self.name}: `consensus_method` must be one of {', '.join(CONSENSUS_METHODS)}, got {consensus!r}"
            )
        return consensus

    def _mix(self, inputs: MergeInputs, base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        params = inputs.params
        return task_vector_mix.merge_task_vectors(
            base,
            deltas,
            [float(inputs.model_params[i]["weight"]) for i in inputs.others()],
            consensus=self._consensus(params),
            normalize=as_bool(params["normalize"], "normalize"),
            lam=float(params["lambda"]),
            int8_mask=as_bool(params["int8_mask"], "int8_mask"),
        )

    def _rescales(self, params: dict) -> bool:
        return as_bool(params.get("rescale", self.rescale), "rescale")

    # ----- a seeded DARE or DELLA: keyed_merge.py's float32 path

    def _keyed_plan(self, inputs: MergeInputs) -> tuple[int, list[keyed_merge.Vector], keyed_merge.Mix]:
        """The base's index, the task vectors and the mix of a keyed merge, from the recipe's parameters."""
        check_same_shape(inputs, self.name)
        base_index = require_base(inputs, self.name)
        params = inputs.params
        consensus = self._consensus(params)
        assert self.keyed is not None
        vectors = []
        for row, i in enumerate(inputs.others()):
            mp = inputs.model_params[i]
            density = float(mp["density"])
            epsilon = self.keyed(mp) if 0 < density < 1 else None
            if self.keyed is _della_keyed and density <= 0:
                epsilon = 0.0  # DELLA with nothing to keep: an all-zero mask, not DARE's draw
            vectors.append(keyed_merge.Vector(i, row, float(mp["weight"]), density, epsilon))
        mix = keyed_merge.Mix(
            consensus,
            as_bool(params["normalize"], "normalize"),
            as_bool(params["rescale"], "rescale"),
            float(params["lambda"]),
        )
        return base_index, vectors, mix

    def _merge_keyed(self, inputs: MergeInputs) -> torch.Tensor:
        """The merge with masks from the keyed stream: whole, or one row block of a tensor whose L1 norms the
        totals pass gathered (`inputs.totals`)."""
        base_index, vectors, mix = self._keyed_plan(inputs)
        if not vectors:
            return inputs.tensors[base_index]
        assert inputs.stream is not None
        out = keyed_merge.merge(inputs.tensors, base_index, vectors, mix, inputs.stream, inputs.offset, inputs.totals)
        for vec in vectors:
            inputs.done_with(vec.index)
        return out

    def _gather_keyed(self, state, inputs: MergeInputs):
        """The totals pass over one row block: per task vector, |delta|_1 and |delta * mask|_1 so far."""
        base_index, vectors, _mix = self._keyed_plan(inputs)
        assert inputs.stream is not None
        state = keyed_merge.gather(state, inputs.tensors, base_index, vectors, inputs.stream, inputs.offset)
        for vec in vectors:
            inputs.done_with(vec.index)
        return state

    # ----- the spec

    def totals(self) -> TotalsPass | None:
        """The first pass that lets a tensor merge in row blocks: TIES' and Breadcrumbs' selection over the
        whole tensor, or DARE's and DELLA's L1 norms (only where they rescale); None for plain task arithmetic,
        which is elementwise."""
        if self.window is not None:
            return magnitude_blocks.totals_pass(self.window, self._rescales)
        if self.keyed is not None:
            return TotalsPass(needed=self._rescales, gather=self._gather_keyed, finish=keyed_merge.finish)
        return None

    def kernel_groups(self, params: dict[str, Any], seeded: bool) -> list[KernelGroup]:
        """The compiled loops a merge by this member uses: a seeded DARE or DELLA keyed_kernels' only; the others
        bf16_mix's and, where they rank magnitudes, introsort_replay's. (Read at call time: tests swap them.)"""
        if seeded and self.keyed is not None:
            return [keyed_kernels.KERNELS]
        if self.window is not None:
            return [bf16_mix.KERNELS, introsort_replay.KERNELS]
        return [bf16_mix.KERNELS]

    def spec(self) -> MethodSpec:
        params = [
            ParamSpec("normalize", self.normalize),
            ParamSpec("rescale", self.rescale),
            ParamSpec("lambda", 1.0),
            ParamSpec("int8_mask", False),
        ]
        if self.elects_sign:
            params.append(ParamSpec("consensus_method", "sum", choices=CONSENSUS_METHODS))
        return MethodSpec(
            name=self.name,
            description=self.description,
            merge=self.merge,
            params=tuple(params),
            model_params=(
                ParamSpec("weight", required=True, non_base=True),
                ParamSpec("density", 1.0, non_base=True),
                *self.extra_model_params,
            ),
            model_params_problem=self.model_params_problem,
            requires_base=True,
            task_vector=True,
            randomized=self.randomized,
            keyed_random=self.keyed is not None,
            # Without sparsification (or consensus, whose votes are per entry) each entry depends only on the
            # same entry of the inputs; sparsifiers rank or rescale over the whole tensor.
            elementwise=self.sparsify is _keep_all,
            totals=self.totals(),
            memory=self.memory,
            warm_up=self.kernel_groups,
        )


# Working memory, measured (tests/test_planner_checks2.py): the task vectors and their weighted copies; sign
# consensus adds a sign tensor and masks, chunk-sized since the mix is chunked (MIX_CHUNK); magnitude ranking
# adds float32 magnitudes and int64 sort indices. DARE and DELLA from the keyed stream (keyed_merge.py): the
# inputs at the compute width, and float32 work buffers (the keep mask among them; numpy arrays on the CPU, counted
# by the test beside torch's allocations), DELLA's sort keys, draws and masks over one chunk of
# keyed_merge.CHUNK_ELEMENTS (in compute-width units).
_SUM = WorkingMemory(per_input=4.5, fixed=1, chunk_elements=MIX_CHUNK)
_CONSENSUS = WorkingMemory(per_input=4.75, fixed=0.5, chunked=(1.0, 2.0), chunk_elements=MIX_CHUNK)
_RANKED = WorkingMemory(per_input=3.0, fixed=1, bytes=32, chunk_elements=MIX_CHUNK)
_KEYED = WorkingMemory(per_input=2.0, fixed=0, chunked=(2.0, 19.0), chunk_elements=keyed_merge.CHUNK_ELEMENTS)

_GAMMA = ParamSpec("gamma", 0.01, non_base=True)
_EPSILON = ParamSpec("epsilon", 0.15, non_base=True)

FAMILY: tuple[TaskVectorMethod, ...] = (
    TaskVectorMethod(
        name="task_arithmetic",
        description="base + weighted sum of task vectors",
        sparsify=_keep_all,
        elects_sign=False,
        normalize=False,
        rescale=False,
        memory=_SUM,
    ),
    TaskVectorMethod(
        name="ties",
        description="TIES: trim by magnitude, elect sign, disjoint mean",
        sparsify=_trim,
        window=_trim_window,
        elects_sign=True,
        normalize=True,
        rescale=False,
        memory=_CONSENSUS,
    ),
    TaskVectorMethod(
        name="dare_linear",
        description="DARE random drop, linear sum",
        sparsify=_drop,
        keyed=_dare_keyed,
        randomized=True,
        elects_sign=False,
        normalize=False,
        rescale=True,
        memory=_KEYED,
    ),
    TaskVectorMethod(
        name="dare_ties",
        description="DARE random drop, TIES sign",
        sparsify=_drop,
        keyed=_dare_keyed,
        randomized=True,
        elects_sign=True,
        normalize=False,
        rescale=True,
        memory=_KEYED,
    ),
    TaskVectorMethod(
        name="breadcrumbs",
        description="drop small and outlier task entries",
        sparsify=_breadcrumbs,
        window=_breadcrumbs_window,
        extra_model_params=(_GAMMA,),
        elects_sign=False,
        normalize=False,
        rescale=False,
        memory=_RANKED,
    ),
    TaskVectorMethod(
        name="breadcrumbs_ties",
        description="breadcrumbs with TIES sign",
        sparsify=_breadcrumbs,
        window=_breadcrumbs_window,
        extra_model_params=(_GAMMA,),
        elects_sign=True,
        normalize=False,
        rescale=False,
        memory=_CONSENSUS,
    ),
    TaskVectorMethod(
        name="della",
        description="DELLA MagPrune, TIES sign",
        sparsify=_magprune,
        keyed=_della_keyed,
        randomized=True,
        extra_model_params=(_EPSILON,),
        model_params_problem=_della_params_problem,
        elects_sign=True,
        normalize=True,
        rescale=True,
        memory=_KEYED,
    ),
    TaskVectorMethod(
        name="della_linear",
        description="DELLA, linear sum",
        sparsify=_magprune,
        keyed=_della_keyed,
        randomized=True,
        extra_model_params=(_EPSILON,),
        model_params_problem=_della_params_problem,
        elects_sign=False,
        normalize=False,
        rescale=True,
        memory=_KEYED,
    ),
)

METHODS = tuple(member.spec() for member in FAMILY)
