"""Quantized checkpoints: the two formats read (FP8 block-scaled, MXFP4) and the refusal of all others.

Why dequantize while reading instead of asking users to convert first: a DeepSeek V3 in FP8 is ~700 GB and
twice that in bfloat16; the merge only ever holds a few tensors at once, so each quantized weight is turned
into its logical float tensor when it is read (per tensor, or per row block aligned to the quantization
block) and the full-precision model never exists on disk or in memory.

- FP8 (`quant_method: fp8`, DeepSeek V3/R1, Qwen3 FP8): a `float8_e4m3fn` weight `W` of shape (..., R, C)
  beside a float32 `W_scale_inv` of shape (..., ceil(R/bm), ceil(C/bn)) for `weight_block_size: [bm, bn]`
  (one scale for the whole tensor without a block size); the value is `W * scale` per block. Presented as
  a float32 tensor (the product rounded once, as transformers' own dequantization computes it).
- MXFP4 (`quant_method: mxfp4`, gpt-oss): `P_blocks` (uint8, (E, R, G, 16): two e2m1 values per byte, low
  nibble first) and `P_scales` (uint8 e8m0 exponents biased by 127, (E, R, G)), one scale per 32 values;
  the logical tensor `P` is (E, G*32, R) (transposed: gpt-oss keeps its experts as (in, out)), bfloat16,
  which holds every e2m1 value times a power of two exactly.

Any other `quantization_config` (bitsandbytes, GPTQ, AWQ, compressed-tensors, HQQ, ...) and integer weights
written by such tools are refused when the checkpoint is opened, from its headers: merging those integers as
if they were weights would write a model that loads and produces garbage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError

FP8 = "fp8"
MXFP4 = "mxfp4"
READABLE = (FP8, MXFP4)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MXFP4_GROUP = 32  # values per e8m0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# tensor-name endings that only quantization tools write (bitsandbytes, GPTQ/AWQ, compressed-tensors, HQQ, ...)
FOREIGN_SUFFIXES = (
    ".qweight",
    ".qzeros",
    ".g_idx",
    ".absmax",
    ".quant_map",
    ".SCB",
    ".weight_packed",
    ".weight_zero_point",
    ".W_q",
)


@dataclass(frozen=True)
class QuantizedTensor:
    """One logical tensor stored quantized: its parts' names, the format and the block it is cut in."""

    kind: str  # FP8 or MXFP4
    data: str  # the stored values' tensor name
    scale: str  # the scales' tensor name
    block: tuple[int, int] | None  # FP8's (rows, cols) per scale; None: one scale for the whole tensor
    shape: tuple[int, ...]  # the logical shape

    @property
    def row_align(self) -> int:
        """Rows of the logical tensor a read must start and end on (a multiple of this): FP8 2-D weights are
        scaled per `block[0]` rows; tensors with a leading expert dimension are cut by whole experts."""
        if self.kind == FP8 and len(self.shape) == 2 and self.block is not None:
            return self.block[0]
        return 1


def quant_method(config: dict[str, Any] | None) -> str | None:
    """The `quant_method` a config.json declares (its own or its `text_config`'s), lower-case; None if none."""
    for holder in (config or {}, (config or {}).get("text_config") or {}):
        qc = holder.get("quantization_config") if isinstance(holder, dict) else None
        if isinstance(qc, dict):
            return str(qc.get("quant_method") or "unknown").lower()
    return None


def quantization_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    for holder in (config or {}, (config or {}).get("text_config") or {}):
        qc = holder.get("quantization_config") if isinstance(holder, dict) else None
        if isinstance(qc, dict):
            return qc
    return None


def refusal(ref: str, method: str) -> CheckpointError:
    return CheckpointError(
        f"model {ref!r} is quantized with {method}, which mergesmith cannot merge (only fp8 block-scaled and "
        "mxfp4 checkpoints are read): dequantize it first (e.g. load it in transformers and save_pretrained "
        "it in bfloat16), then merge that"
    )


