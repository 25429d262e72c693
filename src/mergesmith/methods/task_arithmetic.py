"""The task-vector family: task arithmetic, TIES, DARE, DELLA and Model Breadcrumbs as one procedure.

Ilharco et al. 2023, "Editing Models with Task Arithmetic" (arXiv:2212.04089): a fine-tuned model x_i
differs from its base by a task vector d_i = x_i - base, and task vectors add:

    out = base + lambda * sum_i w_i d_i / Z            (Z = sum_i w_i with `normalize`, else 1)

The later papers change two steps of this sum, and mergekit 0.1.5 implements them all as one
procedure, reproduced here:

1. sparsify each task vector (see sparsify.py): `magnitude` trimming (TIES, arXiv:2306.01708), random drop
   (DARE, arXiv:2311.03099), rank-dependent random drop (DELLA, arXiv:2406.11617) or magnitude outlier
   removal (Breadcrumbs, arXiv:2312.06795), each keeping about `density` of the entries, optionally
   rescaled to keep the vector's L1 norm (`rescale`);
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import bf16_mix
from ..kernels.compiled import CONSENSUS_CODES
from . import keyed_merge, magnitude_blocks, sparsify
from .common import as_bool, check_same_shape, require_base, require_generator
from .registry import MergeInputs, MethodSpec, ParamSpec, TotalsPass, register

CONSENSUS_METHODS = ("sum", "count")


def sign_consensus_mask(deltas: torch.Tensor, method: str = "sum", int8: bool = False) -> torch.Tensor:
    """Boolean mask over stacked (weighted) deltas: True where an entry has the elected majority sign.

    The majority sign of a position is + when the sum (or the count of signs) over models is >= 0, else -.
    An entry that is exactly zero never matches either sign.
    """
    sign = deltas.sign().to(torch.int8 if int8 else deltas.dtype)
    if method == "sum":
        votes = deltas.sum(dim=0)
    elif method == "count":
        votes = sign.sum(dim=0)
    else:
        raise ValueError(f"consensus_method must be one of {', '.join(CONSENSUS_METHODS)}, got {method!r}")
    majority = (votes >= 0).to(sign.dtype) * 2 - 1
    return sign == majority


MIX_CHUNK = 1 << 22
"""Entries mixed at a time: the mix is elementwise across models, so large tensors are mixed in chunks and its
half-dozen temporaries (weighted copies, signs, votes, masks) stay a few chunks big instead of tensor-sized."""


def merge_task_vectors(
    base: torch.Tensor,
    deltas: torch.Tensor,
    weights: Sequence[float],
    *,
    consensus: str | None,
    normalize: bool,
    lam: float = 1.0,
    int8_mask: bool = False,
) -> torch.Tensor:
    """base + lambda * mix of the stacked, already sparsified task vectors `deltas` (shape [n, *base.shape])."""
    options = dict(consensus=consensus, normalize=normalize, lam=lam, int8_mask=int8_mask)
    n = base.numel()
    if n <= MIX_CHUNK:
        return _mix(base, deltas, weights, **options)
    out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
    flat_out, flat_base, flat_deltas = out.view(-1), base.reshape(-1), deltas.reshape(deltas.shape[0], -1)
    for start in range(0, n, MIX_CHUNK):
        end = min(n, start + MIX_CHUNK)
        flat_out[start:end] = _mix(flat_base[start:end], flat_deltas[:, start:end], weights, **options)
    return out


def _mix(
    base: torch.Tensor,
    deltas: torch.Tensor,
    weights: Sequence[float],
    *,
    consensus: str | None,
    normalize: bool,
    lam: float,
    int8_mask: bool,
) -> torch.Tensor:
    """merge_task_vectors on one chunk (or a whole small tensor)."""
    if _compiled_mix_applies(base, deltas, consensus):
        return _compiled_mix(base, deltas, weights, consensus, normalize, lam)
    w = torch.tensor(list(weights), dtype=deltas.dtype, device=deltas.device)
    w = w.view(-1, *([1] * base.dim()))
    weighted = deltas * w
    if consensus is not None:
        # The boolean mask as 0/1 in the delta's dtype: the same products as torch's bool promotion, but two
        # same-dtype multiplications run ~10x faster than the mixed-dtype ones (measured in bench/README.md).
        mask = sign_consensus_mask(weighted, consensus, int8_mask).to(weighted.dtype)
        mixed = (weighted * mask).sum(dim=0)
        divisor = (w * mask).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = weighted.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed = mixed / divisor
    if lam != 1:
        mixed = mixed * lam
    return (base + mixed).to(base.dtype)


COMPILED_MIX = bf16_mix.AVAILABLE
"""bfloat16 mixes on the CPU by bf16_mix's compiled loop (the same bytes; tests switch it off to compare)."""


