"""Merges of tensors already in memory: state dicts in a training loop or a notebook, no files.

Why not a second implementation: the state dicts are wrapped as checkpoints (`InMemoryCheckpoint`,
whose tensors are the caller's own) and planned by the raw planner (raw.RawPlanner), so a method's
parameters are checked exactly as for a config file, and every output tensor is computed by the
executor's `compute`, the function a file-based merge runs. The same tensors therefore give the same
bytes in memory as from files (tests/test_python_api.py compares them, method by method).

Tied weights (an `nn.Module.state_dict()` lists `lm_head.weight` and `embed_tokens.weight` viewing one
storage when they are tied): names that view the same storage in every input are merged once, and the
merged state dict gives them one tensor again, so `load_state_dict` keeps the tie.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import parse_config
from ..errors import ConfigError
from ..io.checkpoint import Checkpoint, TensorInfo
from ..io.dtypes import from_torch

log = logging.getLogger("mergesmith")
if not log.handlers:  # a library prints nothing unless the program configures logging (else lastResort would)
    log.addHandler(logging.NullHandler())

StateDict = Mapping[str, torch.Tensor]
SOURCE = "merge_state_dicts"


class InMemoryCheckpoint(Checkpoint):
    """A state dict seen as a checkpoint: headers from the tensors' shapes and dtypes, `get` returns
    the caller's tensor itself (no copy), nothing is mapped or advised."""

    def __init__(self, ref: str, state: StateDict) -> None:
        where = Path(f"<memory:{ref}>")
        tensors: dict[str, TensorInfo] = {}
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"{SOURCE}: {ref}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
            tensors[name] = TensorInfo(name, from_torch(tensor.dtype), tuple(tensor.shape), where)
        if not tensors:
            raise ConfigError(f"{SOURCE}: {ref}: the state dict is empty")
        super().__init__(ref, where, [where], tensors, None, {}, {where: dict(state)})

    def identity(self) -> list[tuple[str, int, int, str]]:
        return []  # nothing on disk to recognise again: in-memory merges are never resumed


def _storage_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _aliases(states: Sequence[StateDict]) -> dict[str, str]:
    """{alias: kept name} for names that view the same storage as an earlier name in every input."""
    first = states[0]
    seen: dict[tuple[Any, ...], str] = {}
    candidates: dict[str, str] = {}
    for name, tensor in first.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        key = _storage_key(tensor)
        if key in seen:
            candidates[name] = seen[key]
        else:
            seen[key] = name
    return {
        alias: kept
        for alias, kept in candidates.items()
        if all(
            isinstance(s.get(alias), torch.Tensor)
            and isinstance(s.get(kept), torch.Tensor)
            and _storage_key(s[alias]) == _storage_key(s[kept])
            for s in states[1:]
        )
    }


def _as_list(state_dicts: Sequence[StateDict] | Mapping[str, StateDict]) -> tuple[list[str], list[StateDict]]:
    if isinstance(state_dicts, Mapping) and all(isinstance(v, Mapping) for v in state_dicts.values()):
        return [str(k) for k in state_dicts], list(state_dicts.values())
    if isinstance(state_dicts, Mapping):
        raise ConfigError(f"{SOURCE}: `state_dicts`: give a list of state dicts or a mapping of names to state dicts")
    return [f"model_{i}" for i in range(len(state_dicts))], list(state_dicts)


