"""What a plan writes for inputs that were quantized (io/quantized.py reads them dequantized).

By default the output is a plain model in the output dtype (the `out_dtype` rules), so the inputs'
`quantization_config` is dropped from config.json: left there, transformers would look for scale tensors the
output does not have. With `--out-quantization` the tensors that were quantized in the inputs are written
quantized again, in the same format and block size with fresh scales, and the inputs' quantization_config is
kept, so a merge of 700 GB FP8 models is a 700 GB FP8 model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...errors import ConfigError
from ...io.checkpoint import Checkpoint
from ...io.quantized import FP8, MXFP4, quantization_config
from ..plan import TensorRecipe

MODES = ("none", "same", FP8, MXFP4)
"""--out-quantization: none (default), same (each tensor as its inputs stored it), or the one format asked for,
which must be the inputs'."""


def quantize_outputs(
    recipes: list[TensorRecipe],
    output_config: dict[str, Any],
    checkpoints: dict[str, Checkpoint],
    mode: str,
    source: str = "--out-quantization",
) -> list[TensorRecipe]:
    """The recipes, those to write quantized marked so (TensorRecipe.quantize); `output_config` loses or gets
    the quantization_config accordingly (edited in place)."""
    if mode not in MODES:
        raise ConfigError(f"{source}: unknown value {mode!r} (use one of {', '.join(MODES)})")
    _drop_quantization_config(output_config)
    if mode == "none":
        return recipes
    out: list[TensorRecipe] = []
    kept: dict[str, Any] | None = None
    for recipe in recipes:
        spec, config = _input_quantization(recipe, checkpoints)
        if spec is None or (mode != "same" and spec[0] != mode):
            out.append(recipe)
            continue
        out.append(replace(recipe, dtype="F32", quantize=spec))
        kept = kept or config
    if kept is None:
        what = "quantized" if mode == "same" else mode
        raise ConfigError(f"{source} {mode}: no input tensor of this merge is stored {what}, nothing to quantize")
    holder = output_config["text_config"] if "quantization_config" in _text_config(checkpoints) else output_config
    holder["quantization_config"] = kept
    return out


def _input_quantization(
    recipe: TensorRecipe, checkpoints: dict[str, Checkpoint]
) -> tuple[tuple[Any, ...] | None, dict[str, Any] | None]:
    """The quantization spec of the first input of `recipe` that was stored quantized with the output's shape
    (a slice's layer, a model's tensor), and its model's quantization_config; (None, None) when none was."""
    if recipe.op not in ("copy", "merge"):
        return None, None
    for ref in recipe.inputs:
        ckpt = checkpoints[ref.model]
        q = ckpt.quantized.get(ref.tensor)
        if q is None or q.shape != tuple(recipe.shape) or ref.rows is not None:
            continue
        spec: tuple[Any, ...] = (FP8, *q.block) if q.kind == FP8 and q.block else (q.kind,)
        if q.kind == MXFP4 and (len(q.shape) < 2 or q.shape[-2] % 32):
            continue
        return spec, quantization_config(ckpt.config)
    return None, None


def _text_config(checkpoints: dict[str, Checkpoint]) -> dict[str, Any]:
    for ckpt in checkpoints.values():
        text = (ckpt.config or {}).get("text_config")
        if ckpt.quantized and isinstance(text, dict):
            return text
    return {}


def written_config(config: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """The config.json written for a plan: a plan that writes no quantized tensor never keeps an input's
    quantization_config (whichever planner copied the base's config: an MoE assembly, a tokenizer transplant),
    which would make transformers look for scales the output does not have."""
    if quantized:
        return config
    plain = dict(config)
    if isinstance(plain.get("text_config"), dict):
        plain["text_config"] = dict(plain["text_config"])
    _drop_quantization_config(plain)
    return plain


def _drop_quantization_config(config: dict[str, Any]) -> None:
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            holder.pop("quantization_config", None)


def describe(ckpt: Checkpoint) -> str:
    """A model's quantization in a few words, for `plan`: "none", "fp8 (blocks 128x128, 58 tensors)", ..."""
    qc = quantization_config(ckpt.config)
    if not ckpt.quantized:
        return "none" if qc is None else str(qc.get("quant_method"))
    first = next(iter(ckpt.quantized.values()))
    if first.kind == FP8:
        blocks = f"blocks {first.block[0]}x{first.block[1]}" if first.block else "one scale per tensor"
    else:
        blocks = "blocks of 32"
    return f"{first.kind} ({blocks}, {len(ckpt.quantized)} tensors)"
