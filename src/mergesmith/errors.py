"""Error types that separate a user's mistake (one clear line, exit 2) from a bug (traceback with -v)."""

from __future__ import annotations


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
