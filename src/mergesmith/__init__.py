"""mergesmith: merge language-model checkpoints as a plan of tensor recipes, streamed to disk.

The public Python API (everything else in the package is internal):

- `merge(config, out_dir, **options) -> MergeResult`, `plan(config, out_dir=None, **options)`,
  `merge_raw`, `moe`, `multi`, `extract_lora`: the commands as functions, with the commands'
  options as keyword arguments (same names and defaults); rerunning `merge` resumes.
- `merge_state_dicts(method, state_dicts, base=None, parameters=..., model_parameters=...)` and
  `merge_tensors(...)`: any merge method over tensors in memory (CPU or GPU), no files.
- `memory_room()`: what this process may use now (cgroup limit, available memory).
- the errors the command line prints: `MergesmithError` and its kinds.

Names are imported on first use, so `import mergesmith` stays cheap (no torch) until one is called.
"""

import sys

from ._version import __version__ as __version__  # the package version, as before
from .regmean import registration as _regmean_registration  # noqa: F401

# What the features add to the engine (recipe ops, vocabulary planning steps), registered here because Python
# runs this module before any other of the package, in every process that builds or runs a plan (a Ray worker
# too); each module is names and lazy callables, nothing heavy. See engine/extensions.py.
from .tokenizer import registration as _tokenizer_registration  # noqa: F401
from .tokensurgeon import registration as _tokensurgeon_registration  # noqa: F401

TYPE_CHECKING = False  # not `from typing import ...`: typing alone costs more than this whole module

_EXPORTS = {
    "merge": "python_api",
    "merge_raw": "python_api",
    "extract_lora": "python_api",
    "PlanReport": "python_api",
    "merge_state_dicts": "raw.in_memory",
    "merge_tensors": "raw.in_memory",
    "memory_room": "runtime.memory_limits",
    "MemoryRoom": "runtime.memory_limits",
    "MergeResult": "engine.run",
    "MergeConfiguration": "config",
    "ProgressEvent": "engine.execution.local_executor",
    "MethodError": "engine.execution.compute",
    "MergesmithError": "errors",
    "ConfigError": "errors",
    "CheckpointError": "errors",
    "OutputError": "errors",
    "MergeInterrupted": "errors",
    "MemoryShortage": "errors",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "MemoryRoom",
    "MemoryShortage",
    "MergeConfiguration",
    "MergeInterrupted",
    "MergeResult",
    "MergesmithError",
    "MethodError",
    "OutputError",
    "PlanReport",
    "ProgressEvent",
    "extract_lora",
    "memory_room",
    "merge",
    "merge_raw",
    "merge_state_dicts",
    "merge_tensors",
    "moe",
    "multi",
    "plan",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time the names load lazily
    from .config import MergeConfiguration
    from .engine.execution.compute import MethodError
    from .engine.execution.local_executor import ProgressEvent
    from .engine.run import MergeResult
    from .errors import CheckpointError, ConfigError, MemoryShortage, MergeInterrupted, MergesmithError, OutputError
    from .python_api import PlanReport, extract_lora, merge, merge_raw, moe, multi, plan
    from .raw.in_memory import merge_state_dicts, merge_tensors
    from .runtime.memory_limits import MemoryRoom, memory_room


# `moe` and `multi` are also the names of internal packages (the moe/ and multi/ features), and importing a
# submodule sets the package attribute of its name to that module. So these stay modules, made callable:
# `mergesmith.moe(config, out)` runs the API function, while `import mergesmith.moe.router` goes on working.
# (`plan` was one too, before the Plan moved to engine/; without a module of its name it is the function.)
_CALLABLE_MODULES = {"plan": "plan", "moe": "moe", "multi": "multi"}


class _CallableModule(type(sys)):  # type: ignore[misc]
    """A submodule that is also the API function of its name (see _CALLABLE_MODULES)."""

    def _function(self) -> object:
        from . import python_api

        return getattr(python_api, self.__name__.rsplit(".", 1)[-1])

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._function()(*args, **kwargs)  # type: ignore[operator]

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]  # help() and IDEs show the function's
        return self._function().__doc__

    @property
    def __signature__(self) -> object:
        import inspect

        return inspect.signature(self._function())  # type: ignore[arg-type]


class _Package(type(sys)):  # type: ignore[misc]
    def __getattribute__(self, name: str) -> object:
        value = super().__getattribute__(name)
        if name in _CALLABLE_MODULES and type(value) is type(sys):
            value.__class__ = _CallableModule
        return value


def __getattr__(name: str) -> object:
    import importlib

    if name in _CALLABLE_MODULES:
        try:
            return importlib.import_module(f".{name}", __name__)  # the submodule; _Package makes it callable
        except ModuleNotFoundError as exc:  # no such module (any more): the function itself
            if exc.name != f"{__name__}.{name}":
                raise
            from . import python_api

            value = getattr(python_api, name)
            globals()[name] = value
            return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mergesmith' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


sys.modules[__name__].__class__ = _Package
