"""Build the output tokenizer and map every input model's token ids onto it.

This is the planning half of tokenizer merging: it reads tokenizers (with transformers, imported
here only, so a plain merge never loads it) and produces plain data: the output tokenizer and, per
input model, which of its embedding rows holds each output token (or -1 where it has none).

Semantics follow mergekit's `tokenizer` section and legacy `tokenizer_source`:
- `base`: the base model's tokenizer; `<model>`: that model's tokenizer;
- `union`: the base tokenizer plus every other token of every input, appended as added tokens
  (ordinary vocabulary first, then each model's added tokens with their flags);
- tokens named under `tokenizer.tokens` are added when missing;
- a tokenizer longer than its model's embedding is cut to the embedding (ids past the last row
  can never be looked up, so they are not real tokens of that model).
Unlike mergekit, which walks `get_vocab()` in hash order, tokens are visited by id, so the output
vocabulary (and so the plan fingerprint) is the same on every run.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError


def require_transformers(feature: str) -> None:
    """Fail with one line when the optional `hf` extra is missing."""
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(f"{feature} needs transformers and tokenizers: pip install 'mergesmith[hf]'") from None


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """A fast tokenizer from a model directory (offline: never reaches the hub).

    transformers fails in many ways (OSError, ValueError, KeyError...) on a directory without a
    usable tokenizer; all of them become one CheckpointError line naming the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - see docstring
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise CheckpointError(f"{path}: cannot load a tokenizer ({first})") from None


