"""Collecting the Grams: each model run on the calibration lines, X^T X of every merged linear layer's inputs summed
over the tokens, divided by their count (FusionBench's averaging, see methods/regmean.py), written per unit of work.

Never two models at once. A llama-family model (planning.STREAMED_TYPES: llama, mistral, qwen2, qwen3 share the
decoder layer's call) is streamed: its module tree is built on the meta device, the embedding rows of the lines
are looked up from the checkpoint, and then one decoder layer at a time is given its weights (read through
mergesmith's checkpoint reader, in float32), run on the cached hidden states of every line with forward pre-hooks
on its linear modules, written out (store.py) and dropped; the output head's Gram comes from the final norm's
output. Peak memory: one layer in float32, the hidden states of the lines, and that layer's Grams. Other
architectures load whole (transformers' from_pretrained, float32) with the same hooks.

Resume: a unit whose file exists is not collected again. A streamed model still runs the finished layers before
the first missing one (without hooks) to rebuild that layer's inputs: the hidden states are not kept on disk.
Lines are run one at a time (no padding: every token counted is a real one), each with its own causal mask.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, MergeInterrupted
from ..io.references import open_checkpoint
from ..runtime.intra_op_threads import shared_between
from .planning import read_calibration
from .store import WHOLE_FILE, finished, gram_ref, layer_file, store_dir, write_grams

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint

LAYER_PREFIX = "model.layers."


def layer_of(module: str) -> int | None:
    """The decoder layer a module belongs to (`model.layers.<i>.`), None outside the layers (the output head)."""
    if not module.startswith(LAYER_PREFIX):
        return None
    index = module[len(LAYER_PREFIX) :].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def units(entry: dict[str, Any]) -> dict[str, list[str]]:
    """File name -> the modules whose Grams it holds, for one model's plan entry."""
    if entry["mode"] != "layers":
        return {WHOLE_FILE: list(entry["modules"])}
    out: dict[str, list[str]] = {}
    for module in entry["modules"]:
        out.setdefault(layer_file(layer_of(module)), []).append(module)
    return out


class GramSink:
    """Forward pre-hooks that add each input's X^T X (float32) to its module's sum, and count the tokens.

    q/k/v (and gate/up) read the same tensor: its product is computed once and added to each."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles: list[Any] = []

    def hook(self, modules: dict[str, torch.nn.Module]) -> None:
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._make(name)))

    def _make(self, name: str) -> Callable[..., None]:
        def pre_hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if self._last is not None and self._last[0] is x:
                product = self._last[1]
            else:
                flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
                product = flat.T @ flat
                self._last = (x, product)
            rows = x.numel() // x.shape[-1]
            if name in self.sums:
                self.sums[name].add_(product)
                self.tokens[name] += rows
            else:
                self.sums[name] = product.clone()
                self.tokens[name] = rows

        return pre_hook

    def add(self, name: str, x: torch.Tensor) -> None:
        """Add an input seen outside a hook (the output head's: the final norm's output)."""
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        product = flat.T @ flat
        if name in self.sums:
            self.sums[name].add_(product)
            self.tokens[name] += flat.shape[0]
        else:
            self.sums[name] = product
            self.tokens[name] = flat.shape[0]

    def close(self) -> tuple[dict[str, torch.Tensor], int]:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._last = None
        grams = {name: total / max(self.tokens[name], 1) for name, total in self.sums.items()}
        return grams, max(self.tokens.values(), default=0)


def tokenize(tokenizer_dir: str, lines: Iterable[str], max_length: int, trust_remote_code: bool) -> list[torch.Tensor]:
    """Each line's token ids (1 x length, special tokens as the tokenizer adds them), empty lines dropped."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    out = []
    for line in lines:
        ids = tokenizer(line, truncation=True, max_length=max_length)["input_ids"]
        if ids:
            out.append(torch.tensor([ids], dtype=torch.long))
    return out


def collect_grams(options: dict[str, Any], out_dir: Path, stop: threading.Event | None) -> dict[str, Checkpoint]:
    """Collect (or reuse) every model's Grams into the state directory; the checkpoints to read them from."""
    path = Path(options["calibration"])
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"`parameters.calibration`: file {str(path)!r} cannot be read ({exc.strerror})") from None
    if digest != options["calibration_sha256"]:
        raise ConfigError(f"`parameters.calibration`: file {str(path)!r} changed since the merge was planned")
    lines = read_calibration(path, int(options["num_regmean_examples"]))
    trust = bool(options.get("trust_remote_code"))
    made: dict[str, Checkpoint] = {}
    for model, entry in options["models"].items():
        pending = [name for name in units(entry) if not finished(out_dir, model, name)]
        if pending:
            ids = tokenize(entry["tokenizer"], lines, int(options["max_length"]), trust)
            if not ids:
                raise ConfigError(f"`parameters.calibration`: no line gives any token with {entry['tokenizer']}")
            # One fixed intra-op thread count (every usable core), whatever the host process set: a Gram's last
            # bits depend on how many threads summed it, and a resumed collection must match a fresh one.
            with torch.inference_mode(), shared_between(1):
                if entry["mode"] == "layers":
                    collect_streamed(model, entry, ids, out_dir, stop, trust)
                else:
                    collect_whole(model, entry, ids, out_dir, trust)
        # its ref stays the directory's path: what a Ray worker opens (execution/ray_executor.py)
        made[gram_ref(model)] = open_checkpoint(str(store_dir(out_dir, model)))
        _check_stop(stop)
    return made


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise MergeInterrupted(
            "interrupted while collecting regmean's Gram matrices; the finished ones are kept, run the same command "
            "again to resume"
        )


