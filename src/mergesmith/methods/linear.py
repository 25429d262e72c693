"""Linear (weighted-average) merge: out = sum_i w_i * x_i / sum_i w_i (normalize) or sum_i w_i * x_i.

Wortsman et al. 2022, "Model soups". The sum is accumulated in model order with one `addcmul` per model (a
fused multiply-add, one rounding, where torch's CPU kernels have FMA: AVX2 and up) and divided by the float sum of
the weights, which is also how mergekit 0.1.5 rounds (it calls the same `addcmul`), so outputs are bit-identical to
its: on the reference fixtures, and measured on 1M-entry tensors in float32, in bf16 and with `dtype: bfloat16`
over float32 inputs
(`python tests/reference/measure_differences.py --cases linear`). With `normalize` (default) a zero weight sum
leaves the sum as it is rather than dividing by zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import weighted_sum as compiled_sum
from ..kernels.weighted_sum import weighted_sum
from .common import as_bool, check_same_shape, work_dtype
from .registry import MergeInputs, MethodSpec, ParamSpec


def linear_average(tensors: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool) -> torch.Tensor:
    """Weighted sum of same-shaped tensors, optionally normalised by the sum of weights.

    Accumulates in float32 (float64 for float64 inputs) whatever the inputs' dtype, and returns the
    inputs' dtype: a bf16 merge rounds once, at the end, not after every model. Narrower inputs are
    widened into one reused buffer (exactly the values torch's mixed-dtype addcmul would widen into a
    fresh temporary for each model), so a block allocates three buffers, not one per model more.
    Contiguous bf16 or float32 CPU inputs take a compiled loop with the same bytes (kernels/weighted_sum.py).
    """
    work = work_dtype(*tensors)
    total = torch.tensor(list(weights), dtype=work, device=tensors[0].device).sum() if normalize else None
    divisor = 0.0 if total is None else float(total)  # 0: the sum is left undivided
    if work == torch.float32:
        compiled = weighted_sum(tensors, weights, divisor)
        if compiled is not None:
            return compiled
    out = torch.zeros_like(tensors[0], dtype=work)
    wide: torch.Tensor | None = None
    for tensor, weight in zip(tensors, weights):
        if tensor.dtype != work:
            wide = tensor.to(work) if wide is None else wide.copy_(tensor)
            tensor = wide
        out.addcmul_(tensor, torch.tensor(weight, dtype=work, device=out.device))
    if divisor != 0.0:
        out.div_(total)
    return out.to(tensors[0].dtype)


def _merge(inputs: MergeInputs) -> torch.Tensor:
    check_same_shape(inputs, "linear")
    weights = [float(p["weight"]) for p in inputs.model_params]
    return linear_average(inputs.tensors, weights, as_bool(inputs.params["normalize"], "normalize"))


METHODS = (
    MethodSpec(
        name="linear",
        description="weighted average of the models' tensors",
        merge=_merge,
        params=(ParamSpec("normalize", True),),
        model_params=(ParamSpec("weight", required=True),),
        warm_up=lambda params, seeded: [compiled_sum.KERNELS],
    ),
)
