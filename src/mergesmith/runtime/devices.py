"""Where the arithmetic runs: one check of a requested device, shared by the planners, the API and extract-lora;
and the one least-squares solve that gives the same answer on every device (min_norm_lstsq).

Checked before anything is written, so asking for a device this machine lacks is one line (exit 2),
not a torch assertion halfway through with an output directory left behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICES = ("cpu", "cuda", "mps", "auto")


def _available(kind: str) -> bool:
    import torch

    if kind == "cuda":
        return bool(torch.cuda.is_available())
    if kind == "mps":
        backend = getattr(torch.backends, "mps", None)
        return bool(backend is not None and backend.is_available())
    return True


def resolve_device(device: str | None, *, check: bool = True, what: str = "device") -> str:
    """The device to compute on: `auto` becomes cuda, else mps, else cpu; `cuda`/`mps` (also `cuda:1`)
    must be available here (unless `check` is False: Ray workers, not this driver, hold the GPUs), else
    a ConfigError naming `what`."""
    name = (device or "cpu").strip()
    kind = name.split(":", 1)[0].lower()
    if kind == "auto":
        return "cuda" if _available("cuda") else ("mps" if _available("mps") else "cpu")
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"`{what}`: unknown device {name!r}; use cpu, cuda, mps or auto")
    if check and not _available(kind):
        raise ConfigError(f"`{what} {name}`: no {kind} device is available on this machine")
    if kind == "cuda" and check and ":" in name:
        import torch

        index = name.split(":", 1)[1]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise ConfigError(
                f"`{what} {name}`: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0 ...)"
            )
    return name


def start_cuda_init(device: str) -> None:
    """Create the CUDA context of `device` in a background thread, now, where a merge would create it later.

    Why: the context costs ~1-2 s (more on a large card), and the merge first needs it after planning, for the
    device budget (free memory), so reading the inputs waited for it; started as the command starts, it overlaps
    the imports' tail and the planning (reading headers). Errors are left for the merge's own first CUDA call to
    raise where they can be reported; a second start is a no-op (torch's lazy init is locked and runs once)."""
    if not device.lower().startswith("cuda"):
        return
    import threading

    def init() -> None:
        import torch

        try:
            torch.cuda.mem_get_info(torch.device(device))
        except Exception:  # noqa: BLE001 - reported by the merge's own call, which this only anticipates
            pass

    threading.Thread(target=init, name="mergesmith-cuda-init", daemon=True).start()


def min_norm_lstsq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The minimum-norm least-squares solution X of A X = B (batched like torch.linalg.lstsq), on A's device.

    Solved by LAPACK's gelsd (SVD) on the CPU whatever the device, because the systems mergesmith solves this
    way (tokensurgeon's neighbour weights, regmean's fallback for a singular Gram) are rank-deficient exactly
    when it matters: repeated embeddings among a token's neighbours, more neighbours than dimensions, a Gram
    of unused features. On CUDA torch has only gels, which assumes full rank: a batched call raises
    LinAlgError, an unbatched one returns inf or arbitrary weights. On the CPU torch's default, gelsy, leaves
    its pivot array uninitialised (pytorch/pytorch#187411), so it can misjudge the rank and return a far worse
    fit (tests/test_tokensurgeon.py: residual 1.83 where 0.24 is the optimum, neighbours with repeated rows). The
    systems are small next to the work around them (k x k, hidden x k, or one Gram), so the copy to the CPU
    and back costs little."""
    import torch

    solution = torch.linalg.lstsq(a.cpu(), b.cpu(), driver="gelsd").solution
    return solution.to(a.device)
