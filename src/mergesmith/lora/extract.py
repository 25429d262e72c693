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
`lora_embedding_A/B` pair and the lm_head as a linear LoRA instead).

A changed bias of a factored linear layer: PEFT's `lora_bias` is one switch for the whole adapter and
gives every target a `lora_B` bias, which PEFT cannot merge into a layer without a bias (Qwen2: q/k/v
have biases, o_proj and the MLP do not). So `lora_bias` (the bias delta as `lora_B.bias`) is used
only when every factored module has a bias in the base; otherwise the adapter says `bias:
"lora_only"` and carries the fine-tune's bias of each changed layer whole as
`<module>.base_layer.bias`, which PEFT loads into the targeted layer and keeps when merging (a
note says so: with that layout, disabling the adapter in PEFT keeps the new biases).

An adapter without a single LoRA target cannot be loaded by PEFT, so when nothing survives as a
low-rank update (`--sv-epsilon` above every singular value, or only norms and vocabulary matrices
changed) extraction stops with one line instead of writing one. Tensors are read one at a time and
the adapter file is written by the streaming writer, so memory holds one weight pair plus the factors.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine.planning.architecture import LM_HEAD_NAMES, embedding_for_head, find_layer_stack, ties_embeddings
from ..errors import CheckpointError, ConfigError, OutputError
from ..io.checkpoint import Checkpoint
from ..io.dtypes import from_torch, is_float
from ..io.journal import refuse_non_directory
from ..io.lora_adapter import ADAPTER_CONFIG, PEFT_PREFIX
from ..io.lora_cache import LoraMerge
from ..io.references import open_checkpoint
from ..io.safetensors_writer import ShardWriter, write_file_atomic
from ..runtime.cache_root import cache_root
from ..runtime.devices import resolve_device

ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class ExtractResult:
    """What was written: per factored module its rank, and the modules saved whole."""

    out_dir: Path
    ranks: dict[str, int]
    modules_to_save: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)


def _factor(
    delta: torch.Tensor, max_rank: int, sv_epsilon: float, distribute_scale: bool = True
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, float]:
    """((A, B) with B @ A the best rank-r approximation of `delta`, or None when nothing is kept;
    the largest singular value). The singular values go half to each factor, or all to A when not
    `distribute_scale` (mergekit's --no-distribute-scale: B = U_r, orthonormal columns)."""
    u, s, vh = torch.linalg.svd(delta.to(torch.float32), full_matrices=False)
    top = float(s[0]) if s.numel() else 0.0
    rank = min(max_rank, s.shape[0])
    if sv_epsilon > 0:
        rank = min(rank, int((s > sv_epsilon).sum()))
    if rank == 0:
        return None, top
    if not distribute_scale:
        return (s[:rank, None] * vh[:rank], u[:, :rank].clone()), top
    root = s[:rank].sqrt()
    return (root[:, None] * vh[:rank], u[:, :rank] * root[None, :]), top


def _compile(patterns: Sequence[str], option: str) -> list[re.Pattern[str]]:
    try:
        return [re.compile(p) for p in patterns]
    except re.error as exc:
        raise ConfigError(f"`{option}`: {exc.pattern!r} is not a regular expression ({exc})") from None