def split(
    ref: str, config: dict[str, Any] | None, tensors: dict[str, Any], make_info: Callable[..., Any]
) -> tuple[dict[str, Any], dict[str, QuantizedTensor]]:
    """(logical tensors, quantized map) of a checkpoint's headers: quantized weights replaced by their logical
    float tensor (`make_info(stored_info, dtype, shape)`), their scales left out; raises the one-line
    refusal for a quantization that cannot be read. Reads no tensor data."""
    method = quant_method(config)
    if method is None:
        foreign = next((n for n in tensors if n.endswith(FOREIGN_SUFFIXES)), None)
        if foreign is not None:
            raise refusal(ref, f"a quantization tool (tensor {foreign!r}, no quantization_config)")
        integer = next((i for n, i in tensors.items() if _integer_weight(n, i.dtype, i.shape)), None)
        if integer is not None:
            raise refusal(ref, f"integer weights (tensor {integer.name!r} is {integer.dtype}, no quantization_config)")
        return tensors, {}
    if method not in READABLE:
        raise refusal(ref, method)
    qc = quantization_config(config) or {}
    out = dict(tensors)
    found: dict[str, QuantizedTensor] = {}
    if method == FP8:
        block = _fp8_block(ref, qc)
        for name, info in tensors.items():
            scale = f"{name}_scale_inv"
            if scale not in tensors:
                continue
            if info.dtype != "F8_E4M3":
                raise CheckpointError(f"model {ref!r}: fp8 tensor {name!r} is stored as {info.dtype}, not F8_E4M3")
            _check_fp8_scale(ref, name, info.shape, tensors[scale].shape, block)
            found[name] = QuantizedTensor(FP8, name, scale, block, tuple(info.shape))
            out[name] = make_info(info, "F32", tuple(info.shape))
            del out[scale]
        left = next((n for n, i in out.items() if i.dtype == "F8_E4M3"), None)
        if left is not None:
            raise CheckpointError(f"model {ref!r}: fp8 tensor {left!r} has no {left}_scale_inv beside it")
    else:
        for name, info in tensors.items():
            if not name.endswith("_blocks"):
                continue
            logical = name[: -len("_blocks")]
            scale = f"{logical}_scales"
            if scale not in tensors:
                raise CheckpointError(f"model {ref!r}: mxfp4 tensor {name!r} has no {scale!r} beside it")
            shape = tuple(info.shape)
            if len(shape) < 3 or shape[-1] * 2 != MXFP4_GROUP or tuple(tensors[scale].shape) != shape[:-1]:
                raise CheckpointError(
                    f"model {ref!r}: mxfp4 tensors {name!r} {list(shape)} and {scale!r} "
                    f"{list(tensors[scale].shape)} are not (..., rows, groups, 16) and (..., rows, groups)"
                )
            lshape = (*shape[:-3], shape[-2] * MXFP4_GROUP, shape[-3])
            found[logical] = QuantizedTensor(MXFP4, name, scale, None, lshape)
            out[logical] = make_info(info, "BF16", lshape)
            del out[name], out[scale]
    return out, found


def _integer_weight(name: str, dtype: str, shape: tuple[int, ...]) -> bool:
    """A matrix of integers where a model keeps float weights: what quantization tools leave without a config."""
    return name.endswith(".weight") and len(shape) >= 2 and dtype in ("I8", "U8", "I16", "I32", "U32")


def _fp8_block(ref: str, qc: dict[str, Any]) -> tuple[int, int] | None:
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"model {ref!r}: config.json `quantization_config.weight_block_size` is not [rows, cols]")
    return block[0], block[1]


def _check_fp8_scale(
    ref: str, name: str, shape: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int] | None
) -> None:
    if block is None or len(shape) < 2:
        expected: tuple[int, ...] | None = None if math.prod(scale) == 1 else tuple(shape)
    else:
        expected = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    if expected is not None and tuple(scale) != expected:
        raise CheckpointError(
            f"model {ref!r}: {name}_scale_inv has shape {list(scale)}, expected {list(expected)} for "
            f"{name} {list(shape)} in blocks of {list(block) if block else 'one'}"
        )


