"""The Plan: a merge as plain data.

Everything a merge will do is decided here before any tensor is computed: every output tensor's
recipe (inputs, method, resolved parameters), its shape and dtype, and so the shards and each
tensor's byte offset. The same object drives the dry-run report, the estimate, the resume journal
(via its fingerprint) and execution.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..io.dtypes import dtype_size

CONFIG_NAME = "mergekit_config.yml"
"""The merge config's name in the output directory: the one mergekit writes, which published merges carry
and which tools reading a model's lineage look for."""
MOE_CONFIG_NAME = "mergekit_moe_config.yml"
"""An MoE assembly's config, as mergekit-moe names it."""
OWN_CONFIG_NAME = "mergesmith_config.yml"
"""A record that is no mergekit config (tokensurgeon's options); also the name earlier versions gave every
config, so still an output file of ours for `--overwrite`."""


@dataclass(frozen=True)
class InputRef:
    """One input tensor: which model, which tensor, and how many leading rows to keep.

    `rows` truncates (or zero-pads) dimension 0, which is how embeddings of models whose
    vocabularies differ in size are brought to the output vocabulary.
    """

    model: str
    tensor: str
    rows: int | None = None


@dataclass(frozen=True)
class TensorRecipe:
    """How one output tensor is made.

    `op` is "copy" (bytes of one input, possibly converted to `dtype`) or "merge". For a merge,
    `inputs` are in config order, the base (if any) at `base_index`; `model_params[i]` belongs to
    `inputs[i]`; `seed` is set for randomised methods. `quantize` (io/quantized.py: ("fp8", rows, cols),
    ("fp8",) or ("mxfp4",)) stores the tensor quantized: computed whole as `dtype`, then written as its
    stored tensors (`stored()`, e.g. the FP8 values and their `_scale_inv`).

    `depth` is (output layer index, the output's layer count) of a merged tensor of the output's layer stack
    (of its module's stack in a `modules:` merge), None for tensors outside it (embeddings, final norm, head):
    the OUTPUT layer's, so a frankenmerge's layer 0 taken from a source's layer 20 is depth 0. Methods that
    scale by depth (LiNeS, methods/lines.py) read it from MergeInputs.depth.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    op: str
    inputs: tuple[InputRef, ...]
    method: str | None = None
    base_index: int | None = None
    model_params: tuple[tuple[tuple[str, Any], ...], ...] = ()
    params: tuple[tuple[str, Any], ...] = ()
    seed: int | None = None
    quantize: tuple[Any, ...] = ()
    depth: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its output as written (all its stored tensors)."""
        if self.quantize:
            return sum(math.prod(shape) * dtype_size(dtype) for _name, dtype, shape in self.stored())
        return math.prod(self.shape) * dtype_size(self.dtype)

    def stored(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of each tensor the recipe writes: itself, or its quantized parts."""
        if not self.quantize:
            return [(self.name, self.dtype, self.shape)]
        from ..io.quantized import stored_layout

        return stored_layout(self.name, self.shape, self.quantize)

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ShardPlan:
    """One output file: its name and recipes in file order with their data offsets."""

    filename: str
    recipes: list[TensorRecipe]
    offsets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return sum(r.nbytes for r in self.recipes)


@dataclass
class Estimate:
    """What the merge will cost, all in bytes (time is added by the CLI from a read probe)."""

    bytes_read: int
    bytes_written: int
    peak_memory: int
    largest_tensor: str
    largest_tensor_bytes: int
    concurrency: int
    read_ahead: int = 0  # of peak_memory: the input feed's buffers (io.direct_read.pool_bytes)


@dataclass
class Plan:
    """The whole merge: shards (with recipes), output config, files to copy, card and estimate."""

    shards: list[ShardPlan]
    output_config: dict[str, Any]
    compute_dtype: str
    out_dtype: str
    files_to_copy: list[tuple[str, str]]  # (absolute source path, name in the output directory)
    config_yaml: str
    model_card: str | None
    input_identities: dict[str, list[tuple[str, int, int]]]  # model -> [(file, size, mtime_ns)]
    options: dict[str, Any]
    random_seed: int | None = None
    warnings: list[str] = field(default_factory=list)
    estimate: Estimate | None = None
    config_name: str = CONFIG_NAME  # the file `config_yaml` is written to

    @property
    def recipes(self) -> list[TensorRecipe]:
        return [r for s in self.shards for r in s.recipes]

    @property
    def total_size(self) -> int:
        return sum(s.data_bytes for s in self.shards)

    def fingerprint(self) -> str:
        """Hash of everything that decides the output bytes: recipes, inputs, options, tool version."""
        from .._version import __version__

        payload = {
            "version": __version__,
            "shards": [{"file": s.filename, "recipes": [asdict(r) for r in s.recipes]} for s in self.shards],
            "config": self.output_config,
            "inputs": self.input_identities,
            "options": self.options,
            "card": self.model_card,
            "config_yaml": self.config_yaml,
            "files": [name for _, name in self.files_to_copy],
        }
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()
