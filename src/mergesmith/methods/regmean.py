"""RegMean: merging linear layers by regression on their inputs (Jin et al., ICLR 2023, "Dataless knowledge fusion
by merging weights of language models").

For a linear layer y = W x (W: out x in) and models i = 1..N, each with the inputs X_i (tokens x in) its own layer
saw on some data, RegMean picks the W* that minimises sum_i |X_i W*^T - X_i W_i^T|^2, whose closed form is

    W*^T = (sum_i G_i)^-1  sum_i G_i W_i^T,        G_i = X_i^T X_i  (in x in, the inputs' Gram matrix)

The paper regularises the Grams by shrinking their off-diagonal entries by a factor alpha in [0, 1]:

    G_i' = alpha * G_i + (1 - alpha) * diag(G_i)

(alpha = 1: plain RegMean; alpha = 0: each input feature weighted by its energy, no cross terms). The parameter is
`reduce_non_diagonal_ratio`, FusionBench's name; its default 0.6 is FusionBench's configs' (the paper tunes alpha
per task). The Grams are averaged over the tokens (X^T X / tokens), as FusionBench's reference implementation
does, so each model's data counts equally whatever its token count.

Every other tensor (embeddings, norms, biases, tensors no linear layer's Gram was collected for) is the simple
average of the models' tensors: the paper's rule and its reference implementation's. Every contributing model
takes part equally (the paper has no per-model weight).

How the Grams arrive: the planner's regmean step (mergesmith.regmean, a feature) collects them by running each
model on a calibration text before the merge, and appends each model's Gram of a linear weight's inputs to that
recipe as extra inputs: `tensors` holds the N weights, then the N Grams in the same model order, and the recipe's
`regmean_grams` parameter is true. The system is solved in float32 (float64 inputs stay float64) by an LU
solve; a singular sum (an input feature no model ever saw) falls back to the least-squares solution
(minimum norm), which leaves such features' columns at zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.devices import min_norm_lstsq
from .common import as_bool, check_same_shape, work_dtype
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory

GRAMS_PARAM = "regmean_grams"
"""The recipe parameter the regmean step sets on recipes whose inputs end with the models' Grams."""


def reduce_non_diagonal(gram: torch.Tensor, ratio: float) -> torch.Tensor:
    """G' = ratio * G off the diagonal, the diagonal kept (the paper's alpha)."""
    out = gram * ratio
    out.diagonal().copy_(gram.diagonal())
    return out


def regmean_linear(weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor], ratio: float) -> torch.Tensor:
    """W* = ((sum_i G_i')^-1 sum_i G_i' W_i^T)^T for weights (out x in) and Grams (in x in), in the weights' dtype."""
    work = work_dtype(*weights, *grams)
    total: torch.Tensor | None = None
    rhs: torch.Tensor | None = None
    for weight, gram in zip(weights, grams):
        g = reduce_non_diagonal(gram.to(work), ratio)
        term = g @ weight.to(work).T
        total = g if total is None else total.add_(g)
        rhs = term if rhs is None else rhs.add_(term)
    assert total is not None and rhs is not None
    solved, info = torch.linalg.solve_ex(total, rhs)
    if int(info) != 0 or not bool(torch.isfinite(solved).all()):
        solved = min_norm_lstsq(total, rhs)  # a singular Gram: gelsd, also for a merge on CUDA
    return solved.T.contiguous().to(weights[0].dtype)


def simple_average(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    work = work_dtype(*tensors)
    out = torch.zeros_like(tensors[0], dtype=work)
    for tensor in tensors:
        out.add_(tensor.to(work))
    return out.div_(len(tensors)).to(tensors[0].dtype)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    ratio = float(inputs.params["reduce_non_diagonal_ratio"])
    if not as_bool(inputs.params.get(GRAMS_PARAM, False), GRAMS_PARAM):
        check_same_shape(inputs, "regmean")
        return simple_average(inputs.tensors)
    n = len(inputs.tensors) // 2
    weights, grams = list(inputs.tensors[:n]), list(inputs.tensors[n:])
    name = inputs.tensor_name or "<unnamed tensor>"
    shapes = {tuple(w.shape) for w in weights}
    if len(shapes) != 1 or len(weights[0].shape) != 2:
        raise ValueError(f"regmean: tensor {name!r}: the models' weights differ in shape or are not matrices: {shapes}")
    columns = weights[0].shape[1]
    if any(tuple(g.shape) != (columns, columns) for g in grams):
        raise ValueError(f"regmean: tensor {name!r}: a Gram matrix is not {columns}x{columns}")
    return regmean_linear(weights, grams, ratio)


def _memory(n_inputs: int, shape: tuple[int, ...], params: dict[str, Any], compute_size: int) -> int:
    """Peak bytes of one call: the weights and Grams (in the compute dtype), their float32 copies, the running sums
    (in x in and in x out), the solver's copy of the sum, and the transposed result."""
    numel = 1
    for d in shape:
        numel *= d
    if not params.get(GRAMS_PARAM) or len(shape) != 2:
        return numel * compute_size * (n_inputs + 2) + numel * 4 * 2
    n = n_inputs // 2
    rows, cols = shape
    gram = cols * cols
    held = n * (numel + gram) * compute_size
    work = 4 * (3 * gram + 3 * rows * cols)
    return held + work


METHODS = (
    MethodSpec(
        name="regmean",
        description="RegMean: each linear layer solved from its inputs' Gram matrices (collected on a calibration "
        "text), the other tensors averaged",
        merge=_merge,
        params=(
            ParamSpec("reduce_non_diagonal_ratio", 0.6),
            ParamSpec("calibration", ""),
            ParamSpec("num_regmean_examples", 256),
            ParamSpec("max_length", 256),
        ),
        elementwise=False,
        memory=WorkingMemory(per_input=2.0, fixed=4.0),
        shaped_memory=_memory,
    ),
)
