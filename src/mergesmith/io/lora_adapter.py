"""LoRA inputs: `path/to/model+path/to/lora` reads as the model with a PEFT adapter merged in.

Why a checkpoint wrapper instead of merging the adapter up front: the planner and executor only
ever ask a checkpoint for headers and for one tensor at a time, so applying `W + scale * B @ A` in
`get()` keeps LoRA inputs as lazy as any other input (no merged copy on disk or in memory).

PEFT semantics reproduced (a `LORA` adapter: `adapter_config.json` + `adapter_model.safetensors`
or `adapter_model.bin`; keys `base_model.model.<module>.<part>`):
- linear layers: `lora_A.weight` [r, in] and `lora_B.weight` [out, r], delta `B @ A`, transposed
  when `fan_in_fan_out` (GPT-2 style Conv1D weights); an optional `lora_B.bias` adds to the bias;
- embeddings: `lora_embedding_A` [r, vocab] and `lora_embedding_B` [dim, r], delta `(B @ A)^T`;
- scale `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, where `r` and `lora_alpha`
  come from `rank_pattern`/`alpha_pattern` when a pattern matches the module name as PEFT matches
  it (`(.*\\.)?<pattern>$`);
- any other saved tensor (`modules_to_save`, an embedding's saved `base_layer`) replaces the
  model's tensor of that name outright, as loading the adapter with PEFT would.
DoRA adapters (`lora_magnitude_vector`) and other PEFT types are refused with one line.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .checkpoint import Checkpoint, TensorInfo, resolve_model_path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."
_LORA_PARTS = {
    "lora_A.weight": ("linear", "A"),
    "lora_B.weight": ("linear", "B"),
    "lora_B.bias": ("linear", "bias"),
    "lora_embedding_A": ("embedding", "A"),
    "lora_embedding_B": ("embedding", "B"),
}


def split_lora_ref(ref: str) -> tuple[str, Path]:
    """(model ref, adapter directory) for `model+lora`, trying every `+` until both sides exist."""
    problems = []
    for i, ch in enumerate(ref):
        if ch != "+":
            continue
        model, lora = ref[:i], ref[i + 1 :]
        if not model or not lora:
            continue
        try:
            adapter = resolve_model_path(lora)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        adapter_dir = adapter if adapter.is_dir() else adapter.parent
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            problems.append(f"{adapter_dir}: no {ADAPTER_CONFIG} (not a PEFT adapter)")
            continue
        return model, adapter_dir
    detail = f": {problems[-1]}" if problems else ""
    raise CheckpointError(f"model {ref!r}: cannot read as model+lora{detail}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass(frozen=True)
class _Delta:
    """How to add one adapter module's low-rank product to one base tensor."""

    kind: str  # "linear" | "embedding" | "bias"
    a: str | None
    b: str
    scale: float
    transpose: bool = False


