"""Architecture-agnostic layer mapping, without per-architecture tables.

A transformer checkpoint names its decoder blocks `<prefix>.<N>.<rest>`. We find the stack whose
number of distinct indices equals the config's layer count; everything else is a non-layer tensor,
either before the stack (embeddings) or after it (final norm, lm_head). That is enough to slice,
stack and merge any decoder-only model transformers can load, including ones we have never seen.

What inference cannot know is which config.json keys describe the layers one by one: those must be rewritten
when slices change the depth. They are listed below (PER_LAYER_KEYS, LAYER_INDEX_KEYS); a new architecture with
such a key adds it there, or, from outside the package, registers it (register_per_layer_key,
register_layer_index_key). See the README's "Adding an architecture".
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...io.dtypes import TORCH_NAMES

_LAYER_RE = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EMBEDDING_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings")
LM_HEAD_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")
PER_LAYER_KEYS: set[str] = {
    "indexer_types",  # glm_moe_dsa, hy_v4: the sparse-attention indexer of each layer
    "num_attention_heads_per_layer",  # laguna
    "activation_sparsity_pattern",  # gemma3n: the MLP activation sparsity of each layer
    "intermediate_size",  # gemma3n: a list with one MLP width per layer (an int elsewhere, left alone)
    "layer_rope_theta",  # granite_swa, granitemoe_swa: the rotary base of each layer
    "attention_layers",  # gpt_neo: "global" / "local" per layer (its `attention_types` is rewritten to match)
    "mlp_layer_types",  # deepseek_v32/v4, cohere2_moe, bailing_hybrid, ...: "dense" / "sparse" MLP per layer
    "layer_types",  # qwen2/3, gemma2/3, gpt-oss, exaone4, ...: "full_attention" / "sliding_attention" per layer
    "no_rope_layers",  # llama4, smollm3: 1 where a layer uses RoPE
    "sliding_window_pattern",  # where given as a list (elsewhere an int period, which is left alone)
    "attn_type_list",  # minimax: linear or softmax attention per layer
    "layers_block_type",  # zamba2: "mamba" / "hybrid" per layer
    "block_configs",  # nemotron-nas (DeciLM): one block description per layer
}
"""config.json lists with one entry per decoder layer: re-indexed when slices change the layers.
Only these: token ids (`eos_token_id: [2, 3]`) are not per-layer lists, whatever their length; lists of
layer *indices* are LAYER_INDEX_KEYS."""
PER_LAYER_STRING_KEYS: set[str] = {
    "hybrid_override_pattern",  # nemotron_h: one character per layer ("M" mamba, "*" attention, "-" MLP, "E" MoE)
}
"""config.json strings with one character per decoder layer: re-indexed like PER_LAYER_KEYS, written back as a
string (a list there would not load)."""
PER_LAYER_DICT_KEYS: set[str] = {
    "per_layer_config",  # gemma4: {"05": {"head_dim": 512}, ...}, overrides keyed by (zero-padded) layer index
}
"""config.json dicts keyed by layer index: an output layer gets its source layer's entry, under its own index."""
SECOND_COUNT_KEYS = ("num_blocks",)
"""Counts some configs keep beside `num_hidden_layers` (xlstm's `num_blocks` builds the blocks): rewritten with
it where they equal the old depth."""
DEPTH_KEYS = ("layers_block_type", "hybrid_override_pattern")
"""Per-layer lists or strings that are the only statement of the depth in some configs (nemotron_h in
transformers 5 has no `num_hidden_layers`: its length is that of `layers_block_type`)."""
LAYER_INDEX_KEYS: set[str] = {
    "mlp_only_layers",  # qwen2_moe, qwen3_moe: indices of the layers with a dense MLP
    "moe_layers",  # llama4: indices of the mixture-of-experts layers
    "full_attn_idxs",  # lfm2: indices of the attention layers among the convolution ones
    "attn_layer_indices",  # bamba: indices of the attention layers among the mamba ones
    "cross_attention_layers",  # mllama: indices of the cross-attention (image) layers
}
"""config.json lists of layer indices: rewritten to the output indices whose source layer was listed."""