def _rewritten(tokenizer: Any, edit: Callable[[dict[str, Any]], None], trust_remote_code: bool) -> Any:
    """A fresh copy of `tokenizer` whose tokenizer.json went through `edit` (the original is untouched)."""
    with tempfile.TemporaryDirectory(prefix="mergesmith-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        path = Path(tmp) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError("tokenizer merging needs a fast tokenizer (tokenizer.json); this one has none")
        data = json.loads(path.read_text(encoding="utf-8"))
        edit(data)
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        return load_tokenizer(Path(tmp), trust_remote_code)


def copy_tokenizer(tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """An independent copy, so adding tokens to the output never changes an input's tokenizer."""
    return _rewritten(tokenizer, lambda _data: None, trust_remote_code)


def strip_to_rows(tokenizer: Any, rows: int, who: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer without tokens whose id is past the model's last embedding row."""
    unused = {tok for tok, idx in tokenizer.get_vocab().items() if idx >= rows}
    if not unused:
        return tokenizer

    def edit(data: dict[str, Any]) -> None:
        data["added_tokens"] = [e for e in data.get("added_tokens") or [] if e["id"] < rows]
        model = data["model"]
        vocab = model.get("vocab")
        if isinstance(vocab, dict):
            model["vocab"] = {t: i for t, i in vocab.items() if i < rows}
        elif isinstance(vocab, list):  # Unigram: ids are positions, so only a tail can go
            kept = vocab[:rows]
            if len({t for t, _score in kept} & unused):
                raise ConfigError(f"model {who!r}: cannot cut its Unigram tokenizer to {rows} tokens")
            model["vocab"] = kept
        merges = model.get("merges")
        if isinstance(merges, list):
            model["merges"] = [m for m in merges if not set(m.split(" ") if isinstance(m, str) else m) & unused]

    return _rewritten(tokenizer, edit, trust_remote_code)


@dataclass
class VocabularyBuild:
    """The output tokenizer and, per input model, output id -> that model's row (or -1)."""

    tokenizer: Any
    vocab: dict[str, int]
    rows: int  # output embedding rows: len(vocab) rounded up to pad_to_multiple_of
    permutations: dict[str, torch.Tensor]
    original_vocabs: dict[str, dict[str, int]]
    model_rows: dict[str, int]
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens_by_id(self) -> list[str]:
        out = [""] * len(self.vocab)
        for tok, idx in self.vocab.items():
            out[idx] = tok
        return out


def build_vocabulary(
    source: str,
    base_ref: str,
    model_refs: list[str],
    roots: dict[str, Path],
    model_rows: dict[str, int],
    add_tokens: list[str],
    pad_to_multiple_of: int | None,
    trust_remote_code: bool = False,
    config_source: str = "config",
) -> VocabularyBuild:
    """Load every input's tokenizer, build the output one from `source`, and map each input onto it.

    `roots[ref]` is where ref's tokenizer lives (a LoRA input: its base model's directory);
    `model_rows[ref]` the number of rows of its token embedding; `source` is `base`, `union`, or a
    model (one of `model_refs`, or any path holding a tokenizer).
    """
    require_transformers("tokenizer merging")
    from tokenizers import AddedToken

    warnings: list[str] = []
    base_tok = strip_to_rows(
        load_tokenizer(roots[base_ref], trust_remote_code), model_rows[base_ref], base_ref, trust_remote_code
    )
    tokenizers: dict[str, Any] = {base_ref: base_tok}
    for ref in model_refs:
        if ref in tokenizers:
            continue
        try:
            tokenizers[ref] = load_tokenizer(roots[ref], trust_remote_code)
        except CheckpointError as exc:
            warnings.append(f"model {ref!r}: {exc}; assuming the base model's tokenizer")

    if source == "base":
        out = copy_tokenizer(base_tok, trust_remote_code)
    elif source == "union":
        out = _union(base_tok, tokenizers, model_rows, AddedToken, trust_remote_code)
    else:
        ref = source.removeprefix("model:") if source not in roots else source
        if ref in tokenizers:
            out = copy_tokenizer(tokenizers[ref], trust_remote_code)
        else:
            from ..io.checkpoint import resolve_model_path

            try:
                path = resolve_model_path(ref, weights=False)  # a hub model's tokenizer, not its weights
                out = load_tokenizer(path if path.is_dir() else path.parent, trust_remote_code)
            except CheckpointError as exc:
                raise ConfigError(
                    f"{config_source}: `tokenizer.source`: cannot load a tokenizer from {ref!r} ({exc})"
                ) from None

    existing = set(out.get_vocab())
    for tok in add_tokens:
        if tok not in existing:
            out.add_tokens([tok])
            existing.add(tok)

    vocab = dict(out.get_vocab())
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ConfigError(f"{config_source}: the output tokenizer's ids are not contiguous; cannot size its embedding")
    rows = len(vocab)
    if pad_to_multiple_of:
        rows = -(-rows // pad_to_multiple_of) * pad_to_multiple_of

    tokens_by_id = [""] * len(vocab)
    for tok, idx in vocab.items():
        tokens_by_id[idx] = tok
    permutations: dict[str, torch.Tensor] = {}
    original: dict[str, dict[str, int]] = {}
    for ref in model_refs:
        model_vocab = dict((tokenizers.get(ref) or base_tok).get_vocab())
        original[ref] = model_vocab
        limit = model_rows[ref]
        perm = [model_vocab.get(tok, -1) for tok in tokens_by_id]
        permutations[ref] = torch.tensor([i if 0 <= i < limit else -1 for i in perm], dtype=torch.long)
    return VocabularyBuild(out, vocab, rows, permutations, original, dict(model_rows), warnings)


def _union(
    base_tok: Any, tokenizers: dict[str, Any], model_rows: dict[str, int], added_token_cls: Any, trust: bool
) -> Any:
    """The base tokenizer plus every other input's tokens: plain vocabulary first, then added tokens."""
    out = copy_tokenizer(base_tok, trust)
    present = set(out.get_vocab())
    added_later: dict[str, Any] = {}
    plain: list[str] = []
    for ref, tok in tokenizers.items():
        decoder = tok.added_tokens_decoder
        specials = {info.content for info in decoder.values()}
        for text, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if idx >= model_rows[ref]:
                continue
            if text in specials:
                if text not in added_later:
                    added_later[text] = decoder.get(idx) or added_token_cls(text)
                continue
            if text not in present:
                plain.append(text)
                present.add(text)
    if plain:
        out.add_tokens(plain)
    have = set(out.get_vocab())
    for info in (info for text, info in added_later.items() if text not in have):
        out.add_tokens([info], special_tokens=bool(getattr(info, "special", False)))
    return out
