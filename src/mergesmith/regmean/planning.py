"""Planning a regmean merge: the calibration text and tokenizers checked, the linear weights found, their recipes
given each model's Gram as extra inputs, and the collection's cost stated. Reads headers and small files only.

Config (all under the top-level `parameters`, beside the method's `reduce_non_diagonal_ratio`):

    parameters:
      calibration: calib.txt        # a UTF-8 text file, one example per line (blank lines skipped); relative
                                    # paths are taken from the working directory, like model paths
      num_regmean_examples: 256     # how many lines (FusionBench's name and default)
      max_length: 256               # tokens per line at most

Which tensors are linear weights: a model's `nn.Linear` modules, read from its transformers class built on the meta
device (no weights), whose `<module>.weight` the checkpoint holds (so a tied output head is not one: it is the
embedding, averaged). Every model of a recipe must have the module for the recipe to be solved by RegMean.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.plan import InputRef, TensorRecipe
from ..errors import ConfigError
from ..methods.regmean import GRAMS_PARAM
from ..sizes import human_size
from .store import gram_ref

if TYPE_CHECKING:
    from ..engine.extensions import PlanningView
    from ..io.checkpoint import Checkpoint

STREAMED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types collected one decoder layer at a time (they share the decoder layer's call); others load whole."""
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""A directory with one of these has a tokenizer (tokenizer_config.json alone does not make one)."""
DEFAULTS = {"calibration": "", "num_regmean_examples": 256, "max_length": 256, "reduce_non_diagonal_ratio": 0.6}


@dataclass
class RegmeanPlan:
    recipes: list[TensorRecipe]
    warnings: list[str] = field(default_factory=list)
    plan_options: dict[str, Any] = field(default_factory=dict)
    input_bytes: dict[tuple[str, str], int] = field(default_factory=dict)


def _top_parameter(planner: PlanningView, name: str) -> Any:
    """A top-level parameter's single value (the collection has one calibration set for the whole merge)."""
    value = (planner.config.parameters or {}).get(name, DEFAULTS[name])
    if isinstance(value, list | dict) or hasattr(value, "filter"):
        raise ConfigError(f"{planner.source}: `parameters.{name}`: give one value for the whole merge")
    return value


