"""MagMax: per entry, the task vector of largest magnitude.

Marczak et al. 2024, "MagMax: Leveraging Model Merging for Seamless Continual Learning" (ECCV 2024,
arXiv:2407.06322). With task vectors tau_t = x_t - base (t = 1..T, in config order):

    tau_max[j] = tau_{t*(j)}[j],   t*(j) = argmax_t |tau_t[j]|
    out = base + scaling_factor * tau_max

Ties go to the later task vector (the authors' code folds the task vectors in order, replacing the running
choice where |tau_t| >= |choice|; FusionBench does the same). `scaling_factor` is FusionBench's name, and its
default 0.5 that of the authors' 8-task reproduction script. Every tensor is merged this way, norms and
embeddings included (as the authors' code does for every floating-point parameter).

Elementwise, so huge tensors merge in row blocks; computed in float32 (float64 stays float64) by a running
fold, so only the running choice and one task vector are held at a time.
"""

from __future__ import annotations

import torch

from .common import check_same_shape, require_base, work_dtype
from .registry import MergeInputs, MethodSpec, ParamSpec, WorkingMemory


def magmax(inputs: MergeInputs) -> torch.Tensor:
    """base + scaling_factor * (per entry, the largest-magnitude task vector; the later one on a tie)."""
    check_same_shape(inputs, "magmax")
    base_index = require_base(inputs, "magmax")
    base = inputs.tensors[base_index]
    others = inputs.others()
    if not others:
        return base
    dtype = work_dtype(*inputs.tensors)
    wide = base.to(dtype)
    chosen = inputs.tensors[others[0]].to(dtype) - wide
    inputs.done_with(others[0])
    for i in others[1:]:
        delta = inputs.tensors[i].to(dtype) - wide
        inputs.done_with(i)
        chosen = torch.where(delta.abs() >= chosen.abs(), delta, chosen)
    return (wide + float(inputs.params["scaling_factor"]) * chosen).to(base.dtype)


METHODS = (
    MethodSpec(
        name="magmax",
        description="MagMax: per entry, the task vector of largest magnitude",
        merge=magmax,
        params=(ParamSpec("scaling_factor", 0.5),),
        requires_base=True,
        task_vector=True,
        elementwise=True,
        # the inputs, the widened base, the running choice, one task vector, two magnitudes and the mask
        memory=WorkingMemory(work_size=4, per_input=1.5, fixed=8, bytes=1),
    ),
)
