"""Where the Grams live: `<out>/.cache/huggingface/mergesmith/regmean/<model key>/grams-*.safetensors`.

Inside the output directory's state (io/journal.py), so `--overwrite` and a changed config clear them with the rest
of the state, and nothing is written outside the output directory. Each file is one unit of work (a decoder layer's
Grams, the output head's, or a whole model's), written under a temporary name, fsync'ed and renamed into place
(io.safetensors_writer.write_file_atomic, which never follows a link): a file that exists is whole, so a rerun
after a kill skips it. The files of one model form a directory that opens as a checkpoint (io/checkpoint.py reads
loose safetensors files), which is how the merge reads them: as one more input model per model.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import torch

from ..errors import MergesmithError
from ..io import safe_fs
from ..io.journal import STATE_PARTS
from ..io.safetensors_writer import write_file_atomic

STORE_DIR = "regmean"
GRAM_PREFIX = "regmean-grams:"
"""The model name recipes give a model's Grams: `regmean-grams:<model>`."""


def gram_ref(model: str) -> str:
    return GRAM_PREFIX + model


def model_key(model: str) -> str:
    """A directory name for one model's Grams (its reference may be a path or hold characters a name cannot)."""
    return hashlib.sha256(model.encode()).hexdigest()[:16]


def store_dir(out_dir: Path, model: str) -> Path:
    return out_dir.joinpath(*STATE_PARTS, STORE_DIR, model_key(model))


def layer_file(index: int | None) -> str:
    """The file of one decoder layer's Grams; None: the modules outside the layers (the output head)."""
    return "grams-head.safetensors" if index is None else f"grams-{index:05d}.safetensors"


WHOLE_FILE = "grams-model.safetensors"
"""A model collected whole (an architecture not streamed layer by layer): all its Grams in one file."""


def finished(out_dir: Path, model: str, name: str) -> bool:
    """Whether the file is there as a regular file, reached without links (a link is never taken for ours)."""
    parts = store_dir(out_dir, model).relative_to(out_dir).parts
    try:
        with safe_fs.opened_dir(out_dir, parts) as directory:  # a link on the way raises LinkError
            return stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
    except (OSError, MergesmithError):
        return False


def write_grams(out_dir: Path, model: str, name: str, grams: dict[str, torch.Tensor], tokens: int) -> None:
    """Write one unit's Grams atomically (see the module docstring)."""
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in sorted(grams.items())}, metadata={"tokens": str(tokens)})
    write_file_atomic(store_dir(out_dir, model) / name, data, root=out_dir)


def remove_store(out_dir: Path) -> None:
    """Remove every model's Grams (a complete merge never reads them again), links removed, never followed."""
    try:
        with safe_fs.opened_dir(out_dir, STATE_PARTS) as state:
            safe_fs.remove_tree(state, STORE_DIR)
    except (OSError, MergesmithError):  # a read-only or odd state directory: the Grams stay, harmless
        pass