def _compiled_mix_applies(base: torch.Tensor, deltas: torch.Tensor, consensus: str | None) -> bool:
    return (
        COMPILED_MIX
        and base.device.type == "cpu"
        and base.dtype == deltas.dtype == torch.bfloat16
        and consensus in CONSENSUS_CODES
        and bf16_mix.KERNELS.ready(base.numel())
    )


def _compiled_mix(
    base: torch.Tensor, deltas: torch.Tensor, weights: Sequence[float], consensus: str | None, normalize: bool,
    lam: float,
) -> torch.Tensor:
    out = torch.empty(base.shape, dtype=base.dtype)
    rounded = torch.tensor(list(weights), dtype=torch.bfloat16).float().numpy()
    bf16_mix.mix(
        bf16_mix.bits_of(base.reshape(-1)),
        bf16_mix.bits_of(deltas.reshape(deltas.shape[0], -1)),
        rounded,
        CONSENSUS_CODES[consensus],
        normalize,
        np.float32(lam),
        lam != 1,
        bf16_mix.bits_of(out.view(-1)),
    )
    return out


Sparsifier = Callable[[torch.Tensor, dict, bool, "torch.Generator | None", str], torch.Tensor]


def _no_sparsify(delta, params, rescale, generator, name):
    return delta


def _magnitude(delta, params, rescale, generator, name):
    return sparsify.magnitude(delta, float(params["density"]), rescale, in_place=True)  # delta: the merge's scratch


def _random(delta, params, rescale, generator, name):
    if float(params["density"]) >= 1:
        return delta
    return sparsify.random_drop(delta, float(params["density"]), require_generator(generator, "dare", name), rescale)


def _outliers(delta, params, rescale, generator, name):
    return sparsify.magnitude_outliers(
        delta, float(params["density"]), float(params["gamma"]), rescale, in_place=True
    )


def _della_params_problem(params: dict) -> str | None:
    """DELLA's density +/- epsilon, checked at plan time (the base model has neither)."""
    if "density" not in params or "epsilon" not in params:
        return None
    try:
        density, epsilon = float(params["density"]), float(params["epsilon"])
    except (TypeError, ValueError):
        return None  # not numbers: each parameter's own check says so
    return sparsify.della_problem(density, epsilon)


def _della(delta, params, rescale, generator, name):
    density = float(params["density"])
    if 0 < density < 1:  # outside (0, 1) nothing is drawn
        generator = require_generator(generator, "della", name)
    return sparsify.della_magprune(delta, density, float(params["epsilon"]), generator, rescale)


KeyedMask = Callable[[dict], "float | None"]
"""Marks a member as drawing from the keyed stream (keyed_merge.py computes it): model params -> DELLA's
epsilon, or None for DARE's uniform drop."""


def _dare_keyed(params):
    return None


def _della_keyed(params):
    density, epsilon = float(params["density"]), float(params["epsilon"])
    problem = sparsify.della_problem(density, epsilon)
    if problem:
        raise ValueError(f"della: {problem}")
    return epsilon