def register_per_layer_key(key: str) -> None:
    """Declare config.json key `key` a list with one entry per decoder layer (as `layer_types`): a merge whose
    slices change the layers re-indexes it with them. For an architecture whose config has such a key under a
    name not in PER_LAYER_KEYS; without it, the list keeps the old depth and transformers may refuse the output."""
    PER_LAYER_KEYS.add(key)


def register_per_layer_string_key(key: str) -> None:
    """Declare config.json key `key` a string with one character per decoder layer (as nemotron_h's
    `hybrid_override_pattern`): a merge whose slices change the layers re-indexes its characters."""
    PER_LAYER_STRING_KEYS.add(key)


def register_layer_index_key(key: str) -> None:
    """Declare config.json key `key` a list of layer indices (as `mlp_only_layers`): rewritten to the output
    layers whose source layers it listed."""
    LAYER_INDEX_KEYS.add(key)


_NON_TEXT_TOWERS = ("vision", "visual", "image", "audio", "speech")
"""Prefix words of encoder stacks beside the language model (llava's `vision_tower.encoder.layers`)."""


class LayerMapError(ValueError):
    """The output's layer sequence cannot be described by the base config (the planner names the config)."""


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
    """Where the config keeps its layer count (a key path) and the count itself: a count key, or else the
    length of a per-layer list that is the config's only statement of its depth (DEPTH_KEYS)."""
    if not config:
        return None
    scopes: list[tuple[tuple[str, ...], dict[str, Any]]] = [((), config)]
    if isinstance(config.get("text_config"), dict):
        scopes.append((("text_config",), config["text_config"]))
    for path, scope in scopes:
        for key in _LAYER_COUNT_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return (*path, key), value
    for path, scope in scopes:
        for key in DEPTH_KEYS:
            value = scope.get(key)
            if isinstance(value, (list, str)) and value:
                return (*path, key), len(value)
    return None


def find_layer_stack(names: Iterable[str], config: dict[str, Any] | None) -> LayerStack | None:
    """The stack whose indices are exactly 0..n-1 with n the config's layer count.

    Without a layer count in the config, a single candidate stack is taken as the layers. Where
    several stacks match (a vision tower as deep as the text model), a stack whose prefix names a
    vision/audio tower loses, then the one holding the most tensors wins (a CLIP encoder layer holds
    more tensors than a llama decoder layer, so the count alone picks the wrong stack in llava).
    """
    indices, tensors = _stack_indices(names)
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
    best = max(candidates, key=lambda p: (not any(w in p.lower() for w in _NON_TEXT_TOWERS), tensors[p], -len(p)))
    return LayerStack(best, len(indices[best]))


def _stack_indices(names: Iterable[str]) -> tuple[dict[str, set[int]], dict[str, int]]:
    """For each `<prefix>.<N>.` stack among the tensor names: its layer indices, and how many tensors it holds."""
    indices: dict[str, set[int]] = defaultdict(set)
    tensors: dict[str, int] = defaultdict(int)
    for name in names:
        m = _LAYER_RE.match(name)
        if m:
            indices[m.group("prefix")].add(int(m.group("index")))
            tensors[m.group("prefix")] += 1
    return indices, tensors