def _meta_model(path: str, trust: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust)


def _load_module(module: torch.nn.Module, prefix: str, ckpt: Checkpoint) -> None:
    """Give a meta-device module its weights from the checkpoint, in float32 (then it runs on the CPU)."""
    state = {name: ckpt.get(prefix + name).to(torch.float32) for name, _ in module.named_parameters()}
    module.load_state_dict(state, strict=True, assign=True)
    meta = [name for name, b in module.named_buffers() if b.is_meta]
    if meta:
        raise RuntimeError(f"{prefix}: buffers {meta} have no values in the checkpoint")


def _call(fn: Callable[..., Any], **given: Any) -> Any:
    """Call a transformers mask function with the keywords its version takes (its names moved between versions)."""
    params = inspect.signature(fn).parameters
    aliases = {"inputs_embeds": ("inputs_embeds", "input_embeds"), "cache": ("cache", "past_key_values")}
    kwargs: dict[str, Any] = {}
    for name, value in given.items():
        for alias in aliases.get(name, (name,)):
            if alias in params:
                kwargs[alias] = value
                break
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(given["inputs_embeds"].shape[1])
    return fn(**kwargs)


def _masks(config: Any, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The attention masks of one line by layer type, as the model's own forward builds them."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    given = {"config": config, "inputs_embeds": hidden, "attention_mask": None, "cache": None,
             "position_ids": positions}
    masks = {"full_attention": _call(create_causal_mask, **given)}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = _call(create_sliding_window_causal_mask, **given)
    return masks


def _layer_type(config: Any, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[index])
    if getattr(config, "model_type", None) == "mistral" and getattr(config, "sliding_window", None):
        return "sliding_attention"
    return "full_attention"


def collect_streamed(
    model: str, entry: dict[str, Any], ids: list[torch.Tensor], out_dir: Path, stop: threading.Event | None,
    trust: bool,
) -> None:
    """One decoder layer at a time (see the module docstring)."""
    plan = units(entry)
    pending = {name for name in plan if not finished(out_dir, model, name)}
    ckpt = open_checkpoint(entry["path"])
    skeleton = _meta_model(entry["path"], trust)
    inner = skeleton.model  # type: ignore[attr-defined]
    config = skeleton.config
    layers = inner.layers
    head = layer_file(None)
    # the last layer to run: the last one, when the head's Gram (the final norm's output) is wanted
    last = len(layers) - 1 if head in pending else max(layer_of(plan[name][0]) or 0 for name in pending)

    embedding = ckpt.get("model.embed_tokens.weight").to(torch.float32)
    hidden = [torch.nn.functional.embedding(x, embedding) for x in ids]
    del embedding
    rotary = type(inner.rotary_emb)(config=config)
    positions = [torch.arange(h.shape[1]).unsqueeze(0) for h in hidden]
    rope = [rotary(h, p) for h, p in zip(hidden, positions)]
    masks = [_masks(config, h, p) for h, p in zip(hidden, positions)]

    for index, layer in enumerate(layers):
        if index > last:
            break
        name = layer_file(index)
        collecting = name in pending
        _load_module(layer, f"{LAYER_PREFIX}{index}.", ckpt)
        sink = GramSink()
        if collecting:
            sink.hook({m: layer.get_submodule(m[len(f"{LAYER_PREFIX}{index}.") :]) for m in plan[name]})
        kind = _layer_type(config, index)
        for j, h in enumerate(hidden):
            out = layer(h, attention_mask=masks[j][kind], position_ids=positions[j], position_embeddings=rope[j])
            hidden[j] = out[0] if isinstance(out, tuple) else out
        grams, tokens = sink.close()
        layer.to("meta")
        if collecting:
            write_grams(out_dir, model, name, grams, tokens)
        _check_stop(stop)
    if head in pending:
        extra = set(plan[head]) - {"lm_head"}
        if extra:
            raise RuntimeError(f"model {model!r}: linear modules outside the layers besides lm_head: {sorted(extra)}")
        _load_module(inner.norm, "model.norm.", ckpt)
        sink = GramSink()
        for h in hidden:
            sink.add("lm_head", inner.norm(h))
        grams, tokens = sink.close()
        write_grams(out_dir, model, head, grams, tokens)


def collect_whole(model: str, entry: dict[str, Any], ids: list[torch.Tensor], out_dir: Path, trust: bool) -> None:
    """The whole model loaded by transformers (float32), hooks on every merged linear module."""
    from transformers import AutoModelForCausalLM

    try:
        net = AutoModelForCausalLM.from_pretrained(entry["path"], dtype=torch.float32, trust_remote_code=trust)
    except TypeError:  # transformers before `dtype` was the keyword's name
        net = AutoModelForCausalLM.from_pretrained(entry["path"], torch_dtype=torch.float32, trust_remote_code=trust)
    net.eval()
    sink = GramSink()
    sink.hook({m: net.get_submodule(m) for m in entry["modules"]})
    for x in ids:
        net(input_ids=x, use_cache=False)
    grams, tokens = sink.close()
    del net
    write_grams(out_dir, model, WHOLE_FILE, grams, tokens)