@dataclass(frozen=True)
class _Family:
    """One member of the family: which sparsifier, whether sign consensus, and default switches."""

    name: str
    sparsifier: Sparsifier
    consensus: bool
    normalize: bool
    rescale: bool
    extra_model_params: tuple[ParamSpec, ...] = ()
    randomized: bool = False
    description: str = ""
    # working memory (see MethodSpec): whole tensor (per input, fixed, dtype-independent bytes) and one mix chunk
    memory: tuple[tuple[float, float, int], tuple[float, float]] = ((4.5, 1, 0), (0.0, 0.0))
    model_params_problem: Callable[[dict], str | None] | None = None
    keyed: KeyedMask | None = None

    def merge(self, inputs: MergeInputs) -> torch.Tensor:
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
        params = inputs.params
        rescale = as_bool(params["rescale"], "rescale")
        deltas = base.new_empty((len(others), *base.shape))
        for row, i in enumerate(others):
            delta = deltas[row]
            bf16_mix.subtract(inputs.tensors[i], base, delta)  # no tensor-sized temporary for the difference
            inputs.done_with(i)
            kept = self.sparsifier(delta, inputs.model_params[i], rescale, inputs.generator, inputs.tensor_name)
            if kept is not delta:  # without sparsification the difference is already in place
                delta.copy_(kept)
        return self._mix(inputs, base, deltas)

    def _consensus(self, params: dict) -> str | None:
        """The sign-election rule of a method that elects signs (`consensus_method`), None for the others."""
        if not self.consensus:
            return None
        consensus = str(params.get("consensus_method", "sum"))
        if consensus not in CONSENSUS_METHODS:
            raise ValueError(
                f"{self.name}: `consensus_method` must be one of {', '.join(CONSENSUS_METHODS)}, got {consensus!r}"
            )
        return consensus

    def _mix(self, inputs: MergeInputs, base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        params = inputs.params
        consensus = self._consensus(params)
        return merge_task_vectors(
            base,
            deltas,
            [float(inputs.model_params[i]["weight"]) for i in inputs.others()],
            consensus=consensus,
            normalize=as_bool(params["normalize"], "normalize"),
            lam=float(params["lambda"]),
            int8_mask=as_bool(params["int8_mask"], "int8_mask"),
        )

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
        """The merge with masks from the keyed stream, in float32 (keyed_merge.py): whole, or one row block of a
        tensor whose L1 norms the totals pass gathered (`inputs.totals`)."""
        base_index, vectors, mix = self._keyed_plan(inputs)
        if not vectors:
            return inputs.tensors[base_index]
        assert inputs.stream is not None
        out = keyed_merge.merge(inputs.tensors, base_index, vectors, mix, inputs.stream, inputs.offset, inputs.totals)
        for vec in vectors:
            inputs.done_with(vec.index)
        return out

    def gather_totals(self, state, inputs: MergeInputs):
        """The totals pass over one row block: per task vector, |delta|_1 and |delta * mask|_1 so far."""
        base_index, vectors, _mix = self._keyed_plan(inputs)
        assert inputs.stream is not None
        state = keyed_merge.gather(state, inputs.tensors, base_index, vectors, inputs.stream, inputs.offset)
        for vec in vectors:
            inputs.done_with(vec.index)
        return state

    @staticmethod
    def finish_totals(state):
        return keyed_merge.finish(state)

    def spec(self) -> MethodSpec:
        params = [
            ParamSpec("normalize", self.normalize),
            ParamSpec("rescale", self.rescale),
            ParamSpec("lambda", 1.0),
            ParamSpec("int8_mask", False),
        ]
        if self.consensus:
            params.append(ParamSpec("consensus_method", "sum", choices=("sum", "count")))
        return MethodSpec(
            name=self.name,
            merge=self.merge,
            params=tuple(params),
            model_params=(
                ParamSpec("weight", required=True, non_base=True),
                ParamSpec("density", 1.0, non_base=True),
                *self.extra_model_params,
            ),
            requires_base=True,
            min_models=1,
            randomized=self.randomized,
            # Without sparsification (or consensus, whose votes are per entry) each entry depends only on the
            # same entry of the inputs; sparsifiers rank or rescale over the whole tensor.
            elementwise=self.sparsifier is _no_sparsify,
            description=self.description,
            memory_per_input=self.memory[0][0],
            memory_fixed=self.memory[0][1],
            memory_bytes=self.memory[0][2],
            memory_chunked=self.memory[1],
            memory_chunk_elements=keyed_merge.CHUNK_ELEMENTS if self.keyed is not None else MIX_CHUNK,
            model_params_problem=self.model_params_problem,
            keyed_random=self.keyed is not None,
            totals=_RANKED_TOTALS[self.sparsifier](self.rescale)
            if self.sparsifier in _RANKED_TOTALS
            else None
            if self.keyed is None
            else TotalsPass(
                needed=lambda params: as_bool(params.get("rescale", self.rescale), "rescale"),
                gather=self.gather_totals,
                finish=self.finish_totals,
            ),
        )


# TIES and Breadcrumbs rank whole task vectors; in row blocks a totals pass makes that selection (magnitude_blocks.py)
_RANKED_TOTALS: dict[Sparsifier, Callable[[bool], TotalsPass]] = {
    _magnitude: lambda rescale: magnitude_blocks.totals_pass(
        lambda params, n: sparsify.magnitude_window(n, float(params["density"])), rescale
    ),
    _outliers: lambda rescale: magnitude_blocks.totals_pass(
        lambda params, n: sparsify.outliers_window(n, float(params["density"]), float(params["gamma"])), rescale
    ),
}

_GAMMA = ParamSpec("gamma", 0.01, non_base=True)
_EPSILON = ParamSpec("epsilon", 0.15, non_base=True)

# Working memory, measured (see MethodSpec; tests/test_planner_checks2.py) as (per input, fixed, bytes) over
# the whole tensor and (per input, fixed) over one mix chunk: the task vectors and their weighted copies; sign
# consensus adds a sign tensor and masks, chunk-sized since the mix is chunked (MIX_CHUNK); magnitude ranking
# adds float32 magnitudes and int64 sort indices; DELLA's rank-dependent draw holds those for the whole tensor.
_SUM = ((4.5, 1, 0), (0.0, 0.0))
_CONSENSUS = ((4.75, 0.5, 0), (1.0, 2.0))
_DELLA = ((4.0, 0.5, 28), (0.0, 0.0))
_RANKED = ((3.0, 1, 32), (0.0, 0.0))
# DARE and DELLA from the keyed stream (keyed_merge.py): the inputs at the compute width, and float32 work buffers
# (the keep mask among them), DELLA's sort keys, draws and masks over one chunk of keyed_merge.CHUNK_ELEMENTS (in
# compute-width units).
_KEYED = ((2.0, 0, 0), (2.0, 18.0))

FAMILY: tuple[_Family, ...] = (
    _Family(
        "task_arithmetic",
        _no_sparsify,
        False,
        False,
        False,
        description="base + weighted sum of task vectors",
        memory=_SUM,
    ),
    _Family(
        "ties",
        _magnitude,
        True,
        True,
        False,
        description="TIES: trim by magnitude, elect sign, disjoint mean",
        memory=_CONSENSUS,
    ),
    _Family(
        "dare_linear",
        _random,
        False,
        False,
        True,
        randomized=True,
        keyed=_dare_keyed,
        description="DARE random drop, linear sum",
        memory=_KEYED,
    ),
    _Family(
        "dare_ties",
        _random,
        True,
        False,
        True,
        randomized=True,
        keyed=_dare_keyed,
        description="DARE random drop, TIES sign",
        memory=_KEYED,
    ),
    _Family(
        "breadcrumbs",
        _outliers,
        False,
        False,
        False,
        (_GAMMA,),
        description="drop small and outlier task entries",
        memory=_RANKED,
    ),
    _Family(
        "breadcrumbs_ties",
        _outliers,
        True,
        False,
        False,
        (_GAMMA,),
        description="breadcrumbs with TIES sign",
        memory=_CONSENSUS,
    ),
    _Family(
        "della",
        _della,
        True,
        True,
        True,
        (_EPSILON,),
        randomized=True,
        keyed=_della_keyed,
        description="DELLA MagPrune, TIES sign",
        memory=_KEYED,
        model_params_problem=_della_params_problem,
    ),
    _Family(
        "della_linear",
        _della,
        False,
        False,
        True,
        (_EPSILON,),
        randomized=True,
        keyed=_della_keyed,
        description="DELLA, linear sum",
        memory=_KEYED,
        model_params_problem=_della_params_problem,
    ),
)

for _member in FAMILY:
    register(_member.spec())

RANKED = frozenset(member.name for member in FAMILY if member.sparsifier in (_magnitude, _outliers))
"""Members that rank task vectors' magnitudes (sort_select's replay: introsort_replay's compiled loop)."""

KEYED = frozenset(member.name for member in FAMILY if member.keyed is not None)
"""Members that, given a seed, merge by keyed_merge's path (keyed_kernels' loops) rather than the mix here."""