def stack_in_tensors(names: Iterable[str]) -> LayerStack | None:
    """The layer stack the tensor names show on their own, whatever config.json says: the stack with indices
    0..n-1 holding the most tensors (for messages about a config whose layer count matches no stack)."""
    indices, tensors = _stack_indices(names)
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
    PER_LAYER_KEYS, such as `layer_types`, as long as the old layer count) is re-indexed the same way,
    a list of layer indices (LAYER_INDEX_KEYS) names the output layers whose sources it listed, and
    counts that decide a layer's kind by its index are rewritten (see _rewrite_layer_schedule).
    Raises LayerMapError where the config cannot describe the output's layers.
    Other lists are left alone even when their length happens to equal the layer count: token ids
    (`eos_token_id: [2, 3]` in a 2-layer model), `architectures`.
    """
    out = copy.deepcopy(config)
    found = layer_count_key(out)
    if layer_sources is not None and found is not None:
        path, old_count = found
        scope = out if len(path) == 1 else out[path[0]]
        if path[-1] in _LAYER_COUNT_KEYS:  # else the depth is a per-layer list's length, rewritten below
            scope[path[-1]] = len(layer_sources)
        for alias in SECOND_COUNT_KEYS:  # a second statement of the depth, where it agrees with the first
            if scope.get(alias) == old_count and not isinstance(scope.get(alias), bool):
                scope[alias] = len(layer_sources)
        for holder in (out, out.get("text_config")):
            if not isinstance(holder, dict):
                continue
            for key, value in list(holder.items()):
                if key in PER_LAYER_KEYS and isinstance(value, list) and len(value) == old_count:
                    holder[key] = [value[min(src, old_count - 1)] for src in layer_sources]
                elif key in PER_LAYER_STRING_KEYS and isinstance(value, str) and len(value) == old_count:
                    holder[key] = "".join(value[min(src, old_count - 1)] for src in layer_sources)
                elif key in PER_LAYER_DICT_KEYS and isinstance(value, dict):
                    holder[key] = _reindex_layer_dict(value, layer_sources)
                elif key in LAYER_INDEX_KEYS and isinstance(value, list):
                    holder[key] = [i for i, src in enumerate(layer_sources) if src in value]
            _rewrite_kv_sources(holder, layer_sources, old_count)
            if isinstance(holder.get("attention_types"), list) and isinstance(holder.get("attention_layers"), list):
                # gpt_neo: [[kinds, repeats], ...] expands to attention_layers and must agree with it
                holder["attention_types"] = [[[kind], 1] for kind in holder["attention_layers"]]
            _rewrite_layer_schedule(holder, layer_sources)
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


def _rewrite_kv_sources(holder: dict[str, Any], layer_sources: list[int], old_count: int) -> None:
    """mistral_large4's `kv_source_layers` says, per layer, which layer's keys and values it attends with. Where
    each layer uses its own, the output's layers do too; where layers share, slices would have to keep each
    sharer after its source, which a list of indices cannot promise: refused."""
    value = holder.get("kv_source_layers")
    if not isinstance(value, list) or len(value) != old_count:
        return
    if value != list(range(old_count)):
        raise LayerMapError(
            "`kv_source_layers` makes layers share another layer's keys and values by index, which slices "
            "that change the layers break"
        )
    holder["kv_source_layers"] = list(range(len(layer_sources)))


def _reindex_layer_dict(value: dict[str, Any], layer_sources: list[int]) -> dict[str, Any]:
    """A dict keyed by layer index (as strings, maybe zero-padded) for the output layers: output layer i takes
    the entry of its source layer, keyed the way the input wrote its keys."""
    by_index = {int(k): v for k, v in value.items() if str(k).isdigit()}
    width = max((len(str(k)) for k in value), default=1)
    out = {f"{i:0{width}d}": copy.deepcopy(by_index[src]) for i, src in enumerate(layer_sources) if src in by_index}
    out.update({k: v for k, v in value.items() if not str(k).isdigit()})
    return out


_PERIODIC_KINDS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))
"""jamba: layer i is attention (or mixture-of-experts) where i % period == offset."""


def _check_periodic_kinds(holder: dict[str, Any], layer_sources: list[int]) -> None:
    """Refuse slices that put a layer where the config's periodic schedule expects another kind: jamba's
    `attn_layer_period`/`attn_layer_offset` (and the expert pair), recurrent_gemma's cycled `block_types`. No
    count can describe an arbitrary order, and transformers would build the wrong block for the layer."""
    for period_key, offset_key in _PERIODIC_KINDS:
        period, offset = holder.get(period_key), holder.get(offset_key)
        if not (isinstance(period, int) and isinstance(offset, int) and period > 0):
            continue
        for out_i, src in enumerate(layer_sources):
            if (out_i % period == offset) != (src % period == offset):
                raise LayerMapError(
                    f"output layer {out_i} comes from layer {src}, but `{period_key}: {period}` and "
                    f"`{offset_key}: {offset}` decide a layer's kind by its index"
                )
    cycle = holder.get("block_types")
    if isinstance(cycle, list) and cycle:
        for out_i, src in enumerate(layer_sources):
            if cycle[out_i % len(cycle)] != cycle[src % len(cycle)]:
                raise LayerMapError(
                    f"output layer {out_i} comes from a {cycle[src % len(cycle)]!r} layer, but the cycled "
                    f"`block_types` makes it {cycle[out_i % len(cycle)]!r} (transformers builds it by its index)"
                )


def _rewrite_layer_schedule(holder: dict[str, Any], layer_sources: list[int]) -> None:
    """Rewrite the config numbers that make a layer dense or mixture-of-experts by its index.

    qwen2_moe/qwen3_moe: layer i is sparse unless listed in `mlp_only_layers` or `(i + 1) %
    decoder_sparse_step != 0`; with slices the step no longer fits, so it becomes 1 and the dense output
    layers are listed. deepseek_v2/v3 (and their descendants): the first `first_k_dense_replace` layers
    are dense, the rest sparse; the output keeps that form only while its dense layers come first, and
    is refused otherwise (transformers would build an MLP of the wrong shape for that layer).
    """
    per_layer_input = holder.get("hidden_size_per_layer_input")
    if isinstance(per_layer_input, int) and per_layer_input > 0 and layer_sources != list(range(len(layer_sources))):
        raise LayerMapError(
            f"`hidden_size_per_layer_input: {per_layer_input}`: the per-layer input embeddings (gemma3n, gemma4) "
            "are single tensors sized by the layer count, which slices that change the layers break"
        )
    _check_periodic_kinds(holder, layer_sources)
    hybrid = holder.get("hybrid_layer_ids")
    if isinstance(hybrid, list) and hybrid and layer_sources != list(range(len(layer_sources))):
        raise LayerMapError(
            "`hybrid_layer_ids`: the shared attention blocks (zamba2) keep one adapter per hybrid layer, numbered "
            "by its place among the hybrid layers outside the layer stack, which slices that change the layers break"
        )
    step = holder.get("decoder_sparse_step")
    if isinstance(step, int) and not isinstance(step, bool) and step > 1:
        dense = set(holder.get("mlp_only_layers") or [])
        # mlp_only_layers was already re-indexed: recompute from the sources
        source_dense = {i for i, src in enumerate(layer_sources) if (src + 1) % step != 0}
        holder["mlp_only_layers"] = sorted(dense | source_dense)
        holder["decoder_sparse_step"] = 1
    k = holder.get("first_k_dense_replace")
    if isinstance(k, int) and not isinstance(k, bool) and k > 0:
        dense_flags = [src < k for src in layer_sources]
        leading = next((i for i, d in enumerate(dense_flags) if not d), len(dense_flags))
        if any(dense_flags[leading:]):
            late = leading + dense_flags[leading:].index(True)
            raise LayerMapError(
                f"output layer {late} comes from dense layer {layer_sources[late]} after mixture-of-experts "
                f"layers, but `first_k_dense_replace: {k}` can only make the first layers dense "
                "(transformers builds the layer kind from its index)"
            )
        freq = holder.get("moe_layer_freq")
        if isinstance(freq, int) and freq > 1 and layer_sources != list(range(len(layer_sources))):
            raise LayerMapError(
                f"`moe_layer_freq: {freq}` makes every {freq}th layer mixture-of-experts by its index, "
                "which slices that change the layers break"
            )
        holder["first_k_dense_replace"] = leading