def _wanted(module: str, include: list[re.Pattern[str]], exclude: list[re.Pattern[str]]) -> bool:
    """mergekit's rule: any include pattern matches (when there are any) and no exclude pattern does."""
    if include and not any(p.search(module) for p in include):
        return False
    return not any(p.search(module) for p in exclude)


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
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    save_modules: Sequence[str] = (),
    skip_undecomposable: bool = False,
    distribute_scale: bool = True,
    lora_merge: LoraMerge | None = None,
    on_module: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ExtractResult:
    """Write a PEFT LoRA adapter for `model` relative to `base` into `out_dir`.

    As mergekit-extract-lora: a module listed in `save_modules` (its full name or its last part) is saved
    whole; otherwise a module is extracted only when it matches an `include` pattern (when any are given)
    and no `exclude` pattern (re.search on the module name), except that the embedding and lm_head without
    `embed_lora` are saved whole unless excluded; a changed module that is not low-rank material is saved
    whole, or left out with `skip_undecomposable`. `lora_merge`: how `model+lora` inputs are read.
    `on_module` gets each changed module's name before its SVD; `on_progress` gets (modules looked at,
    modules in all) as it goes (the SVDs of a large model take minutes)."""
    started = time.monotonic()
    device = resolve_device(device)  # before anything is opened or written
    if max_rank < 1:
        raise ConfigError(f"`--max-rank` must be at least 1, got {max_rank}")
    if sv_epsilon < 0:
        raise ConfigError(f"`--sv-epsilon` must not be negative, got {sv_epsilon}")
    patterns = {"--include-regex": _compile(include, "--include-regex")}
    patterns["--exclude-regex"] = _compile(exclude, "--exclude-regex")
    out = Path(out_dir)
    _check_out(out, overwrite)
    if lora_merge is not None and lora_merge.materialise:
        ft, bs = (open_checkpoint(ref, lora_merge, cache_root()) for ref in (model, base))
    else:
        ft, bs = open_checkpoint(model), open_checkpoint(base)
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
    modules = _modules(list(bs.tensors))
    dev = torch.device(device)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # module -> (A, B, embedding)
    changed_bias: list[str] = []  # factored modules whose bias changed
    to_save: list[str] = []
    notes: list[str] = []
    dropped: list[str] = []
    top_sv = 0.0

    for done, (module, params) in enumerate(modules.items()):
        if on_progress is not None:
            on_progress(done, len(modules))
        changed = {p for p, name in params.items() if _differs(ft, bs, name)}
        if not changed:
            continue
        if on_module is not None:
            on_module(module)
        weight = params.get("weight")
        is_vocab = module in vocab_modules
        wanted = _wanted(module, patterns["--include-regex"], patterns["--exclude-regex"])
        if module in save_modules or module.rpartition(".")[2] in save_modules:
            to_save.append(module)
            continue
        if is_vocab and not embed_lora:
            if not any(p.search(module) for p in patterns["--exclude-regex"]):
                to_save.append(module)
            continue
        if not wanted:
            continue
        factorable = (
            weight is not None
            and len(bs.info(weight).shape) == 2
            and changed <= {"weight", "bias"}
            and "weight" in changed
            and (embed_lora or not is_vocab)
        )
        if not factorable:
            if skip_undecomposable:
                notes.append(f"{module}: changed but not a low-rank update; left out (--skip-undecomposable)")
            else:
                to_save.append(module)
            continue
        assert weight is not None
        is_embedding = is_vocab and weight == embed
        delta = ft.get(weight).to(dev, torch.float32) - bs.get(weight).to(dev, torch.float32)
        pair, top = _factor(delta.T if is_embedding else delta, max_rank, sv_epsilon, distribute_scale)
        top_sv = max(top_sv, top)
        if pair is None:
            dropped.append(module)
            if "bias" in changed:  # the bias change is real: the layer travels whole
                to_save.append(module)
                notes.append(f"{module}: weight change below --sv-epsilon but its bias changed; saved whole")
            else:
                notes.append(f"{module}: every singular value is at or below --sv-epsilon; left out")
            continue
        dtype = ft.get(weight).dtype
        factors[module] = (pair[0].to(dtype).cpu(), pair[1].to(dtype).cpu(), is_embedding)
        if "bias" in changed:
            changed_bias.append(module)

    if on_progress is not None:
        on_progress(len(modules), len(modules))
    if not factors:
        raise CheckpointError(_nothing_to_factor(model, base, to_save, dropped, vocab_modules, sv_epsilon, top_sv))
    # lora_bias applies to every target; PEFT can merge it only into layers that have a bias.
    lora_bias = bool(changed_bias) and all("bias" in modules[m] for m in factors)
    whole_bias = bool(changed_bias) and not lora_bias
    if whole_bias:
        no_bias = next(m for m in factors if "bias" not in modules[m])
        notes.append(
            f"{len(changed_bias)} changed bias(es) saved whole (bias: lora_only), not as lora_bias, since targets "
            f"such as {no_bias} have no bias; PEFT's disable_adapter() keeps the new biases"
        )
    tied = ties_embeddings(bs.config, bs.tensors) and embed is not None
    if tied and any(e for _a, _b, e in factors.values()):
        notes.append(
            f"{embed.rpartition('.')[0] if embed else 'the embedding'} is factored on a model with tied embeddings: "
            "PEFT applies its LoRA to the tied head too, and PEFT's merge_and_unload() adds it twice to the "
            "shared matrix; merge with mergesmith (`base+adapter`) or without --embed-lora"
        )
    entries, writers = _layout(ft, bs, factors, changed_bias, lora_bias, to_save, modules)
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
    _clear_out(out)
    writer = ShardWriter(out / ADAPTER_FILE, out / f".{ADAPTER_FILE}.partial", entries)
    try:
        for name, produce in writers:
            writer.write(name, produce().contiguous())
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    ranks = {m: a.shape[0] for m, (a, _b, _e) in factors.items()}
    config = _adapter_config(base, ranks, to_save, lora_bias, "lora_only" if whole_bias else "none", tied)
    write_file_atomic(out / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return ExtractResult(out, ranks, to_save, time.monotonic() - started, notes)


def _nothing_to_factor(
    model: str,
    base: str,
    to_save: list[str],
    dropped: list[str],
    vocab_modules: set[str],
    sv_epsilon: float,
    top_sv: float,
) -> str:
    """Why no module became a LoRA target (PEFT refuses an adapter without one), as one line."""
    if not to_save and not dropped:
        return f"model {model!r} is identical to the base {base!r}; there is nothing to extract"
    if dropped:
        return (
            f"no linear layer's change survives --sv-epsilon {sv_epsilon:g} (the largest singular value of "
            f"any change is {top_sv:.4g}), so the adapter would target no module and PEFT could not load it; "
            "lower --sv-epsilon"
        )
    shown = ", ".join(to_save[:3]) + (f" and {len(to_save) - 3} more" if len(to_save) > 3 else "")
    hint = "; --embed-lora factors the embedding and lm_head" if vocab_modules & set(to_save) else ""
    return (
        f"model {model!r} differs from the base only in modules that are not low-rank updates ({shown}); "
        f"an adapter with no LoRA target cannot be loaded by PEFT{hint}"
    )


def _layout(
    ft: Checkpoint,
    bs: Checkpoint,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, bool]],
    changed_bias: list[str],
    lora_bias: bool,
    to_save: list[str],
    modules: dict[str, dict[str, str]],
) -> tuple[list[tuple[str, str, tuple[int, ...]]], list[tuple[str, Callable[[], torch.Tensor]]]]:
    """The adapter file's entries (name, dtype, shape) and how to produce each tensor, in order.

    With `lora_bias` every linear target gets `lora_B.bias` (the bias delta, zero where unchanged;
    every target has a bias then). Otherwise a changed bias goes whole as `<module>.base_layer.bias`
    (PEFT's `bias: lora_only` layout)."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    producers: list[tuple[str, Callable[[], torch.Tensor]]] = []

    def add(name: str, dtype: str, shape: tuple[int, ...], produce: Callable[[], torch.Tensor]) -> None:
        entries.append((name, dtype, shape))
        producers.append((name, produce))

    for module, (a, b, is_embedding) in factors.items():
        prefix = f"{PEFT_PREFIX}{module}."
        names = ("lora_embedding_A", "lora_embedding_B") if is_embedding else ("lora_A.weight", "lora_B.weight")
        add(prefix + names[0], from_torch(a.dtype), tuple(a.shape), lambda a=a: a)
        add(prefix + names[1], from_torch(b.dtype), tuple(b.shape), lambda b=b: b)
        if lora_bias:
            name = modules[module]["bias"]
            info = ft.info(name)

            def delta(n: str = name) -> torch.Tensor:
                new = ft.get(n)
                return (new.to(torch.float32) - bs.get(n).to(torch.float32)).to(new.dtype)

            add(prefix + "lora_B.bias", info.dtype, tuple(info.shape), delta)
        elif module in changed_bias:
            name = modules[module]["bias"]
            info = ft.info(name)
            add(prefix + "base_layer.bias", info.dtype, tuple(info.shape), lambda n=name: ft.get(n))
    for module in to_save:
        for name in modules[module].values():
            info = ft.info(name)
            add(PEFT_PREFIX + name, info.dtype, tuple(info.shape), lambda n=name: ft.get(n))
    return entries, producers


def _adapter_config(
    base: str, ranks: dict[str, int], to_save: list[str], lora_bias: bool, bias: str, tied_embedding: bool
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
        "bias": bias,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "ensure_weight_tying": tied_embedding,
    }


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse early (before reading any tensor) an output that is a file or holds an adapter."""
    refuse_non_directory(out)
    existing = [p for p in (out / ADAPTER_CONFIG, out / ADAPTER_FILE) if p.exists()]
    if existing and not overwrite:
        raise OutputError(f"{out}: already holds an adapter; use --overwrite to replace it")


def _clear_out(out: Path) -> None:
    """Make the directory and drop a replaced adapter, only once there is a new one to write."""
    out.mkdir(parents=True, exist_ok=True)
    for path in (out / ADAPTER_CONFIG, out / ADAPTER_FILE):
        if path.exists():
            path.unlink()
