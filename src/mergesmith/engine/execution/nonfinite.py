"""Counting NaN and inf in the tensors a merge streams through, inputs and outputs.

Why: a NaN in one input passes through every merge method into the output, and a merge can make
non-finite values of its own (a float16 output that overflows, a method dividing by a vanishing norm);
either way the output loads and produces NaN logits, and nothing said so. Each input tensor (or row block)
is checked as the executor loads it, each output before it is written: a model's tensor with non-finite
values is warned about once, with its model and name, and `--strict` refuses it at once (before that
output tensor is written). Output tensors that have non-finite values where their inputs had none are
listed at the end.

The check is one reduction over bytes the merge reads anyway: a sum, which is finite exactly when every
value is (unless finite values overflow it, which sends it to the exact count). Its cost beside the merge
is measured in the README ("Input validation"); MERGESMITH_NONFINITE_CHECK=0 turns it off.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import torch

from ...errors import CheckpointError, MergesmithError

ENV_SWITCH = "MERGESMITH_NONFINITE_CHECK"
SHOWN = 5
"""Tensors named in the end-of-merge summary (the rest are counted)."""


_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
"""Per dtype: the integer view of its bits and its exponent mask (all ones: inf or NaN)."""


def count_nonfinite(tensor: torch.Tensor) -> int:
    """NaN and +-inf entries of a floating-point tensor (0 for other dtypes).

    The quick test is the tensor's own sum (torch accumulates 16-bit floats in float32), which is finite
    exactly when every value is, unless finite values overflow it; then, and only then, the bits are counted:
    entries whose exponent is all ones. Both are single passes without a tensor-sized temporary of floats
    (torch.isfinite on bfloat16, or a sum into float32 with `dtype=`, ran 50-100 times slower on this CPU)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    if math.isfinite(float(tensor.sum())):
        return 0
    found = _EXPONENT_BITS.get(tensor.dtype)
    if found is None:  # another float type (float8): the plain test
        return int(tensor.numel() - torch.isfinite(tensor.float()).sum())
    int_type, mask = found
    bits = tensor.detach().cpu().contiguous().view(int_type).numpy().reshape(-1)
    mask_value = bits.dtype.type(mask)  # every mask is below its signed type's maximum
    return int(np.count_nonzero((bits & mask_value) == mask_value))


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class NonFiniteMonitor:
    """Thread-safe tallies of non-finite values per input tensor and per output tensor of one merge."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.on = enabled()
        self._lock = threading.Lock()
        self._inputs: dict[tuple[str, str], int] = {}  # (model, tensor) -> non-finite values seen
        self._seen: set[tuple[str, str, int | None]] = set()  # blocks counted (a block read twice counts once)
        self._outputs: dict[str, int] = {}  # output tensors the merge made non-finite

    def check_input(self, model: str, tensor_name: str, tensor: torch.Tensor, first_row: int | None) -> None:
        """Count one input tensor (or the block of it starting at `first_row`) as it is loaded."""
        if not self.on:
            return
        key = (model, tensor_name, first_row)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        bad = count_nonfinite(tensor)
        if not bad:
            return
        what = f"model {model!r}: tensor {tensor_name!r} has non-finite values (NaN or inf)"
        if self.strict:
            raise CheckpointError(f"{what}; refused under --strict")
        with self._lock:
            self._inputs[(model, tensor_name)] = self._inputs.get((model, tensor_name), 0) + bad

    def check_output(self, name: str, inputs: list[tuple[str, str]], tensor: torch.Tensor) -> None:
        """Count an output tensor (or block) before it is written; remembered when none of its inputs had any."""
        if not self.on:
            return
        bad = count_nonfinite(tensor)
        if not bad:
            return
        with self._lock:
            inherited = any(self._inputs.get(ref) for ref in inputs)
        if inherited:
            return  # the inputs' own warnings said so
        if self.strict:
            raise MergesmithError(
                f"output tensor {name!r}: the merge made {bad} non-finite values (NaN or inf) from finite inputs; "
                "refused under --strict"
            )
        with self._lock:
            self._outputs[name] = self._outputs.get(name, 0) + bad

    def warnings(self) -> list[str]:
        """The warnings of the merge so far: one per input tensor with non-finite values (with its count), then
        one summary of the output tensors that have non-finite values their inputs did not."""
        with self._lock:
            out = [
                f"model {model!r}: tensor {tensor!r} has {count} non-finite values (NaN or inf); they pass into "
                "the output"
                for (model, tensor), count in self._inputs.items()
            ]
            if self._outputs:
                names = list(self._outputs)
                shown = ", ".join(f"{n!r} ({self._outputs[n]})" for n in names[:SHOWN])
                more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
                out.append(
                    f"the output has non-finite values (NaN or inf) where its inputs had none, in {len(names)} "
                    f"tensor{'s' if len(names) > 1 else ''}: {shown}{more} (an overflow of the output dtype, or "
                    "the method's arithmetic)"
                )
            return out
