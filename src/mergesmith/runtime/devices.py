"""Where the arithmetic runs: one check of a requested device, shared by the planners, the API and extract-lora.

Checked before anything is written, so asking for a device this machine lacks is one line (exit 2),
not a torch assertion halfway through with an output directory left behind.
"""

from __future__ import annotations

from ..errors import ConfigError

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