def _inputs_device(states: Sequence[StateDict]) -> torch.device:
    devices = {t.device for s in states for t in s.values() if isinstance(t, torch.Tensor)}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def merge_state_dicts(
    method: str,
    state_dicts: Sequence[StateDict] | Mapping[str, StateDict],
    base: StateDict | int | str | None = None,
    parameters: Mapping[str, Any] | None = None,
    model_parameters: Sequence[Mapping[str, Any] | None] | Mapping[str, Mapping[str, Any] | None] | None = None,
    *,
    dtype: str | None = None,
    out_dtype: str | None = None,
    random_seed: int | None = None,
    device: str | torch.device | None = None,
    tensor_set: str = "exact",
    allow_crimes: bool = False,
    unsafe_truncate_embeddings: bool = False,
) -> dict[str, torch.Tensor]:
    """Merge state dicts in memory with any registered method; returns the merged state dict.

    `state_dicts`: a list (named `model_0`, `model_1`, ... in messages) or a mapping name -> state dict.
    `base`: the base model's state dict (when it is not one of `state_dicts`), or the index or name of
    one of them. `parameters` and `model_parameters` (one mapping per state dict, or by name) are the
    config's `parameters` and `models[i].parameters`, filters (`{"filter": "mlp", "value": 0.3}` lists)
    included. `dtype`/`out_dtype` as in a config (compute in float32, output in the inputs' most common
    float dtype by default). A randomised method (DARE, DELLA, ...) draws from `random_seed` and the
    tensor's name, so the same seed gives the same bytes as a file-based merge with `--random-seed`.
    `device`: where the arithmetic runs, by default the inputs' device; results are on that device.
    `tensor_set`: "exact" refuses a tensor some inputs lack, "intersection" leaves it out, "union"
    merges it from those that hold it. Embeddings of different vocabulary sizes are refused unless
    `unsafe_truncate_embeddings` (their first rows are kept, matched by position, with a warning), as
    mergekit's --unsafe-truncate-embeddings. Problems raise ConfigError/CheckpointError with one line.
    """
    from ..engine.execution.compute import compute
    from ..engine.planning.shared import MergeOptions
    from .merge import RawPlanner, check_raw_config

    names, states = _as_list(state_dicts)
    if not states:
        raise ConfigError(f"{SOURCE}: `state_dicts` is empty")
    base_name: str | None = None
    if isinstance(base, bool):
        raise ConfigError(f"{SOURCE}: `base`: give a state dict, or the index or name of one of `state_dicts`")
    if isinstance(base, int):
        if not -len(states) <= base < len(states):
            raise ConfigError(f"{SOURCE}: `base`: index {base} is out of range for {len(states)} state dicts")
        base_name = names[base]
    elif isinstance(base, str):
        if base not in names:
            raise ConfigError(f"{SOURCE}: `base`: no state dict named {base!r} (names: {', '.join(names)})")
        base_name = base
    elif base is not None:
        base_name = "base" if "base" not in names else "__base__"
    per_model = _per_model(model_parameters, names)
    data: dict[str, Any] = {
        "merge_method": method,
        "models": [
            {"model": n, **({"parameters": dict(p)} if p is not None else {})} for n, p in zip(names, per_model)
        ],
    }
    if base_name is not None:
        data["base_model"] = base_name
    if parameters:
        data["parameters"] = dict(parameters)
    if dtype is not None:
        data["dtype"] = dtype
    if out_dtype is not None:
        data["out_dtype"] = out_dtype
    config = check_raw_config(parse_config(data, SOURCE), SOURCE)

    all_states = dict(zip(names, states))
    if base is not None and not isinstance(base, (int, str)):
        assert base_name is not None
        all_states[base_name] = base
    aliases = _aliases(list(all_states.values()))
    checkpoints: dict[str, Checkpoint] = {
        ref: InMemoryCheckpoint(ref, {k: v for k, v in s.items() if k not in aliases}) for ref, s in all_states.items()
    }
    run_on = torch.device(device) if device is not None else _inputs_device(list(all_states.values()))
    options = MergeOptions(
        random_seed=random_seed,
        copy_tokenizer=False,
        write_model_card=False,
        allow_crimes=allow_crimes,
        device=str(run_on),
        unsafe_truncate_embeddings=unsafe_truncate_embeddings,
    )
    from ..methods import require_method

    if require_method(config.merge_method, SOURCE).randomized and options.random_seed is None:
        options.random_seed = secrets.randbelow(2**31)
    plan = RawPlanner(config, checkpoints, options, SOURCE, tensor_set).build()
    for warning in plan.warnings:
        log.warning("%s", warning)
    from ..io.dtypes import to_torch

    compute_dtype = to_torch(plan.compute_dtype)
    explicit = bool(plan.options.get("explicit_dtype"))
    merged: dict[str, torch.Tensor] = {}
    for recipe in plan.recipes:
        with torch.no_grad():
            out = compute(recipe, checkpoints, compute_dtype, explicit, run_on)
        merged[recipe.name] = out if run_on.type == "cpu" else out.to(run_on)
    for alias, kept in aliases.items():
        if kept in merged:
            merged[alias] = merged[kept]
    # the first input's order, as load_state_dict and save_file users expect
    order = list(states[0]) + [n for n in merged if n not in states[0]]
    return {n: merged[n] for n in order if n in merged}


def _per_model(
    model_parameters: Sequence[Mapping[str, Any] | None] | Mapping[str, Mapping[str, Any] | None] | None,
    names: list[str],
) -> list[Mapping[str, Any] | None]:
    if model_parameters is None:
        return [None] * len(names)
    if isinstance(model_parameters, Mapping):
        unknown = [k for k in model_parameters if k not in names]
        if unknown:
            raise ConfigError(f"{SOURCE}: `model_parameters`: no state dict named {unknown[0]!r}")
        return [model_parameters.get(n) for n in names]
    if len(model_parameters) != len(names):
        raise ConfigError(
            f"{SOURCE}: `model_parameters` has {len(model_parameters)} entries for {len(names)} state dicts"
        )
    return list(model_parameters)


def merge_tensors(
    method: str,
    tensors: Sequence[torch.Tensor],
    base: torch.Tensor | int | None = None,
    parameters: Mapping[str, Any] | None = None,
    model_parameters: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    name: str = "tensor",
    dtype: str | None = None,
    out_dtype: str | None = None,
    random_seed: int | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Merge one tensor from each model (`base`: the base model's tensor, or an index into `tensors`).

    `name` is the tensor's name: parameter filters match it, and a randomised method seeds its draw from
    it, so pass the real name to get the bytes a file-based merge writes for that tensor."""
    states = [{name: t} for t in tensors]
    base_state: StateDict | int | None = base if isinstance(base, int) or base is None else {name: base}
    merged = merge_state_dicts(
        method,
        states,
        base_state,
        parameters,
        model_parameters,
        dtype=dtype,
        out_dtype=out_dtype,
        random_seed=random_seed,
        device=device,
    )
    return merged[name]
