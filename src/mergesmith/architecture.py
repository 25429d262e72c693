"""Architecture-agnostic layer mapping, without per-architecture tables.

A transformer checkpoint names its decoder blocks `<prefix>.<N>.<rest>`. We find the stack whose
number of distinct indices equals the config's layer count; everything else is a non-layer tensor,
either before the stack (embeddings) or after it (final norm, lm_head). That is enough to slice,
stack and merge any decoder-only model transformers can load, including ones we have never seen.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .dtypes import TORCH_NAMES

_LAYER_RE = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EMBEDDING_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings")
LM_HEAD_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")
PER_LAYER_KEYS = frozenset(
    {
        "layer_types",  # qwen2/3, gemma2/3, gpt-oss, exaone4, ...: "full_attention" / "sliding_attention" per layer
        "no_rope_layers",  # llama4, smollm3: 1 where a layer uses RoPE
        "sliding_window_pattern",  # where given as a list (elsewhere an int period, which is left alone)
        "attn_type_list",  # minimax: linear or softmax attention per layer
        "layers_block_type",  # zamba2: "mamba" / "hybrid" per layer
        "block_configs",  # nemotron-nas (DeciLM): one block description per layer
    }
)
"""config.json lists with one entry per decoder layer: re-indexed when slices change the layers.
Only these: token ids (`eos_token_id: [2, 3]`) and lists of layer *indices* (`mlp_only_layers`,
`moe_layers`) are not per-layer lists, whatever their length."""


@dataclass(frozen=True)
class LayerStack:
    """The decoder blocks: `<prefix>.<index>.<rest>` for index in range(count)."""

    prefix: str
    count: int

    def split(self, name: str) -> tuple[int, str] | None:
        """(layer index, rest of the name) for a tensor of this stack, else None."""
        if not name.startswith(self.prefix + "."):
            return None
        m = _LAYER_RE.match(name)
        if m is None or m.group("prefix") != self.prefix:
            return None
        return int(m.group("index")), m.group("rest")

    def name(self, index: int, rest: str) -> str:
        return f"{self.prefix}.{index}.{rest}"


def layer_count_key(config: dict[str, Any] | None) -> tuple[tuple[str, ...], int] | None:
    """Where the config keeps its layer count (a key path) and the count itself."""
    if not config:
        return None
    for key in _LAYER_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return (key,), value
    text = config.get("text_config")
    if isinstance(text, dict):
        for key in _LAYER_COUNT_KEYS:
            value = text.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return ("text_config", key), value
    return None


def find_layer_stack(names: Iterable[str], config: dict[str, Any] | None) -> LayerStack | None:
    """The stack whose indices are exactly 0..n-1 with n the config's layer count.

    Without a layer count in the config, a single candidate stack is taken as the layers. Where
    several stacks match (a vision tower as deep as the text model), the one holding the most
    tensors wins: it is the language model in every architecture we know.
    """
    indices: dict[str, set[int]] = defaultdict(set)
    tensors: dict[str, int] = defaultdict(int)
    for name in names:
        m = _LAYER_RE.match(name)
        if m:
            indices[m.group("prefix")].add(int(m.group("index")))
            tensors[m.group("prefix")] += 1
    found = layer_count_key(config)
    if found is not None:
        want = found[1]
        candidates = [p for p, idx in indices.items() if idx == set(range(want))]
    else:
        candidates = [p for p, idx in indices.items() if idx == set(range(len(idx)))]
        if len(candidates) != 1:
            return None
    if not candidates:
        return None
    best = max(candidates, key=lambda p: (tensors[p], -len(p)))
    return LayerStack(best, len(indices[best]))


def stack_in_tensors(names: Iterable[str]) -> LayerStack | None:
    """The layer stack the tensor names show on their own, whatever config.json says: the stack with indices
    0..n-1 holding the most tensors (for messages about a config whose layer count matches no stack)."""
    indices: dict[str, set[int]] = defaultdict(set)
    tensors: dict[str, int] = defaultdict(int)
    for name in names:
        m = _LAYER_RE.match(name)
        if m:
            indices[m.group("prefix")].add(int(m.group("index")))
            tensors[m.group("prefix")] += 1
    candidates = [p for p, idx in indices.items() if idx == set(range(len(idx)))]
    if not candidates:
        return None
    best = max(candidates, key=lambda p: (tensors[p], -len(p)))
    return LayerStack(best, len(indices[best]))


OPTIONAL_TENSOR_SUFFIXES = ("inv_freq", "masked_bias", "position_ids")
"""Buffers some checkpoints save and others do not (transformers recomputes them): rotary `inv_freq`
(older Llama/Mistral saves), GPT-2's `attn.masked_bias`, BERT-style `embeddings.position_ids`. A merge whose
models disagree about one copies it from the model the output follows, or leaves it out if that model lacks it."""


def is_optional_tensor(name: str) -> bool:
    """Whether a tensor (or a layer tensor's tail) is a buffer that may be missing from some models."""
    last = name.rsplit(".", 1)[-1]
    return last in OPTIONAL_TENSOR_SUFFIXES


def is_embedding(name: str) -> bool:
    """Non-layer tensors that sit before the layer stack (token and position embeddings).

    Output heads are never embeddings, even where their name says "embed" (GPT-NeoX's `embed_out`): they sit
    after the stack and come from the last slice's models.
    """
    if any(name == h or name.endswith("." + h) for h in LM_HEAD_NAMES):
        return False
    lowered = name.lower()
    return any(marker in lowered for marker in _EMBEDDING_MARKERS)


def ties_embeddings(config: dict[str, Any] | None, tensor_names: Iterable[str]) -> bool:
    """Whether the model's output head is its input embedding.

    The config's `tie_word_embeddings` decides when present (top level or text_config); otherwise a
    checkpoint without any lm_head tensor is tied (as transformers assumes by default).
    """
    for scope in (config or {}, (config or {}).get("text_config") or {}):
        if isinstance(scope, dict) and "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"])
    names = set(tensor_names)
    return not any(h in names for h in LM_HEAD_NAMES)


