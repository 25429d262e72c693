"""Option values (from the command line or the API's keywords) to what the engine runs with: MergeOptions and
RunControls, sizes read as mergekit reads them, the device and Ray checked before any planning."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from .. import mergekit_flags
from ..errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?)([bB]?)\s*$")
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int, option: str) -> int:
    """`5B`/`5G`/`500M`/`8GB` are decimal (5B = 5 billion bytes, as mergekit reads it); `8GiB` binary."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    number, unit, binary, b = m.groups()
    unit = unit.lower()
    if binary and not unit:
        raise ConfigError(f"`{option}`: cannot read size {text!r} (examples: 5B, 500M, 2G, 8GB, 16GiB)")
    if unit == "" and b:  # "5B" or "5b": billions, mergekit's spelling for shard sizes
        size = int(float(number) * 1e9)
    else:
        size = int(float(number) * (1024 if binary else 1000) ** _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"`{option}`: size must be positive, got {text!r}")
    return size


def to_merge_options(kw: dict[str, Any], command: str = "merge", echo: Callable[[str], None] | None = None) -> Any:
    """MergeOptions from a merging command's (or the API's) keyword values, mergekit's flags mapped first
    (`kw` loses them); the notes about flags without effect go to `echo` (default: stderr) once the options
    are checked, so a refused command line prints its one error line alone."""
    from ..engine.planning.shared import MergeOptions
    from ..io.lora_cache import lora_merge_settings
    from ..runtime.devices import resolve_device

    taken = mergekit_flags.take(command, kw)

    executor = kw.get("executor") or "local"
    if kw.get("ray_address") and executor != "ray":
        raise ConfigError("`--ray-address` only applies to the Ray executor: add `--executor ray`")
    device = "cuda" if kw.get("cuda") else kw.get("device", "cpu")
    # Ray workers, not this driver, need the device
    device = resolve_device(device, check=executor != "ray", what="--device")
    if executor == "ray":
        from ..engine.execution.ray_executor import RayExecutor  # noqa: F401 - fail before planning without Ray
    values: dict[str, Any] = dict(
        out_shard_size=parse_size(kw["out_shard_size"], "--out-shard-size"),
        random_seed=kw.get("random_seed"),
        copy_tokenizer=kw.get("copy_tokenizer", True),
        write_model_card=kw.get("write_model_card", True),
        allow_crimes=kw.get("allow_crimes", False),
        trust_remote_code=kw.get("trust_remote_code", False),
        threads=kw.get("threads") or (os.cpu_count() or 1),
        max_memory=parse_size(kw["max_memory"], "--max-memory") if kw.get("max_memory") else None,
        max_gpu_memory=parse_size(kw["max_gpu_memory"], "--max-gpu-memory") if kw.get("max_gpu_memory") else None,
        device=device,
        executor=executor,
        ray_address=kw.get("ray_address"),
        strict=bool(kw.get("strict")),
        unsafe_truncate_embeddings=bool(taken.get("unsafe_truncate_embeddings")),
        # `plan` reads headers only: a LoRA input is seen through its adapter there, never merged into the cache
        lora_merge=None
        if command == "plan"
        else lora_merge_settings(taken.get("lora_merge_cache"), taken.get("lora_merge_dtype")),
    )
    extra = _passed_on(kw, values)  # adds to `values` the fields it finds by name
    if values["max_gpu_memory"] and not str(device).startswith("cuda"):
        taken.notes.append(
            f"note: `--max-gpu-memory` has no effect here: the arithmetic runs on {device} "
            "(add --cuda or --device cuda)"
        )
    options = MergeOptions(**values, extra=extra)
    taken.say_notes(echo)  # the options are checked: a refused command line printed no note
    return options


_CONVERTED_ABOVE = ("cuda",)  # read into `device` by to_merge_options


def _passed_on(kw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The shared merge options to_merge_options does not convert itself, by name: into the MergeOptions field
    of that name, else into `MergeOptions.extra` (where the code that uses a new option reads it). So an option
    declared in families.SharedMerge reaches the engine without a line here."""
    from ..engine.planning.shared import MergeOptions
    from .families import SharedMerge
    from .spec import options_of

    fields = {f.name for f in dataclasses.fields(MergeOptions)}
    extra: dict[str, Any] = {}
    for opt in options_of(SharedMerge):
        if opt.face_only or opt.name in values or opt.name in _CONVERTED_ABOVE or opt.name not in kw:
            continue
        if opt.name in fields:
            values[opt.name] = kw[opt.name]
        else:
            extra[opt.name] = kw[opt.name]
    return extra


def to_run_controls(kw: Mapping[str, Any], **callbacks: Any) -> Any:
    """RunControls from the output options' values (`overwrite`, `force`, `verify` where the command has it)
    and the caller's callbacks (`on_plan`, `on_progress`, `stop`)."""
    from ..engine.run import RunControls

    return RunControls(
        overwrite=bool(kw.get("overwrite")), force=bool(kw.get("force")), verify=bool(kw.get("verify")), **callbacks
    )


def to_extract_arguments(
    kw: dict[str, Any], device_option: str = "--device", echo: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """lora.extract.extract_lora's keyword arguments from extract-lora's values (the command's or the API's;
    `kw` loses mergekit's flags, `-j` becoming `threads`): the device checked first (a refusal names
    `device_option`), then the notes about mergekit flags without effect go to `echo` (default: stderr)."""
    from ..io.lora_cache import lora_merge_settings
    from ..runtime.devices import resolve_device

    taken = mergekit_flags.take("extract-lora", kw)
    device = resolve_device(kw["device"], what=device_option)
    taken.say_notes(echo)
    return dict(
        max_rank=kw["max_rank"],
        sv_epsilon=kw["sv_epsilon"],
        embed_lora=kw["embed_lora"],
        device=device,
        overwrite=kw["overwrite"],
        include=kw["include_regex"],
        exclude=kw["exclude_regex"],
        save_modules=kw["save_module"],
        skip_undecomposable=kw["skip_undecomposable"],
        distribute_scale=kw["distribute_scale"],
        lora_merge=lora_merge_settings(taken.get("lora_merge_cache"), taken.get("lora_merge_dtype")),
    )
