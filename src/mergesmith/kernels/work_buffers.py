"""Per-thread work buffers, reused from call to call.

Why: a kernel's temporaries allocated afresh on every chunk fault their pages in each time (a 2 MB allocation is
its own mapping), and block-sized holes left between tensors keep the C heap from giving memory back: a float64
temporary per piece cost the 1b dare_ties merge 6-9 s of system time against 2.6 s (bench/README.md, issue 33).
Each thread (the executor's workers are threads) keeps its own buffer per (name, dtype, device), grown to the
largest size asked for; a caller may cap what is kept, so that one giant tensor does not pin its buffer forever.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch


class WorkBuffers(threading.local):
    """A thread's buffers by (name, dtype, device)."""

    def __init__(self) -> None:
        self.pool: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

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
