"""Which output row comes from where: matching the donor's vocabulary against the base's.

Tokens are compared in a normalised form, as mergekit-tokensurgeon does, so that tokenizers which
spell the same thing differently still match:
- a token starting with the word-start marker (`Ġ` for byte-level BPE, `▁` for SentencePiece) is
  ("word", rest), so `Ġhello` and `▁hello` are the same token;
- a special token with a role (bos, eos, unk, pad, sep, cls, mask) is ("special", role), so `<s>` and
  `<|begin_of_text|>` are both the beginning of sequence;
- anything else is its own string.
(mergekit also folds every *additional* special token into one key, so all but one of them vanish
from its output; here they match by their own string.) The marker is the one the vocabulary uses
most, where mergekit picks it from the tokenizer's Python class (the same choice for the tokenizer
families it knows).

For every donor token (by id) the output row is the base's row of the same token; else, with
`byte_match`, the base's byte token for a single-character token (`<0x41>` for `A`) or the reverse;
else, with `prefix_match`, the base's row of the longest prefix it has; else it is approximated. The
approximation's shared tokens are the exact matches only, in donor id order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

Normalized = Any  # str | tuple[str, str]
_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class Vocabulary:
    """A tokenizer's vocabulary in normalised form, and the tokenizer itself (for subword splits)."""

    by_token: dict[Normalized, int]
    size: int  # ids in use: max id + 1
    tokenizer: Any
    special_ids: dict[str, int | None]  # role -> id (bos_token_id, ...)


def load_vocabulary(root: Path, who: str, trust_remote_code: bool = False) -> Vocabulary:
    """The normalised vocabulary of the tokenizer in `root`; one error line when there is none."""
    from ..tokenizer.build import load_tokenizer, require_transformers

    require_transformers("tokensurgeon")
    try:
        tokenizer = load_tokenizer(root, trust_remote_code)
    except CheckpointError as exc:
        raise CheckpointError(f"{who}: no usable tokenizer in {root} ({exc})") from None
    vocab = tokenizer.get_vocab()
    if not vocab:
        raise CheckpointError(f"{who}: the tokenizer in {root} has an empty vocabulary")
    marker = _word_start_marker(vocab)
    roles: dict[str, str] = {}
    for role in _ROLES:
        value = getattr(tokenizer, role, None)
        if isinstance(value, str) and value not in roles:
            roles[value] = role
    by_token: dict[Normalized, int] = {}
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        by_token[normalize(token, roles, marker)] = idx
    specials = {f"{r}_id": getattr(tokenizer, f"{r}_id", None) for r in ("bos_token", "eos_token", "pad_token")}
    return Vocabulary(by_token, max(vocab.values()) + 1, tokenizer, specials)


def _word_start_marker(vocab: dict[str, int]) -> str:
    spm = sum(1 for t in vocab if t.startswith("▁"))
    bpe = sum(1 for t in vocab if t.startswith("Ġ"))
    return "▁" if spm > bpe else "Ġ"


def normalize(token: str, roles: dict[str, str], marker: str) -> Normalized:
    if token.startswith(marker):
        return ("word", token[len(marker) :])
    role = roles.get(token)
    if role is not None:
        return ("special", role)
    return token


def unnormalize(token: Normalized) -> str:
    """The text a token stands for (for splitting it with the base tokenizer)."""
    if isinstance(token, tuple):
        return " " + token[1] if token[0] == "word" else token[1]
    return token


def _prefixes(token: Normalized) -> list[Normalized]:
    """Proper prefixes, longest first; none for specials; stops at an all-whitespace prefix."""
    kind = None
    if isinstance(token, tuple):
        kind, token = token
        if kind == "special":
            return []
    out: list[Normalized] = []
    for i in range(len(token) - 1, 0, -1):
        prefix = token[:i]
        if not prefix.strip():
            break
        out.append((kind, prefix) if kind is not None else prefix)
    return out


def _byte_match(token: Normalized, base: dict[Normalized, int]) -> int | None:
    if not isinstance(token, str):
        return None
    if len(token) == 1 and ord(token) < 256:
        return base.get(f"<0x{ord(token):02X}>")
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
        try:
            return base.get(chr(int(token[3:-1], 16)))
        except ValueError:
            return None
    return None


@dataclass
class Assignment:
    """For one vocabulary tensor: output row -> base row (or -1), the rows to approximate (with their
    donor rows), and the shared tokens' rows in both models (donor id order)."""

    rows: int
    source: torch.Tensor  # [rows] long
    target_rows: torch.Tensor  # [M] long: output rows to approximate
    target_donor: torch.Tensor  # [M] long: the donor's row of each
    shared_base: torch.Tensor  # [S] long
    shared_donor: torch.Tensor  # [S] long
    target_tokens: list[Normalized]
    counts: dict[str, int]


def assign_rows(
    base: Vocabulary,
    donor: Vocabulary,
    base_rows: int,
    donor_rows: int | None,
    byte_match: bool,
    prefix_match: bool,
) -> Assignment:
    """Match every donor token against the base (see the module docstring). Base tokens whose id is
    past the base tensor's rows do not exist for it; donor tokens past the donor tensor's rows (when the
    method reads it) are left zero, as mergekit does."""
    rows = donor.size
    safe_base = {t: i for t, i in base.by_token.items() if i < base_rows}
    source = torch.full((rows,), -1, dtype=torch.long)
    targets: list[tuple[int, Normalized]] = []
    counts = {"exact": 0, "byte": 0, "prefix": 0, "approximated": 0, "zero": 0}
    for token, idx in sorted(donor.by_token.items(), key=lambda kv: kv[1]):
        if donor_rows is not None and idx >= donor_rows:
            counts["zero"] += 1
            continue
        hit = safe_base.get(token)
        kind = "exact"
        if hit is None and byte_match:
            hit, kind = _byte_match(token, safe_base), "byte"
        if hit is None and prefix_match:
            kind = "prefix"
            hit = next((safe_base[p] for p in _prefixes(token) if p in safe_base), None)
        if hit is None:
            targets.append((idx, token))
            counts["approximated"] += 1
        else:
            source[idx] = hit
            counts[kind] += 1
    shared = sorted(((donor.by_token[t], i) for t, i in safe_base.items() if t in donor.by_token), key=lambda p: p[0])
    if donor_rows is not None:
        shared = [(d, b) for d, b in shared if d < donor_rows]
    return Assignment(
        rows=rows,
        source=source,
        target_rows=torch.tensor([i for i, _ in targets], dtype=torch.long),
        target_donor=torch.tensor([i for i, _ in targets], dtype=torch.long),
        shared_base=torch.tensor([b for _, b in shared], dtype=torch.long),
        shared_donor=torch.tensor([d for d, _ in shared], dtype=torch.long),
        target_tokens=[t for _, t in targets],
        counts=counts,
    )


def subword_ids(base: Vocabulary, tokens: list[Normalized], base_rows: int) -> torch.Tensor:
    """[M, L] base ids of each token's text split by the base tokenizer, -1 padded (ids past the base
    tensor's rows dropped)."""
    splits = []
    for token in tokens:
        ids = base.tokenizer(unnormalize(token), add_special_tokens=False)["input_ids"]
        splits.append([i for i in ids if 0 <= i < base_rows])
    width = max((len(s) for s in splits), default=0)
    out = torch.full((len(splits), width), -1, dtype=torch.long)
    for row, ids in enumerate(splits):
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out