def embedding_for_head(tensor_names: Iterable[str], stack: LayerStack | None) -> str | None:
    """The input-embedding tensor a tied model uses as its lm_head."""
    candidates = [
        n
        for n in tensor_names
        if n.endswith(".weight")
        and is_embedding(n)
        and (stack is None or stack.split(n) is None)
        and "position" not in n
        and "wpe" not in n
    ]
    preferred = [n for n in candidates if "embed_tokens" in n or n.endswith("wte.weight")]
    pool = preferred or candidates
    return sorted(pool, key=len)[0] if pool else None


def rewrite_config(
    config: dict[str, Any], layer_sources: list[int] | None, out_dtype: str, vocab_size: int | None = None
) -> dict[str, Any]:
    """The output config.json: layer count and per-layer lists for the slices, dtype, vocab size.

    `layer_sources[i]` is the source layer index of output layer i; a per-layer list (a key of
    PER_LAYER_KEYS, such as `layer_types`, as long as the old layer count) is re-indexed the same way.
    Other lists are left alone even when their length happens to equal the layer count: token ids
    (`eos_token_id: [2, 3]` in a 2-layer model), `architectures`, lists of layer indices.
    """
    out = copy.deepcopy(config)
    found = layer_count_key(out)
    if layer_sources is not None and found is not None:
        path, old_count = found
        scope = out if len(path) == 1 else out[path[0]]
        scope[path[-1]] = len(layer_sources)
        for holder in (out, out.get("text_config")):
            if not isinstance(holder, dict):
                continue
            for key, value in list(holder.items()):
                if key in PER_LAYER_KEYS and isinstance(value, list) and len(value) == old_count:
                    holder[key] = [value[min(src, old_count - 1)] for src in layer_sources]
    dtype_name = TORCH_NAMES[out_dtype]
    wrote = False
    for holder in (out, out.get("text_config")):
        if isinstance(holder, dict):
            for key in ("torch_dtype", "dtype"):
                if key in holder:
                    holder[key] = dtype_name
                    wrote = True
    if not wrote:
        out["torch_dtype"] = dtype_name
    if vocab_size is not None:
        holder = out if "vocab_size" in out or not isinstance(out.get("text_config"), dict) else out["text_config"]
        holder["vocab_size"] = vocab_size
    return out
