"""Error types that separate a user's mistake (one clear line, exit 2) from a bug (traceback with -v)."""

from __future__ import annotations

import os

DISPLAY_ERRORS_ENV = "MERGESMITH_DISPLAY_ERRORS"


def display_errors_raise() -> bool:
    """Whether a progress display's failure is raised (`MERGESMITH_DISPLAY_ERRORS=raise`, as the test suite
    sets it) rather than turned into one warning: the displays of every layer ask here, so one switch
    serves display/guard.py and evolve's live table alike."""
    return os.environ.get(DISPLAY_ERRORS_ENV, "").lower() == "raise"


class MergesmithError(Exception):
    """A problem with the user's input or environment: printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(MergesmithError):
    """The merge configuration is malformed or inconsistent; the message names the key."""


class CheckpointError(MergesmithError):
    """An input checkpoint is missing, malformed or lacks a tensor; the message names the file/tensor."""


class OutputError(MergesmithError):
    """The output directory cannot be written (a file, read-only, full, or holds another merge)."""


class MergeInterrupted(MergesmithError):
    """The user interrupted the merge; finished shards are journaled and a rerun resumes."""

    exit_code = 130


class MemoryShortage(MergesmithError):
    """Even one tensor's working set no longer fits the memory this process may use (its cgroup limit or
    the system's available memory); the merge stopped between tensors, finished work is journaled and a
    rerun with more memory resumes. `needed` and `available` are in bytes."""

    def __init__(self, message: str, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its figures (Ray hands errors back)
        return (self.__class__, (str(self), self.needed, self.available))