class LoraCheckpoint(Checkpoint):
    """A base checkpoint seen through a PEFT LoRA adapter, one merged tensor per `get()`."""

    def __init__(self, ref: str, base: Checkpoint, adapter: Checkpoint, adapter_dir: Path, lora_config: dict) -> None:
        self.base_checkpoint = base
        self.adapter = adapter
        self.adapter_dir = adapter_dir
        self.lora_config = lora_config
        self._replaced: dict[str, str] = {}
        self._deltas: dict[str, _Delta] = {}
        if base.quantized:  # its tensors are read through dequantization, which this view does not carry over
            raise CheckpointError(
                f"model {ref!r}: a LoRA adapter over a quantized model is not supported: dequantize the model first"
            )
        tensors = dict(base.tensors)
        self._plan(tensors)
        super().__init__(
            ref,
            base.root,
            [*base.files, *adapter.files],
            tensors,
            base.config,
            {**base._header_hashes, **adapter._header_hashes},
            {**base._bin_state, **adapter._bin_state},
        )
        self.remote_sizes = dict(base.remote_sizes)  # a hub model `plan` reads from its headers

    @classmethod
    def over(cls, ref: str, base: Checkpoint, adapter_dir: Path) -> LoraCheckpoint:
        """`base` seen through the adapter in `adapter_dir` (for the reference `ref`, `model+lora`): validate
        the adapter against the model's headers, read nothing else. The base is opened by the caller
        (io.references), which knows every form a model reference takes."""
        config_path = adapter_dir / ADAPTER_CONFIG
        try:
            lora_config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{config_path}: cannot read ({exc})") from None
        except RecursionError:
            raise CheckpointError(f"{config_path}: is nested too deeply to read") from None
        if not isinstance(lora_config, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object")
        peft_type = str(lora_config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise CheckpointError(f"{config_path}: peft_type {peft_type} is not supported (only LORA adapters)")
        if lora_config.get("use_dora"):
            raise CheckpointError(f"{config_path}: DoRA adapters are not supported")
        weights = next((adapter_dir / n for n in ADAPTER_WEIGHTS if (adapter_dir / n).is_file()), None)
        if weights is None:
            raise CheckpointError(f"{adapter_dir}: no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
        adapter = Checkpoint.open(str(weights))
        return cls(ref, base, adapter, adapter_dir, lora_config)

    def _scale(self, module: str, rank: int) -> float:
        cfg = self.lora_config
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", rank)))
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r)))
        if r != rank:
            raise CheckpointError(f"{self.adapter_dir}: module {module!r} has rank {rank} but the config says r={r}")
        return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r

    def _plan(self, tensors: dict[str, Any]) -> None:
        """Sort the adapter's tensors into deltas and replacements, checking shapes against the model."""
        where = str(self.adapter.files[0])
        modules: dict[str, dict[str, str]] = {}
        for key, info in self.adapter.tensors.items():
            name = key.removeprefix(PEFT_PREFIX)
            if name.endswith("lora_magnitude_vector") or ".lora_magnitude_vector." in name:
                raise CheckpointError(f"{where}: DoRA adapters are not supported")
            part = next((p for p in _LORA_PARTS if name.endswith("." + p)), None)
            if part is not None:
                module = name[: -len(part) - 1]
                modules.setdefault(module, {})[part] = key
                continue
            target = name.replace(".base_layer.", ".") if ".base_layer." in name else name
            self._replaced[target] = key
            tensors[target] = replace(info, name=target)
        fan_in_fan_out = bool(self.lora_config.get("fan_in_fan_out"))
        for module, parts in sorted(modules.items()):
            kind = "embedding" if "lora_embedding_A" in parts or "lora_embedding_B" in parts else "linear"
            a_key = parts.get("lora_embedding_A" if kind == "embedding" else "lora_A.weight")
            b_key = parts.get("lora_embedding_B" if kind == "embedding" else "lora_B.weight")
            if a_key is None or b_key is None:
                raise CheckpointError(f"{where}: module {module!r} lacks its lora A or B matrix")
            a_shape, b_shape = self.adapter.info(a_key).shape, self.adapter.info(b_key).shape
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
                raise CheckpointError(
                    f"{where}: module {module!r}: lora A {list(a_shape)} and B {list(b_shape)} do not multiply"
                )
            scale = self._scale(module, a_shape[0])
            weight = f"{module}.weight"
            if weight not in tensors:
                raise CheckpointError(f"{where}: the adapter targets {module!r}, but the model has no {weight!r}")
            transpose = kind == "embedding" or fan_in_fan_out
            delta_shape = (a_shape[1], b_shape[0]) if transpose else (b_shape[0], a_shape[1])
            if tuple(tensors[weight].shape) != delta_shape:
                raise CheckpointError(
                    f"{where}: module {module!r}: the adapter's update is {list(delta_shape)}, "
                    f"the model's {weight!r} is {list(tensors[weight].shape)}"
                )
            self._deltas[weight] = _Delta(kind, a_key, b_key, scale, transpose)
            if "lora_B.bias" in parts:
                bias = f"{module}.bias"
                if bias in tensors:
                    self._deltas[bias] = _Delta("bias", None, parts["lora_B.bias"], scale)
                elif bool(self.adapter.get(parts["lora_B.bias"]).any()):
                    # PEFT's lora_bias gives every target a bias; a zero one on a bias-less layer is a no-op.
                    raise CheckpointError(f"{where}: the adapter has a bias for {module!r}, the model has no {bias!r}")

    def get(self, name: str) -> torch.Tensor:
        """The model's tensor with the adapter applied (computed in float32, returned in its dtype)."""
        tensor = self.adapter.get(self._replaced[name]) if name in self._replaced else super().get(name)
        delta = self._deltas.get(name)
        if delta is None:
            return tensor
        b = self.adapter.get(delta.b).to(torch.float32)
        if delta.kind == "bias":
            update = b * delta.scale
        else:
            assert delta.a is not None
            update = (b @ self.adapter.get(delta.a).to(torch.float32)) * delta.scale
            if delta.transpose:
                update = update.T
        return (tensor.to(torch.float32) + update).to(tensor.dtype)

    def byte_range(self, name: str) -> tuple[Path, int, TensorInfo] | None:
        """None for the tensors the adapter changes or replaces (their value is computed, not stored)."""
        if name in self._deltas or name in self._replaced:
            return None
        return super().byte_range(name)

    @property
    def adapted_tensors(self) -> list[str]:
        """The tensor names whose values the adapter changes (low-rank updates and saved replacements)."""
        return sorted(set(self._deltas) | set(self._replaced))

    @property
    def tokenizer_root(self) -> Path:
        """Where this input's tokenizer lives: the adapter's own when it ships one (adapters that add
        tokens save the grown tokenizer beside themselves), else the base model's."""
        if any((self.adapter_dir / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
            return self.adapter_dir
        return self.root

    def identity(self) -> list[tuple[str, int, int, str]]:
        """The weight files' identities plus adapter_config.json's (its alpha and ranks change the bytes)."""
        config = self.adapter_dir / ADAPTER_CONFIG
        st = config.stat()
        digest = hashlib.sha256(config.read_bytes()).hexdigest()
        return [*super().identity(), (ADAPTER_CONFIG, st.st_size, st.st_mtime_ns, digest)]

    def close(self) -> None:
        super().close()
        self.base_checkpoint.close()
        self.adapter.close()
