"""`mergesmith extract-lora`: a PEFT LoRA adapter approximating `fine-tune - base`.

Each changed linear weight's difference is factored by a truncated SVD, `delta ~= B @ A` with
`B = U_r sqrt(S_r)` and `A = sqrt(S_r) V_r^T` (the singular values split evenly, so A and B have
comparable scales), keeping `r = min(max_rank, rank)` components and, with `--sv-epsilon`, only
singular values above it. The adapter's `lora_alpha` equals its `r` and `rank_pattern` /
`alpha_pattern` give every module whose rank differs its own equal alpha, so PEFT's scale is 1
everywhere and `W + B @ A` is exactly what PEFT adds.

What cannot be a low-rank update travels whole, as PEFT's `modules_to_save`: changed norms and
other 1-D weights, modules with other changed parameters, and by default the token embedding and
lm_head (as PEFT and mergekit do for vocabulary matrices; `--embed-lora` factors the embedding as a
`lora_embedding_A/B` pair and the lm_head as a linear LoRA instead). A changed bias of a factored
linear layer is saved as `lora_B.bias` (PEFT's `lora_bias`). Tensors are read one at a time and the
adapter file is written by the streaming writer, so memory holds one weight pair plus the factors.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .architecture import LM_HEAD_NAMES, embedding_for_head, find_layer_stack, ties_embeddings
from .dtypes import from_torch, is_float
from .errors import CheckpointError, ConfigError, OutputError
from .io.checkpoint import Checkpoint
from .io.lora import ADAPTER_CONFIG, PEFT_PREFIX
from .io.safetensors_writer import ShardWriter, write_file_atomic

ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class ExtractResult:
    """What was written: per factored module its rank, and the modules saved whole."""

    out_dir: Path
    ranks: dict[str, int]
    modules_to_save: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)


def _factor(delta: torch.Tensor, max_rank: int, sv_epsilon: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) with B @ A the best rank-r approximation of `delta`, or None when nothing is kept."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float32), full_matrices=False)
    rank = min(max_rank, s.shape[0])
    if sv_epsilon > 0:
        rank = min(rank, int((s > sv_epsilon).sum()))
    if rank == 0:
        return None
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root[None, :]


def _differs(ft: Checkpoint, bs: Checkpoint, name: str) -> bool:
    """Whether a floating-point tensor changed (integer buffers are never adapter material)."""
    return is_float(bs.info(name).dtype) and not torch.equal(ft.get(name), bs.get(name))


def _modules(names: list[str]) -> dict[str, dict[str, str]]:
    """module name -> {parameter suffix: tensor name}, in checkpoint order."""
    out: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, param = name.rpartition(".")
        out.setdefault(module or name, {})[param] = name
    return out


def extract_lora(
    model: str,
    base: str,
    out_dir: str | Path,
    max_rank: int,
    *,
    sv_epsilon: float = 0.0,
    embed_lora: bool = False,
    device: str = "cpu",
    overwrite: bool = False,
    on_module: Callable[[str], None] | None = None,
) -> ExtractResult:
    """Write a PEFT LoRA adapter for `model` relative to `base` into `out_dir`."""
    started = time.monotonic()
    if max_rank < 1:
        raise ConfigError(f"`--max-rank` must be at least 1, got {max_rank}")
    if sv_epsilon < 0:
        raise ConfigError(f"`--sv-epsilon` must not be negative, got {sv_epsilon}")
    out = Path(out_dir)
    _prepare(out, overwrite)
    ft, bs = Checkpoint.open(model), Checkpoint.open(base)
    extra = sorted(set(ft.tensors) - set(bs.tensors))
    if extra:
        raise CheckpointError(f"model {model!r} has tensors the base lacks, e.g. {extra[0]!r}; not a fine-tune of it")
    for name, info in bs.tensors.items():
        if name not in ft.tensors:
            raise CheckpointError(f"model {model!r} lacks the base's tensor {name!r}")
        if ft.tensors[name].shape != info.shape:
            raise CheckpointError(
                f"tensor {name!r}: {list(ft.tensors[name].shape)} in the model, {list(info.shape)} in the base "
                "(resized vocabulary? resize the base first)"
            )

    stack = find_layer_stack(ft.tensors, ft.config)
    embed = embedding_for_head(ft.tensors, stack)
    vocab_modules = {n.rpartition(".")[0] for n in (embed, *LM_HEAD_NAMES) if n is not None and n in ft.tensors}
    dev = torch.device(device)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # module -> (A, B, embedding)
    biases: dict[str, torch.Tensor] = {}
    to_save: list[str] = []
    notes: list[str] = []

    for module, params in _modules(list(bs.tensors)).items():
        changed = {p for p, name in params.items() if _differs(ft, bs, name)}
        if not changed:
            continue
        if on_module is not None:
            on_module(module)
        weight = params.get("weight")
        is_vocab = module in vocab_modules
        factorable = (
            weight is not None
            and len(bs.info(weight).shape) == 2
            and changed <= {"weight", "bias"}
            and "weight" in changed
            and (embed_lora or not is_vocab)
        )
        if not factorable:
            to_save.append(module)
            continue
        assert weight is not None
        is_embedding = is_vocab and weight == embed
        delta = ft.get(weight).to(dev, torch.float32) - bs.get(weight).to(dev, torch.float32)
        pair = _factor(delta.T if is_embedding else delta, max_rank, sv_epsilon)
        if pair is None:
            notes.append(f"{module}: every singular value is below --sv-epsilon; left out")
            continue
        dtype = ft.get(weight).dtype
        factors[module] = (pair[0].to(dtype).cpu(), pair[1].to(dtype).cpu(), is_embedding)
        if "bias" in changed:
            bias = params["bias"]
            biases[module] = (ft.get(bias).to(torch.float32) - bs.get(bias).to(torch.float32)).to(ft.get(bias).dtype)

    if not factors and not to_save:
        raise CheckpointError(f"model {model!r} is identical to the base {base!r}; there is nothing to extract")
    tied = ties_embeddings(bs.config, bs.tensors) and embed is not None
    entries, writers = _layout(ft, factors, biases, to_save, _modules(list(bs.tensors)))
    if (
        tied
        and embed is not None
        and embed.rpartition(".")[0] in to_save
        and not any(h in bs.tensors for h in LM_HEAD_NAMES)
    ):
        # PEFT's ensure_weight_tying loads the tied head's saved copy too: give it the same matrix.
        info = ft.info(embed)
        entries.append((PEFT_PREFIX + LM_HEAD_NAMES[0], info.dtype, tuple(info.shape)))
        writers.append((PEFT_PREFIX + LM_HEAD_NAMES[0], lambda: ft.get(embed)))
    writer = ShardWriter(out / ADAPTER_FILE, out / f".{ADAPTER_FILE}.partial", entries)
    try:
        for name, produce in writers:
            writer.write(name, produce().contiguous())
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    ranks = {m: a.shape[0] for m, (a, _b, _e) in factors.items()}
    config = _adapter_config(base, ranks, to_save, bool(biases), tied)
    write_file_atomic(out / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return ExtractResult(out, ranks, to_save, time.monotonic() - started, notes)


def _layout(
    ft: Checkpoint,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, bool]],
    biases: dict[str, torch.Tensor],
    to_save: list[str],
    modules: dict[str, dict[str, str]],
) -> tuple[list[tuple[str, str, tuple[int, ...]]], list[tuple[str, Callable[[], torch.Tensor]]]]:
    """The adapter file's entries (name, dtype, shape) and how to produce each tensor, in order."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    producers: list[tuple[str, Callable[[], torch.Tensor]]] = []

    def add(name: str, dtype: str, shape: tuple[int, ...], produce: Callable[[], torch.Tensor]) -> None:
        entries.append((name, dtype, shape))
        producers.append((name, produce))

    with_bias = bool(biases)
    for module, (a, b, is_embedding) in factors.items():
        prefix = f"{PEFT_PREFIX}{module}."
        names = ("lora_embedding_A", "lora_embedding_B") if is_embedding else ("lora_A.weight", "lora_B.weight")
        add(prefix + names[0], from_torch(a.dtype), tuple(a.shape), lambda a=a: a)
        add(prefix + names[1], from_torch(b.dtype), tuple(b.shape), lambda b=b: b)
        if with_bias and not is_embedding:
            bias = biases.get(module)
            if bias is None:  # PEFT gives every targeted layer a lora_B bias once any has one
                bias = torch.zeros(b.shape[0], dtype=b.dtype)
            add(prefix + "lora_B.bias", from_torch(bias.dtype), tuple(bias.shape), lambda t=bias: t)
    for module in to_save:
        for name in modules[module].values():
            info = ft.info(name)
            add(PEFT_PREFIX + name, info.dtype, tuple(info.shape), lambda n=name: ft.get(n))
    return entries, producers


def _adapter_config(
    base: str, ranks: dict[str, int], to_save: list[str], lora_bias: bool, tied_embedding: bool
) -> dict[str, Any]:
    """adapter_config.json: alpha equal to rank everywhere (scale 1), full module names as targets."""
    r = max(ranks.values(), default=1)
    pattern = {re.escape(m): k for m, k in ranks.items() if k != r}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": r,
        "lora_alpha": r,
        "rank_pattern": pattern,
        "alpha_pattern": dict(pattern),
        "target_modules": sorted(ranks),
        "modules_to_save": to_save or None,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": lora_bias,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "ensure_weight_tying": tied_embedding,
    }


def _prepare(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: output path exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    existing = [p for p in (out / ADAPTER_CONFIG, out / ADAPTER_FILE) if p.exists()]
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds an adapter; use --overwrite to replace it")
    for path in existing:
        path.unlink()
