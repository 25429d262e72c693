"""PCB merging: Parameter Competition Balancing.

Du et al. 2024, "Parameter Competition Balancing for Model Merging" (NeurIPS 2024, arXiv:2410.02396). With
task vectors tau_i = x_i - base (i = 1..N) of D entries each, a balancing score per entry of each task:

    intra-balancing  b_intra,i = Softmax(N * Norm(tau_i * tau_i))           (importance within the task)
    inter-balancing  b_inter,i = sum_j Softmax(Norm(tau_i * tau_j))         (agreement with every task, i too)
                     b_i = b_intra,i * b_inter,i

Norm is min-max normalisation to [0, 1] and Softmax runs over the task's D entries (products elementwise).
Drop: each task keeps its max(1, floor(pcb_ratio * D)) highest scores, m_i; rescale and merge:

    b^_i = m_i * b_i,     tau_m = sum_i w_i b^_i tau_i / sum_i b^_i      (0 where no task kept the entry)
    out = base + tau_m

`pcb_ratio` (the authors' and FusionBench's name) is the fraction of each task vector kept, as in the authors'
code, whose default 0.1 is used here (their vision script uses 0.05). The per-model `weight` w_i is the
authors' per-task lambda_i, which their code multiplies into each task vector before the balanced mean (they
search it in [0.8, 1.3] from 1.0; default 1 here, scores taken on the unweighted task vectors).

Choices the paper leaves, settled as the authors' code settles them: Norm is min-max (a constant vector
normalises to zeros here, where their code divides by zero). Where the authors' code departs from the paper
it is not followed: it computes the inter term as tanh(tau_i * sum_j tau_j) and weights by min-max
normalised clamped scores, and it clips every task vector's top and bottom 0.01% of magnitudes first; this is
the paper's equations. Scores are taken per tensor (the authors flatten the whole model into one vector;
mergesmith merges tensor by tensor), for every tensor, norms and embeddings too.

Not elementwise: softmax, min-max and the top-k run over the whole tensor. Computed in float32 (float64 stays
float64); the scores of one task are built at a time.
"""

from __future__ import annotations

import torch

from .common import stacked_task_vectors
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory, fraction


def min_max(x: torch.Tensor) -> torch.Tensor:
    """(x - min) / (max - min) over the whole tensor; zeros where x is constant."""
    low, high = x.min(), x.max()
    span = high - low
    if span <= 0:
        return torch.zeros_like(x)
    return (x - low) / span


def softmax_all(x: torch.Tensor) -> torch.Tensor:
    """Softmax over every entry of x (one distribution over the tensor)."""
    return torch.softmax(x.reshape(-1), dim=0).view(x.shape)


def balancing_scores(deltas: torch.Tensor) -> torch.Tensor:
    """b_i = Softmax(N Norm(tau_i^2)) * sum_j Softmax(Norm(tau_i tau_j)) for stacked task vectors [N, ...]."""
    n = deltas.shape[0]
    scores = torch.empty_like(deltas)
    for i in range(n):
        inter = torch.zeros_like(deltas[i])
        for j in range(n):
            inter += softmax_all(min_max(deltas[i] * deltas[j]))
        scores[i] = softmax_all(n * min_max(deltas[i] * deltas[i])) * inter
    return scores


def keep_top(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """The scores with all but each row's max(1, floor(ratio * D)) largest set to 0 (rows along dim 0)."""
    flat = scores.reshape(scores.shape[0], -1)
    count = flat.shape[1]
    keep = count if ratio >= 1 else max(1, int(ratio * count))
    if keep >= count:
        return scores
    kept = torch.zeros_like(flat)
    for row in range(flat.shape[0]):
        top = torch.topk(flat[row], keep, sorted=False)
        kept[row].index_copy_(0, top.indices, top.values)
    return kept.view(scores.shape)


def pcb_merge(base: torch.Tensor, deltas: torch.Tensor, weights: list[float], ratio: float) -> torch.Tensor:
    """base + sum_i w_i b^_i tau_i / sum_i b^_i, in the dtype of `deltas`."""
    kept = keep_top(balancing_scores(deltas), ratio)
    total = kept.sum(dim=0)
    w = torch.tensor(weights, dtype=deltas.dtype, device=deltas.device).view(-1, *([1] * base.dim()))
    mixed = (kept * w * deltas).sum(dim=0)
    return base + torch.where(total > 0, mixed / torch.where(total > 0, total, 1), 0)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    tv = stacked_task_vectors(inputs, "pcb")
    if not tv.others or tv.base.numel() == 0:
        return tv.base
    weights = [float(inputs.model_params[i]["weight"]) for i in tv.others]
    return pcb_merge(tv.wide, tv.deltas, weights, float(inputs.params["pcb_ratio"])).to(tv.base.dtype)


METHODS = (
    MethodSpec(
        name="pcb",
        description="PCB: intra- and inter-task balancing scores, drop the low ones, balanced mean",
        merge=_merge,
        params=(ParamSpec("pcb_ratio", 0.1, check=fraction),),
        model_params=(ParamSpec("weight", 1.0, non_base=True),),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        # the inputs, the task vectors, their scores and kept scores; one task's softmax temporaries, the
        # top-k's values and int64 indices, the weighted products of the mix
        memory=WorkingMemory(work_size=4, per_input=5.0, fixed=6, bytes=12),
    ),
)
