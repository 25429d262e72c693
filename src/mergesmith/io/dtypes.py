"""Names of dtypes as configs, torch and the safetensors format spell them, and their sizes."""

from __future__ import annotations

import functools

import torch

from ..errors import ConfigError

# safetensors header name -> torch dtype (only those torch can hold)
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        SAFETENSORS_TO_TORCH[_name] = getattr(torch, _attr)

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}

_CONFIG_NAMES: dict[str, str] = {
    "float32": "F32",
    "fp32": "F32",
    "float": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float64": "F64",
    "fp64": "F64",
    "int8": "I8",
    "uint8": "U8",
}

TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}


@functools.cache
def dtype_size(st_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (cached: a tensor's size is asked for several times a tensor,
    and making a torch scalar each time cost seconds on a merge of 18,003 tensors)."""
    return torch.empty((), dtype=SAFETENSORS_TO_TORCH[st_dtype]).element_size()


def to_torch(st_dtype: str) -> torch.dtype:
    return SAFETENSORS_TO_TORCH[st_dtype]


def from_torch(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} cannot be stored in safetensors") from None


def parse_config_dtype(name: str, key: str) -> str:
    """A config's dtype string (`bfloat16`, `float16`, `float32`, ...) as a safetensors name."""
    st = _CONFIG_NAMES.get(name.lower().removeprefix("torch."))
    if st is None:
        known = ", ".join(sorted({"float32", "float16", "bfloat16", "float64"}))
        raise ConfigError(f"config: `{key}`: unknown dtype {name!r} (use one of {known})")
    return st


def is_float(st_dtype: str) -> bool:
    return st_dtype in {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
