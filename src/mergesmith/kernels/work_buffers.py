"""Per-thread work buffers, reused from call to call.

Why: a kernel's temporaries allocated afresh on every chunk fault their pages in each time (a 2 MB allocation is
its own mapping), and block-sized holes left between tensors keep the C heap from giving memory back: a float64
temporary per piece cost the 1b dare_ties merge 6-9 s of system time against 2.6 s (bench/README.md, issue 33).
Each thread (the executor's workers are threads) keeps its own buffer per (name, dtype, device), grown to the
largest size asked for; a caller may cap what is kept, so that one giant tensor does not pin its buffer forever.

`array` hands out numpy buffers the same way, for compiled loops that take numpy arrays: slicing one costs no torch
call. Every torch call passes the GIL back and forth (torch 2.13 even takes it again inside a view or an in-place
operation, to touch the tensor's Python object), so where a worker makes dozens of them per chunk, the other worker,
waiting for the GIL, sits idle: on the 1b dare_ties bench merge the two workers were busy 60% of the time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import torch


class WorkBuffers(threading.local):
    """A thread's buffers by (name, dtype, device), and its numpy buffers by (name, dtype)."""

    def __init__(self) -> None:
        self.pool: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.arrays: dict[tuple[str, np.dtype], np.ndarray] = {}

    def array(self, name: str, numel: int, dtype: type | np.dtype, keep_up_to: int | None = None) -> np.ndarray:
        """A 1-D numpy buffer of `numel` entries (its contents undefined), kept as `get` keeps its buffers."""
        key = (name, np.dtype(dtype))
        buf = self.arrays.get(key)
        if buf is None or buf.size < numel:
            buf = np.empty(numel, dtype=dtype)
            if keep_up_to is None or numel <= keep_up_to:
                self.arrays[key] = buf
        return buf[:numel]

    def forget_array(self, name: str, dtype: type | np.dtype, above: int) -> None:
        """Stop keeping this thread's numpy buffer `name` of `dtype` where it has more than `above` entries."""
        key = (name, np.dtype(dtype))
        buf = self.arrays.get(key)
        if buf is not None and buf.size > above:
            del self.arrays[key]

    def get(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        keep_up_to: int | None = None,
    ) -> torch.Tensor:
        """A buffer of `shape` (its contents undefined), kept for the next call unless it has more than
        `keep_up_to` entries (None: always kept)."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self.pool.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            if keep_up_to is None or numel <= keep_up_to:
                self.pool[key] = buf
        return buf[:numel].view(tuple(shape))
