"""Consensus merging with TALL masks: `consensus_ta` and `consensus_ties`.

Wang et al. 2024, "Localizing Task Information for Improved Model Merging and Compression" (ICML 2024,
arXiv:2405.07813). With task vectors tau_t = x_t - base and tau_MTL the merged multi-task vector (task
arithmetic's weighted sum for `consensus_ta`, the TIES merge for `consensus_ties`; task_arithmetic.py's
procedure, reused here), each task's TALL mask keeps the entries where that task's own vector outweighs what
the others add to it:

    m_t = 1{ |tau_t| > lambda_t * |tau_MTL - tau_t| }

An entry is kept when at least k tasks' masks keep it (the consensus mask), and the merge is restricted to it:

    out = base + 1{ sum_t m_t >= k } * tau_MTL

The paper writes the mask with >=; its authors' code, FusionBench and mergekit use >, which differs only where
both sides are equal (an entry no task changed: tau_MTL is 0 there either way). mergekit's form is kept, so
that old configs give what they gave.

mergekit had these two methods (its #441, removed in #505); configs written for them run here unchanged, with
its names and defaults: per model `weight` (required), `density` (1; consensus_ties trims each task vector to
it as TIES does, consensus_ta ignores it), `k` (1: the union of the masks; the paper recommends 2) and `lambda`
(1.0, the mask's lambda_t, a per-model parameter here as there, not task arithmetic's scale); merge-wide
`normalize` (off for consensus_ta, on for consensus_ties), `rescale` (off), `int8_mask`, and for
consensus_ties `consensus_method` (mergekit used `sum`). As in mergekit, tau_MTL is the weighted (and, with
`normalize`, divided) mix, the masks compare it with each model's untrimmed, unweighted task vector, and `k`
is read from the first model that has a task vector. The paper's tau_MTL is the plain sum: all weights 1.

Computed in float32 (float64 stays float64); every step is per entry except TIES' trim, so `consensus_ta` is
elementwise and merges huge tensors in row blocks.
"""

from __future__ import annotations

import torch

from ..kernels.task_vector_mix import CONSENSUS_METHODS, MIX_CHUNK, merge_task_vectors
from .common import as_bool, stacked_task_vectors
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory, at_least
from .task_arithmetic import magnitude


def tall_masks(deltas: torch.Tensor, mixed: torch.Tensor, lambdas: list[float]) -> torch.Tensor:
    """The TALL masks m_t = |tau_t| > lambda_t |tau_MTL - tau_t| of stacked task vectors `deltas` ([T, ...])."""
    lam = torch.tensor(lambdas, dtype=deltas.dtype, device=deltas.device).view(-1, *([1] * mixed.dim()))
    return deltas.abs() > lam * (mixed.unsqueeze(0) - deltas).abs()


def consensus_merge(
    base: torch.Tensor,
    deltas: torch.Tensor,
    model_params: list[dict],
    params: dict,
    ties: bool,
) -> torch.Tensor:
    """base + consensus mask * tau_MTL, in the dtype of `deltas` (the stacked raw task vectors)."""
    weights = [float(p["weight"]) for p in model_params]
    if ties:
        rescale = as_bool(params["rescale"], "rescale")
        kept = torch.stack([magnitude(d, float(p["density"]), rescale) for d, p in zip(deltas, model_params)])
        consensus = str(params.get("consensus_method", "sum"))
    else:
        kept, consensus = deltas, None
    # task_arithmetic.py's mix over a zero base is the multi-task vector itself
    mixed = merge_task_vectors(
        torch.zeros_like(base),
        kept,
        weights,
        consensus=consensus,
        normalize=as_bool(params["normalize"], "normalize"),
        int8_mask=as_bool(params["int8_mask"], "int8_mask"),
    )
    del kept
    votes = tall_masks(deltas, mixed, [float(p["lambda"]) for p in model_params]).sum(dim=0)
    return base + mixed * (votes >= int(model_params[0]["k"]))


def _merger(ties: bool):
    name = "consensus_ties" if ties else "consensus_ta"

    def merge(inputs: MergeInputs) -> torch.Tensor:
        tv = stacked_task_vectors(inputs, name)
        if not tv.others:
            return tv.base
        out = consensus_merge(tv.wide, tv.deltas, [inputs.model_params[i] for i in tv.others], inputs.params, ties)
        return out.to(tv.base.dtype)

    return merge


def _spec(ties: bool) -> MethodSpec:
    params = [
        ParamSpec("normalize", ties),
        ParamSpec("rescale", False),
        ParamSpec("int8_mask", False),
    ]
    if ties:
        params.append(ParamSpec("consensus_method", "sum", choices=CONSENSUS_METHODS))
    return MethodSpec(
        name="consensus_ties" if ties else "consensus_ta",
        description=(
            "TALL-mask consensus over TIES: keep entries at least k tasks' masks keep"
            if ties
            else "TALL-mask consensus over task arithmetic: keep entries at least k tasks' masks keep"
        ),
        merge=_merger(ties),
        params=tuple(params),
        model_params=(
            ParamSpec("weight", required=True, non_base=True),
            ParamSpec("density", 1.0, non_base=True),
            ParamSpec("k", 1, non_base=True, check=at_least(0, integer=True)),
            ParamSpec("lambda", 1.0, non_base=True, check=at_least(0)),
        ),
        requires_base=True,
        task_vector=True,
        # TALL masks and votes are per entry; TIES' trim ranks magnitudes over the whole tensor
        elementwise=not ties,
        # the inputs, the raw task vectors (and TIES' trimmed copies with their sort), the mix's chunked
        # temporaries, the multi-task vector, the masks and votes
        memory=WorkingMemory(
            work_size=4,
            per_input=4.0 if ties else 3.0, fixed=4, bytes=16 if ties else 2, chunked=(2.0, 2.0),
            chunk_elements=MIX_CHUNK,
        ),
    )


METHODS = (_spec(ties=False), _spec(ties=True))