# ----- dequantization ----------------------------------------------------------------------------------
def dequantize(q: QuantizedTensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The logical tensor of stored values `data` and their `scale` (or of rows of both, cut on block
    boundaries: `row_align`)."""
    if q.kind == FP8:
        return dequantize_fp8(data, scale, q.block)
    return dequantize_mxfp4(data, scale)


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 `data * scale` with one scale per `block` of the last two dimensions (the edge blocks may be
    partial); the weight-sized temporary is the output itself (scaled in place, block row by block row)."""
    out = data.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None or out.dim() < 2:
        return out.mul_(scale.reshape(()) if scale.numel() == 1 else scale)
    rows, cols = out.shape[-2:]
    bm, bn = block
    for i in range(scale.shape[-2]):
        r0, r1 = i * bm, min((i + 1) * bm, rows)
        per_col = scale[..., i, :].repeat_interleave(bn, dim=-1)[..., :cols]  # (..., cols)
        out[..., r0:r1, :].mul_(per_col.unsqueeze(-2))
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bfloat16 (..., G*32, R) of `blocks` (..., R, G, 16) and e8m0 `scales` (..., R, G), a few thousand rows
    at a time: the table lookups' index tensors stay small beside the output (a gpt-oss-120b expert tensor is
    2 G values)."""
    *lead, rows, groups, _ = blocks.shape
    packed, exponents = blocks.reshape(-1, groups * 16), scales.reshape(-1, groups)
    out = torch.empty((packed.shape[0], groups * MXFP4_GROUP), dtype=torch.bfloat16)
    table = torch.tensor(E2M1_VALUES, dtype=torch.bfloat16)
    for r0, r1 in _chunks(packed.shape[0], groups * MXFP4_GROUP):
        part = packed[r0:r1].to(torch.uint8)
        values = torch.stack((table[(part & 0x0F).int()], table[(part >> 4).int()]), dim=-1)
        values = values.reshape(r1 - r0, groups, MXFP4_GROUP)
        exponent = exponents[r0:r1].to(torch.int32).sub_(127).unsqueeze(-1)
        out[r0:r1] = torch.ldexp(values, exponent).reshape(r1 - r0, -1)
    return out.reshape(*lead, rows, -1).transpose(-1, -2).contiguous()


CHUNK_VALUES = 1 << 20


def _chunks(rows: int, per_row: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_VALUES // max(per_row, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


# ----- quantization (the output side) ------------------------------------------------------------------
def stored_layout(name: str, shape: tuple[int, ...], spec: tuple[Any, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors a logical tensor `name` of `shape` is written as under `spec`
    (("fp8", rows, cols), ("fp8",): one scale, or ("mxfp4",)), in the layout the reader above expects."""
    if spec[0] == FP8:
        if len(spec) == 3 and len(shape) >= 2:
            grid = (*shape[:-2], -(-shape[-2] // spec[1]), -(-shape[-1] // spec[2]))
        else:
            grid = (1,)
        return [(name, "F8_E4M3", shape), (f"{name}_scale_inv", "F32", grid)]
    *lead, cols, rows = shape
    groups = cols // MXFP4_GROUP
    return [(f"{name}_blocks", "U8", (*lead, rows, groups, 16)), (f"{name}_scales", "U8", (*lead, rows, groups))]


def quantize_output(name: str, tensor: torch.Tensor, spec: tuple[Any, ...]) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors (stored_layout's names, in its order) of a computed logical tensor."""
    layout = stored_layout(name, tuple(tensor.shape), spec)
    if spec[0] == FP8:
        parts = quantize_fp8(tensor, (spec[1], spec[2]) if len(spec) == 3 else None)
    else:
        parts = quantize_mxfp4(tensor)
    return [(entry[0], part) for entry, part in zip(layout, parts)]


def quantize_fp8(tensor: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale_inv) of `tensor` with fresh scales: scale = amax / 448 per block
    (1 for an all-zero block), so each block's largest magnitude maps to the largest finite FP8 value. One block
    row at a time: the float32 temporaries are one block row, not a second copy of the tensor."""
    if block is None or tensor.dim() < 2:
        x = tensor.to(torch.float32)
        amax = x.abs().amax()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(1)
    rows, cols = tensor.shape[-2:]
    bm, bn = block
    sr, sc = -(-rows // bm), -(-cols // bn)
    q = torch.empty(tensor.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((*tensor.shape[:-2], sr, sc), dtype=torch.float32)
    for i in range(sr):
        r0, r1 = i * bm, min((i + 1) * bm, rows)
        part = tensor[..., r0:r1, :].to(torch.float32)
        padded = torch.nn.functional.pad(part, (0, sc * bn - cols)) if cols % bn else part
        amax = padded.abs().unflatten(-1, (sc, bn)).amax(dim=(-3, -1))  # (..., sc)
        scale[..., i, :] = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        per_col = scale[..., i, :].repeat_interleave(bn, dim=-1)[..., :cols].unsqueeze(-2)
        q[..., r0:r1, :] = (part / per_col).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_mxfp4(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 (..., R, G, 16), scales uint8 (..., R, G)) of a logical (..., G*32, R) tensor: per group
    of 32 the e8m0 exponent is the smallest power of two that brings the group's amax within e2m1's 6.0,
    values are rounded to the nearest e2m1 value. A few thousand rows at a time (the nearest-value search
    compares each value with 8 magnitudes)."""
    x = tensor.transpose(-1, -2)  # (..., R, G*32)
    *lead, rows, cols = x.shape
    groups = cols // MXFP4_GROUP
    flat = x.reshape(-1, cols)
    blocks = torch.empty((flat.shape[0], groups, 16), dtype=torch.uint8)
    scales = torch.empty((flat.shape[0], groups), dtype=torch.uint8)
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    for r0, r1 in _chunks(flat.shape[0], cols):
        part = flat[r0:r1].to(torch.float32).unflatten(-1, (groups, MXFP4_GROUP))  # (k, G, 32)
        amax = part.abs().amax(dim=-1)
        exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
        scaled = part / torch.exp2(exponent).unsqueeze(-1)
        magnitude = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)  # nearest of the 8 magnitudes
        codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
        blocks[r0:r1] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales[r0:r1] = (exponent + 127).to(torch.uint8)
    return blocks.reshape(*lead, rows, groups, 16), scales.reshape(*lead, rows, groups)
