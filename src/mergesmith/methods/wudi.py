"""WUDI merging: the merged task vector that interferes least with each task's own inputs.

Cheng et al. 2025, "Whoever Started the Interference Should End It: Guiding Data-Free Model Merging via Task
Vectors" (ICML 2025, arXiv:2503.08099). For a linear layer the rows of a task vector tau_i = x_i - base span
(approximately) the inputs that layer sees on task i, so the interference the merged vector tau_m causes on
task i is measured by (tau_m - tau_i) tau_i^T. Per weight matrix (out x in), WUDI minimises

    L(tau_m) = sum_i || (tau_m - tau_i) tau_i^T ||_F^2 / || tau_i ||_F^2

by `iter_num` steps of Adam (betas 0.9 and 0.999, eps 1e-8, no weight decay) at learning rate `lr` from
tau_m = sum_i tau_i, and returns base + tau_m. Defaults as in the paper's code (and FusionBench's function):
300 steps at lr 1e-5. Tensors that are not matrices (norms, biases) take the mean of the task vectors, as the
authors' code does; so do the vocabulary-indexed matrices (token embeddings and the output head, by name),
which are not layers acting on a task's inputs in that sense, and whose vocabulary-sized side would make the
loss the cost of the whole merge (the LLM merging code built on the paper's also leaves the output head
out). A task vector that is all zeros takes no part in the loss (its term is 0 / 0).

How it is computed: L is quadratic, so its gradient needs no autograd,

    grad = 2 (tau_m A - B),   A = sum_i tau_i^T tau_i / ||tau_i||^2   (in x in),
                              B = sum_i tau_i tau_i^T tau_i / ||tau_i||^2,

A and B fixed before the first step, so a step costs one matrix product: tau_m A (out in^2 multiply-adds)
where that is the cheaper, in <= 2 T out, else (tau_m S^T) S with S the stacked tau_i / ||tau_i||
(2 T out^2 in); A then holds at most 2 T times the matrix's entries. These are the steps of the
paper's autograd loop up to rounding; nothing is random, so a merge is deterministic.

Cost: iterative, `iter_num` such products per matrix: by far the slowest data-free method on a CPU. Measured
on 2 busy cores (3 task vectors, float32): 300 steps on a 2048 x 2048 matrix took ~100 s, so a 1.1 B model
(TinyLlama's shapes) takes hours there; a GPU does the same products in seconds: use `--device cuda` where
there is one. `plan` prices the steps at that measured rate (engine/time_estimate.py). Computed in float32
(float64 stays float64).
"""

from __future__ import annotations

import torch

from .common import stacked_task_vectors
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory, at_least, positive

BETAS = (0.9, 0.999)
EPS = 1e-8

_VOCABULARY_MARKERS = ("embed", "wte", "wpe", "lm_head", "word_embeddings")


def optimised(name: str, shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether WUDI optimises this tensor: a matrix that is not vocabulary-indexed (see the docstring)."""
    lowered = name.lower()
    return len(shape) == 2 and not any(m in lowered for m in _VOCABULARY_MARKERS)


def step_flops(shape: tuple[int, ...], tasks: int) -> int:
    """Floating-point operations of one Adam step's product on a matrix of `shape` (the cheaper form)."""
    out_dim, in_dim = shape
    return 2 * out_dim * in_dim * min(in_dim, 2 * tasks * out_dim)


Factors = tuple["torch.Tensor | None", "torch.Tensor | None", torch.Tensor]


def _factors(deltas: torch.Tensor, norms: torch.Tensor) -> Factors:
    """(A or None, S or None, B) of the stacked nonzero task matrices `deltas` with squared norms `norms`."""
    tasks, out_dim, in_dim = deltas.shape
    scaled = deltas / norms.sqrt().view(-1, 1, 1)
    target = torch.zeros_like(deltas[0])
    gram = None
    for s, d in zip(scaled, deltas):
        if in_dim <= 2 * tasks * out_dim:  # tau_m A costs out in^2, (tau_m S^T) S costs 2 T out^2 in
            part = s.T @ s  # in x in
            gram = part if gram is None else gram.add_(part)
            target.addmm_(d, part)
        else:
            target.addmm_(d @ s.T, s)  # out x out first
    return gram, (None if gram is not None else scaled.flatten(0, 1)), target


def wudi_matrix(deltas: torch.Tensor, iter_num: int, lr: float) -> torch.Tensor:
    """The merged task vector of stacked task matrices `deltas` ([T, out, in]) after `iter_num` Adam steps."""
    norms = deltas.square().sum(dim=(1, 2))
    used = norms > 0
    merged = deltas.sum(dim=0)
    if iter_num == 0 or not bool(used.any()):
        return merged
    gram, stacked, target = _factors(deltas[used], norms[used])
    m = torch.zeros_like(merged)
    v = torch.zeros_like(merged)
    grad = torch.empty_like(merged)
    denom = torch.empty_like(merged)
    beta1, beta2 = BETAS
    for step in range(1, iter_num + 1):
        if gram is not None:
            torch.mm(merged, gram, out=grad)
        else:
            assert stacked is not None
            torch.mm(merged @ stacked.T, stacked, out=grad)
        grad.sub_(target).mul_(2)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # torch.optim.Adam's update: p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
        torch.sqrt(v, out=denom).div_((1 - beta2**step) ** 0.5).add_(EPS)
        merged.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    return merged


def _merge(inputs: MergeInputs) -> torch.Tensor:
    tv = stacked_task_vectors(inputs, "wudi")
    if not tv.others:
        return tv.base
    if optimised(inputs.tensor_name, tv.base.shape):
        merged = wudi_matrix(tv.deltas, int(inputs.params["iter_num"]), float(inputs.params["lr"]))
    else:
        merged = tv.deltas.mean(dim=0)
    return (tv.wide + merged).to(tv.base.dtype)


METHODS = (
    MethodSpec(
        name="wudi",
        description="WUDI: per matrix, Adam on the task vectors' interference loss (iterative: slow on a CPU)",
        merge=_merge,
        params=(
            ParamSpec("iter_num", 300, check=at_least(0, integer=True)),
            ParamSpec("lr", 1e-5, check=positive),
        ),
        requires_base=True,
        task_vector=True,
        elementwise=False,
        # the inputs, the task vectors and their scaled copies, A (at most 2 T matrices) or the T out x out
        # product; the merged vector, Adam's two moments, the gradient and its denominator, B
        memory=WorkingMemory(work_size=4, per_input=5.0, fixed=8),
    ),
)