def _positive_int(planner: PlanningView, name: str) -> int:
    value = _top_parameter(planner, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{planner.source}: `parameters.{name}`: must be a whole number of at least 1, got {value!r}")
    return value


def read_calibration(path: Path, limit: int) -> list[str]:
    """The first `limit` non-blank lines of the calibration file (stripped of the line end only)."""
    lines: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\r\n")
            if line.strip():
                lines.append(line)
                if len(lines) >= limit:
                    break
    return lines


def _calibration(planner: PlanningView, limit: int) -> tuple[Path, list[str], str]:
    raw = _top_parameter(planner, "calibration")
    key = f"{planner.source}: `parameters.calibration`"
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{key}: regmean needs a calibration text file (one example per line)")
    path = Path(raw).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{key}: file {raw!r} not found")
    try:
        lines = read_calibration(path, limit)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: file {raw!r} cannot be read as UTF-8 text ({exc})") from None
    if not lines:
        raise ConfigError(f"{key}: file {raw!r} has no non-blank line")
    return path, lines, digest


def _tokenizer_dir(planner: PlanningView, model: str) -> Path:
    """The model's own tokenizer, else the base model's; refused when neither has one."""
    for ref in (model, planner.base_ref):
        root = planner.ckpts[ref].root
        if any((root / name).is_file() for name in TOKENIZER_MARKERS):
            return root
    raise ConfigError(
        f"{planner.source}: model {model!r}: regmean runs it on the calibration text, but neither it nor the base "
        f"model has a tokenizer (no {', '.join(TOKENIZER_MARKERS[:2])} in {planner.ckpts[model].root})"
    )


@dataclass(frozen=True)
class Skeleton:
    """What the transformers class of a config says, without weights: its nn.Linear modules, and for a
    llama-family model the parameter names it needs to stream (embedding, each layer's, the final norm)."""

    linears: frozenset[str]
    stream_names: frozenset[str] | None  # None: not streamable, the model is loaded whole


_SKELETONS: dict[str, Skeleton] = {}


def linear_modules(source: str, model: str, ckpt: Checkpoint, trust_remote_code: bool) -> tuple[set[str], bool]:
    """(names of the model's nn.Linear modules whose weight the checkpoint holds, whether it streams by layer)."""
    key = json.dumps(ckpt.config or {}, sort_keys=True, default=str) + f"|{trust_remote_code}"
    if key not in _SKELETONS:  # models of one merge mostly share a config: one meta model each
        try:
            _SKELETONS[key] = _skeleton(ckpt, trust_remote_code)
        except (ImportError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise ConfigError(
                f"{source}: model {model!r}: regmean runs it with transformers, which cannot build it as a causal LM "
                f"({why})"
            ) from None
    skeleton = _SKELETONS[key]
    streamed = skeleton.stream_names is not None and skeleton.stream_names <= set(ckpt.tensors)
    return {m for m in skeleton.linears if f"{m}.weight" in ckpt.tensors}, streamed


def _skeleton(ckpt: Checkpoint, trust_remote_code: bool) -> Skeleton:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt.root), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    linears = frozenset(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if getattr(cfg, "model_type", None) not in STREAMED_TYPES or not all(hasattr(inner, p) for p in parts):
        return Skeleton(linears, None)
    names = {f"model.{n}" for n, _p in inner.named_parameters()}  # embedding, every layer's, the final norm
    return Skeleton(linears, frozenset(names))


def plan_regmean(planner: PlanningView, recipes: list[TensorRecipe]) -> RegmeanPlan:
    """Check the calibration set and tokenizers, find the linear weights, and give their recipes the Grams."""
    if not getattr(planner, "needs_model_config", True):
        raise ConfigError(f"{planner.source}: regmean runs the models, so it merges models, not bare state dicts")
    examples = _positive_int(planner, "num_regmean_examples")
    max_length = _positive_int(planner, "max_length")
    ratio = _top_parameter(planner, "reduce_non_diagonal_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise ConfigError(f"{planner.source}: `parameters.reduce_non_diagonal_ratio`: must be in [0, 1], got {ratio!r}")
    path, lines, digest = _calibration(planner, examples)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{planner.source}: `merge_method: regmean` runs the models with transformers, which is not installed "
            "(pip install 'mergesmith[hf]')"
        ) from None

    contributing = sorted({ref.model for r in recipes if r.op == "merge" for ref in r.inputs})
    models: dict[str, dict[str, Any]] = {}
    linears: dict[str, set[str]] = {}
    token_counts: dict[str, int] = {}
    for model in contributing:
        tokenizer = _tokenizer_dir(planner, model)
        if str(tokenizer) not in token_counts:
            token_counts[str(tokenizer)] = _count_tokens(planner, model, tokenizer, lines, max_length)
        ckpt = planner.ckpts[model]
        linears[model], streamed = linear_modules(planner.source, model, ckpt, planner.options.trust_remote_code)
        models[model] = {
            "path": str(ckpt.root),
            "tokenizer": str(tokenizer),
            "mode": "layers" if streamed else "whole",
            "tokens": token_counts[str(tokenizer)],
            "modules": [],
        }

    out: list[TensorRecipe] = []
    input_bytes: dict[tuple[str, str], int] = {}
    needed: dict[str, set[str]] = {m: set() for m in models}
    for recipe in recipes:
        modules = [_linear_module(ref, linears) for ref in recipe.inputs] if recipe.op == "merge" else []
        if not modules or any(m is None for m in modules) or len(recipe.shape) != 2:
            out.append(recipe)
            continue
        grams: list[InputRef] = []
        for ref, module in zip(recipe.inputs, modules):
            assert module is not None
            needed[ref.model].add(module)
            grams.append(InputRef(gram_ref(ref.model), module))
            input_bytes[(gram_ref(ref.model), module)] = recipe.shape[1] * recipe.shape[1] * 4
        out.append(
            TensorRecipe(
                name=recipe.name,
                shape=recipe.shape,
                dtype=recipe.dtype,
                op=recipe.op,
                inputs=(*recipe.inputs, *grams),
                method=recipe.method,
                base_index=recipe.base_index,
                model_params=(*recipe.model_params, *(() for _ in grams)),
                params=(*recipe.params, (GRAMS_PARAM, True)),
                seed=recipe.seed,
                quantize=recipe.quantize,
            )
        )
    for model, entry in models.items():
        entry["modules"] = sorted(needed[model])
    models = {m: e for m, e in models.items() if e["modules"]}
    solved = sum(1 for r in out if dict(r.params).get(GRAMS_PARAM))
    gram_bytes = sum(input_bytes.values())
    whole = [m for m, e in models.items() if e["mode"] == "whole"]
    tokens = sum(e["tokens"] for e in models.values())
    flops = sum(_forward_flops(planner.ckpts[m], linears[m], e["modules"], e["tokens"]) for m, e in models.items())
    description = (
        f"collect input Gram matrices of {solved} linear weights: {len(models)} models x {len(lines)} calibration "
        f"lines = {len(models) * len(lines)} forward passes over {tokens} tokens (about {_flop_text(flops)}), "
        + (
            "one decoder layer in memory at a time"
            if not whole
            else f"{', '.join(repr(m) for m in whole)} loaded whole in float32 (not a llama-family model: those "
            "stream one decoder layer at a time)"
        )
        + f"; {human_size(gram_bytes)} of Grams in the output's state directory until the merge completes"
    )
    warnings: list[str] = []
    if not solved:
        warnings.append(
            "regmean: no tensor is the weight of a linear layer every model has (transformers' nn.Linear modules; "
            "GPT-2's Conv1D is not one), so every tensor is the simple average"
        )
    if planner.compute_dtype not in ("F32", "F64"):
        warnings.append("regmean: `dtype` below float32 rounds the Gram matrices before the solve; leave it unset")
    options = {
        "regmean": {
            "description": description,
            "calibration": str(path),
            "calibration_sha256": digest,
            "lines": len(lines),
            "num_regmean_examples": examples,
            "max_length": max_length,
            "gram_bytes": gram_bytes,
            "models": models,
            "trust_remote_code": planner.options.trust_remote_code,
        }
    }
    return RegmeanPlan(out, warnings, options, input_bytes)


def _count_tokens(planner: PlanningView, model: str, tokenizer: Path, lines: list[str], max_length: int) -> int:
    """The tokens the collection will run through a model (the cost `plan` states); a tokenizer that makes none of
    the lines into tokens is refused here rather than after the merge started."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=planner.options.trust_remote_code)
        count = sum(len(tok(line, truncation=True, max_length=max_length)["input_ids"]) for line in lines)
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split())
        where = f"{planner.source}: model {model!r}"
        raise ConfigError(f"{where}: its tokenizer in {tokenizer} cannot be loaded ({why})") from None
    if count == 0:
        raise ConfigError(
            f"{planner.source}: `parameters.calibration`: the tokenizer of model {model!r} ({tokenizer}) makes no "
            "token of any calibration line"
        )
    return count


def _forward_flops(ckpt: Checkpoint, linears: set[str], collected: list[str], tokens: int) -> int:
    """Multiply-adds x 2 of a model's forward passes through its linear layers plus its Gram products (X^T X per
    collected module): what dominates the collection (attention scores over lines this short are small beside)."""
    matmul = sum(math.prod(ckpt.info(f"{m}.weight").shape) for m in linears)
    grams = sum(ckpt.info(f"{m}.weight").shape[-1] ** 2 for m in collected)
    return 2 * tokens * (matmul + grams)


def _flop_text(flops: int) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops} FLOP"


def _linear_module(ref: InputRef, linears: dict[str, set[str]]) -> str | None:
    if not ref.tensor.endswith(".weight"):
        return None
    module = ref.tensor[: -len(".weight")]
    return module if module in linears.get(ref.model, set()) else None
