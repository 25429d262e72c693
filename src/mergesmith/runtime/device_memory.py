"""How much GPU memory a merge may hold: `--max-gpu-memory`, else the device's free memory less a safety margin.

Why a module of its own, below the engine: the planner (the `plan` report, the plan-time check that every
tensor's device working set fits) and the executor (admission of recipes by device bytes in flight) must read
the same budget, and the query of the device is the one part that needs a GPU. It goes through
`free_memory_query`, a module-level function tests replace (monkeypatch) with a fake, so the budget logic is
exercised on a machine without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..sizes import human_size

SAFETY_MARGIN = 0.10
"""Of the device's free memory, the part the automatic budget leaves alone: the CUDA context, the caching
allocator's fragmentation and rounding, cuBLAS/cuSOLVER workspaces, and other processes' growth. An assumption,
not a measurement (no GPU was available when it was chosen)."""

FreeMemoryQuery = Callable[[str], tuple[int, int]]
"""(free bytes, total bytes) of a device, by name (`cuda`, `cuda:1`)."""


def cuda_free_memory(device: str) -> tuple[int, int]:
    """The device's (free, total) bytes as the CUDA driver reports them (torch.cuda.mem_get_info)."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


free_memory_query: FreeMemoryQuery = cuda_free_memory
"""The query every budget uses; tests replace it (monkeypatch.setattr) with a fake."""


@dataclass(frozen=True)
class DeviceLimit:
    """The device memory budget of a merge and where it comes from (said by `plan` and in errors)."""

    device: str
    limit: int
    source: str  # "--max-gpu-memory", or how the automatic budget was derived

    def describe(self) -> str:
        """`the --max-gpu-memory budget of 20 GB` or `the GPU budget of 72 GB (90% of the 80 GB free on cuda)`."""
        if self.source == "--max-gpu-memory":
            return f"the --max-gpu-memory budget of {human_size(self.limit)}"
        return f"the GPU budget of {human_size(self.limit)} ({self.source})"


def device_limit(device: str, max_gpu_memory: int | None, query: FreeMemoryQuery | None = None) -> DeviceLimit | None:
    """The budget of device bytes in flight on `device` (None off CUDA: the CPU and MPS paths keep no device
    budget): `max_gpu_memory` when given, else the free memory less SAFETY_MARGIN, read now."""
    if not device.startswith("cuda"):
        return None
    if max_gpu_memory:
        return DeviceLimit(device, int(max_gpu_memory), "--max-gpu-memory")
    free, _total = (query or free_memory_query)(device)
    keep = 1.0 - SAFETY_MARGIN
    return DeviceLimit(device, int(free * keep), f"{keep:.0%} of the {human_size(free)} free on {device}")
