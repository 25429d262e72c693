"""The tokensurgeon planner: BASE + DONOR -> a Plan that gives BASE the donor's tokenizer.

Every tensor of the base is a `copy` recipe except its token embedding and output head, which are
`transplant` recipes (table.py) with the donor's vocabulary as rows. The plan then runs on the shared
executor and writer like any merge: journaled, resumable, under --max-memory. The output gets
- the donor's tokenizer files (so its chat template) and `vocab_size` = the donor's vocabulary;
- bos/eos/pad ids (and unk/mask ids, padding_side) from the donor's config.json, else from the donor's
  tokenizer, in config.json and in the base's generation_config.json alike.

Refused before any tensor is read, one line each: BASE or DONOR without a usable tokenizer, a method
that reads the donor's tensors when the donor has no token embedding, k larger than the shared
vocabulary, no shared token at all (for every method: nothing would be kept), a base without config.json
or token embedding. Widths may differ: OMP and common interpolation find their coefficients in the
donor's space and apply them to the base's rows.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..engine.plan import OWN_CONFIG_NAME, InputRef, Plan, TensorRecipe
from ..engine.planning.architecture import LM_HEAD_NAMES, embedding_for_head, find_layer_stack, ties_embeddings
from ..engine.planning.shared import MergeOptions, cut_shards, estimate_plan, tensor_seed
from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import Checkpoint
from ..io.model_files import TOKENIZER_FILES
from ..tokenizer.align import staging_root, write_atomic
from .approximate import interpolation_block_bytes, omp_block_bytes
from .table import METHODS, NEEDS_DONOR, OP, TransplantTable, register
from .vocab import Assignment, Vocabulary, assign_rows, load_vocabulary, subword_ids

MATCH_CHOICES = ("no", "yes", "embed", "lm_head")
WEIGHT_SCHEMES = ("distance_proportional", "barycentric", "least_squares")
SUBWORD_METHODS = ("mean", "sum", "weighted_mean", "first_last")
_CONFIG_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "mask_token_id", "padding_side")
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
DEFAULT_BLOCK_BYTES = 1 << 30


@dataclass
class SurgeryOptions:
    """mergekit-tokensurgeon's options (same names and defaults)."""

    approximation_method: str = "omp"
    k: int = 64
    prefix_match: str = "no"
    byte_match: str = "no"
    weight_scheme: str = "distance_proportional"
    cosine_similarity: bool = False
    subword_method: str = "mean"
    batch_size: int | None = None  # targets per OMP/interpolation block; default: as many as fit the memory budget
    new_vocab_noise: float | None = None
    new_vocab_scale: float | None = None

    def check(self) -> None:
        if self.approximation_method not in METHODS:
            raise ConfigError(
                f"`--approximation-method`: {self.approximation_method!r} is not supported "
                f"(choose from {', '.join(METHODS)})"
            )
        if self.k < 1:
            raise ConfigError(f"`--k`: must be at least 1, got {self.k}")
        for name, value, choices in (
            ("--prefix-match", self.prefix_match, MATCH_CHOICES),
            ("--byte-match", self.byte_match, MATCH_CHOICES),
            ("--weight-scheme", self.weight_scheme, WEIGHT_SCHEMES),
            ("--subword-method", self.subword_method, SUBWORD_METHODS),
        ):
            if value not in choices:
                raise ConfigError(f"`{name}`: {value!r} is not one of {', '.join(choices)}")

    def allows(self, match: str, head: bool) -> bool:
        """Whether prefix/byte matching (`match`: its option value) applies to the embedding or the head."""
        return match == "yes" or match == ("lm_head" if head else "embed")

    @property
    def needs_seed(self) -> bool:
        return self.approximation_method == "randn" or bool(self.new_vocab_noise)


@dataclass
class VocabTensor:
    """One tensor to rebuild: its name in the base, and the donor tensor its method reads."""

    name: str
    head: bool
    donor_tensor: str | None


class TokenSurgeonPlanner:
    """Builds the Plan for one transplant over opened checkpoints."""

    def __init__(
        self,
        base: Checkpoint,
        donor: Checkpoint,
        options: MergeOptions,
        surgery: SurgeryOptions,
        base_ref: str = "base",
        donor_ref: str = "donor",
    ) -> None:
        surgery.check()
        self.base, self.donor = base, donor
        self.base_ref, self.donor_ref = base_ref, donor_ref
        self.options, self.surgery = options, surgery
        if base.config is None:
            raise CheckpointError(f"BASE {base.ref!r}: no config.json in {base.root}")
        self.warnings: list[str] = []
        self.base_vocab = load_vocabulary(_tokenizer_root(base), f"BASE {base.ref!r}", options.trust_remote_code)
        self.donor_vocab = load_vocabulary(_tokenizer_root(donor), f"DONOR {donor.ref!r}", options.trust_remote_code)
        self.tensors = self._vocab_tensors()

    # ----- which tensors -------------------------------------------------------------------
    def _vocab_tensors(self) -> list[VocabTensor]:
        base, donor = self.base, self.donor
        stack = find_layer_stack(base.tensors, base.config)
        embed = embedding_for_head(base.tensors, stack)
        if embed is None:
            raise CheckpointError(f"BASE {base.ref!r}: no token embedding found")
        head = next((n for n in LM_HEAD_NAMES if n in base.tensors), None)
        if head is None and not ties_embeddings(base.config, base.tensors):
            raise CheckpointError(f"BASE {base.ref!r}: untied output head, but no {' / '.join(LM_HEAD_NAMES)} tensor")
        for name in base.tensors:
            if name not in (embed, head) and ("lm_head" in name or "logits_bias" in name):
                raise CheckpointError(
                    f"BASE {base.ref!r}: tensor {name!r} is indexed by token and not supported by tokensurgeon"
                )
        needs_donor = self.surgery.approximation_method in NEEDS_DONOR
        donor_embed = donor_head = None
        if needs_donor:
            donor_embed = embedding_for_head(donor.tensors, find_layer_stack(donor.tensors, donor.config))
            if donor_embed is None:
                raise CheckpointError(
                    f"DONOR {donor.ref!r}: no token embedding found (`--approximation-method "
                    f"{self.surgery.approximation_method}` reads the donor's embeddings)"
                )
            donor_head = next((n for n in LM_HEAD_NAMES if n in donor.tensors), donor_embed)
        for name in (donor_embed, donor_head):
            if name is not None and len(donor.info(name).shape) != 2:
                raise CheckpointError(f"DONOR {donor.ref!r}: tensor {name!r} is not a matrix")
        for name in (embed, head):
            if name is not None and len(base.info(name).shape) != 2:
                raise CheckpointError(f"BASE {base.ref!r}: tensor {name!r} is not a matrix")
        out = [VocabTensor(embed, False, donor_embed)]
        if head is not None:
            out.append(VocabTensor(head, True, donor_head))
        return out

    # ----- recipes -------------------------------------------------------------------------
    def _assignment(self, vt: VocabTensor) -> Assignment:
        base_rows = self.base.info(vt.name).shape[0]
        donor_rows = self.donor.info(vt.donor_tensor).shape[0] if vt.donor_tensor else None
        s = self.surgery
        found = assign_rows(
            self.base_vocab,
            self.donor_vocab,
            base_rows,
            donor_rows,
            byte_match=s.allows(s.byte_match, vt.head),
            prefix_match=s.allows(s.prefix_match, vt.head),
        )
        shared = found.shared_base.numel()
        if shared == 0:
            raise ConfigError(
                f"BASE {self.base.ref!r} and DONOR {self.donor.ref!r}: the tokenizers share no token "
                f"(for {vt.name!r}); nothing of the base's vocabulary would be kept"
            )
        if s.approximation_method in NEEDS_DONOR and found.target_rows.numel() and s.k > shared:
            raise ConfigError(
                f"`--k`: {s.k} is larger than the {shared} tokens BASE and DONOR share (for {vt.name!r}); "
                f"use --k {shared} or less"
            )
        if vt.donor_tensor is not None and found.target_rows.numel():
            hidden = self.donor.info(vt.donor_tensor).shape[1]
            warning = (
                f"--k {s.k} is not below the hidden size of DONOR's {vt.donor_tensor!r} ({hidden}): the fit "
                "of each token is exact and its coefficients carry over poorly; use a k well below it"
            )
            if s.k >= hidden and warning not in self.warnings:
                self.warnings.append(warning)
        if found.counts["zero"]:
            self.warnings.append(
                f"{found.counts['zero']} donor token(s) have ids past the rows of DONOR's {vt.donor_tensor!r}; "
                "their rows are zero"
            )
        return found

    def _recipe(self, vt: VocabTensor, found: Assignment) -> TensorRecipe:
        s = self.surgery
        info = self.base.info(vt.name)
        subword = (
            subword_ids(self.base_vocab, found.target_tokens, info.shape[0])
            if s.approximation_method == "subword"
            else None
        )
        table = TransplantTable.of(found, subword)
        inputs = [InputRef(self.base_ref, vt.name)]
        if s.approximation_method in NEEDS_DONOR and found.target_rows.numel():
            assert vt.donor_tensor is not None
            inputs.append(InputRef(self.donor_ref, vt.donor_tensor))
        params: dict[str, Any] = {
            "table": register(table),
            "method": s.approximation_method,
            "k": s.k,
            "is_head": vt.head,
            "device": self.options.device,
        }
        if s.approximation_method in ("omp", "common_interpolation"):
            params["block"] = self._block(found, vt)
        if s.approximation_method == "common_interpolation":
            params.update(weight_scheme=s.weight_scheme, cosine_similarity=s.cosine_similarity)
        if s.approximation_method == "subword":
            params["subword_method"] = s.subword_method
        if s.new_vocab_noise:
            params["new_vocab_noise"] = s.new_vocab_noise
        if s.new_vocab_scale:
            params["new_vocab_scale"] = s.new_vocab_scale
        seed = None
        if s.needs_seed and found.target_rows.numel():
            assert self.options.random_seed is not None
            seed = tensor_seed(self.options.random_seed, vt.name)
        return TensorRecipe(
            vt.name,
            (found.rows, info.shape[1]),
            info.dtype,
            OP,
            tuple(inputs),
            params=tuple(sorted(params.items())),
            seed=seed,
        )

    def _block(self, found: Assignment, vt: VocabTensor) -> int:
        """Targets per block of OMP or common interpolation: --batch-size, else as many as fit a quarter of
        --max-memory (1 GiB without). Both hold per target a row of scores against every shared token, so all
        targets at once (30k new tokens against 120k shared: 14 GB of distances alone) would not fit a GPU."""
        if self.surgery.batch_size and self.surgery.batch_size > 0:
            return self.surgery.batch_size
        assert vt.donor_tensor is not None
        hidden = self.donor.info(vt.donor_tensor).shape[1]
        per_target = omp_block_bytes if self.surgery.approximation_method == "omp" else interpolation_block_bytes
        per = per_target(found.shared_base.numel(), hidden, self.surgery.k)
        budget = self.options.max_memory // 4 if self.options.max_memory else DEFAULT_BLOCK_BYTES
        return max(1, min(max(found.target_rows.numel(), 1), budget // per))

    # ----- the plan ------------------------------------------------------------------------
    def build(self) -> tuple[Plan, dict[str, dict[str, int]]]:
        found = {vt.name: self._assignment(vt) for vt in self.tensors}
        special = {vt.name: self._recipe(vt, found[vt.name]) for vt in self.tensors}
        recipes: list[TensorRecipe] = []
        for name, info in self.base.tensors.items():
            recipes.append(
                special.get(name)
                or TensorRecipe(name, info.shape, info.dtype, "copy", (InputRef(self.base_ref, name),))
            )
        rows = found[self.tensors[0].name].rows
        output_config = self._output_config(rows)
        files = self._files(output_config)
        floats = [r.dtype for r in recipes]
        out_dtype = max(set(floats), key=floats.count)
        config_yaml = self._config_yaml()
        plan = Plan(
            shards=cut_shards(recipes, self.options.out_shard_size),
            output_config=output_config,
            compute_dtype="F32",
            out_dtype=out_dtype,
            files_to_copy=files,
            config_yaml=config_yaml,
            config_name=OWN_CONFIG_NAME,  # tokensurgeon's options, not a mergekit config
            model_card=self._card(found) if self.options.write_model_card else None,
            input_identities={
                self.base_ref: [list(x) for x in self.base.identity()],
                self.donor_ref: [list(x) for x in self.donor.identity()],
            },
            options={
                "out_shard_size": self.options.out_shard_size,
                "random_seed": self.options.random_seed if self.surgery.needs_seed else None,
                "explicit_dtype": None,
                "tokensurgeon": self._summary(found),
            },
            random_seed=self.options.random_seed if self.surgery.needs_seed else None,
            warnings=self.warnings,
            estimate=estimate_plan(
                recipes,
                lambda ref: self._ckpt(ref.model).stored_nbytes(ref.tensor),
                "F32",
                self.options.threads,
                self.options.max_memory,
            ),
        )
        return plan, {name: a.counts for name, a in found.items()}

    def _ckpt(self, ref: str) -> Checkpoint:
        return self.base if ref == self.base_ref else self.donor

    def _summary(self, found: dict[str, Assignment]) -> dict[str, Any]:
        s = self.surgery
        return {
            "base": self.base.ref,
            "donor": self.donor.ref,
            "approximation_method": s.approximation_method,
            "k": s.k,
            "vocab_size": found[self.tensors[0].name].rows,
            "tensors": {name: a.counts for name, a in found.items()},
        }

    def _output_config(self, rows: int) -> dict[str, Any]:
        cfg = copy.deepcopy(self.base.config or {})
        holder = cfg if "vocab_size" in cfg or not isinstance(cfg.get("text_config"), dict) else cfg["text_config"]
        holder["vocab_size"] = rows
        for key, value in self._token_ids().items():
            for scope in (cfg, cfg.get("text_config")):
                if isinstance(scope, dict) and (scope is cfg or key in scope):
                    if value is None:
                        scope.pop(key, None)
                    else:
                        scope[key] = value
        return cfg

    def _token_ids(self) -> dict[str, Any]:
        """Special-token ids (and padding_side) for the output: the donor config's, else its tokenizer's."""
        donor_cfg = self.donor.config or {}
        scopes = [donor_cfg, donor_cfg.get("text_config") or {}]
        out: dict[str, Any] = {}
        for key in _CONFIG_TOKEN_KEYS:
            found = next((scope[key] for scope in scopes if isinstance(scope, dict) and key in scope), None)
            if found is None:
                found = self.donor_vocab.special_ids.get(key)
            if found is not None or key in (self.base.config or {}):
                out[key] = found
        return out

    def _files(self, output_config: dict[str, Any]) -> list[tuple[str, str]]:
        root = _tokenizer_root(self.donor)
        files = [(str(root / n), n) for n in TOKENIZER_FILES if (root / n).is_file()]
        ids = {k: output_config.get(k) for k in _GENERATION_KEYS if k in output_config}
        return files + staged_generation_config(self.base.root, ids)

    def _config_yaml(self) -> str:
        s = self.surgery
        doc: dict[str, Any] = {
            "tokensurgeon": {
                "model": self.base.ref,
                "donor": self.donor.ref,
                "approximation_method": s.approximation_method,
                "k": s.k,
                "prefix_match": s.prefix_match,
                "byte_match": s.byte_match,
            }
        }
        if s.approximation_method == "common_interpolation":
            doc["tokensurgeon"].update(weight_scheme=s.weight_scheme, cosine_similarity=s.cosine_similarity)
        if s.approximation_method == "subword":
            doc["tokensurgeon"]["subword_method"] = s.subword_method
        text = yaml.safe_dump(doc, sort_keys=False)
        if s.needs_seed:
            text += f"# random seed used: {self.options.random_seed} (pass --random-seed to reproduce)\n"
        return text

    def _card(self, found: dict[str, Assignment]) -> str:
        s = self.surgery
        lines = [
            "---",
            "tags: [mergesmith, tokensurgeon]",
            "---",
            f"# {Path(str(self.base.ref)).name} with the tokenizer of {Path(str(self.donor.ref)).name}",
            "",
            f"Made with `mergesmith tokensurgeon` from `{self.base.ref}` (weights) and `{self.donor.ref}` "
            f"(tokenizer); tokens the base lacks approximated with `{s.approximation_method}`"
            + (f" (k={s.k})" if s.approximation_method in NEEDS_DONOR else "")
            + ".",
            "",
        ]
        for name, a in found.items():
            parts = ", ".join(f"{v} {k}" for k, v in a.counts.items() if v)
            lines.append(f"- `{name}`: {parts}")
        return "\n".join(lines) + "\n"


def staged_generation_config(root: Path, ids: dict[str, Any]) -> list[tuple[str, str]]:
    """The generation_config.json of `root` with its token ids replaced by `ids` (a key whose new id is None
    is dropped; the decoder start id too, as it pointed into the old vocabulary), staged content-addressed
    to replace the copied file; nothing when there is none or it cannot be read."""
    gen = root / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        data = json.loads(gen.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(data, dict):
        return []
    for key in _GENERATION_KEYS:
        if ids.get(key) is None:
            data.pop(key, None)
        else:
            data[key] = ids[key]
    text = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    target = staging_root() / "generation" / hashlib.sha256(text).hexdigest() / "generation_config.json"
    if not target.is_file():
        write_atomic(target, text)
    return [(str(target), "generation_config.json")]


def _tokenizer_root(ck: Checkpoint) -> Path:
    return Path(getattr(ck, "tokenizer_root", ck.root))


def describe_counts(counts: dict[str, dict[str, int]]) -> str:
    """`embed: 1256 exact, 503 approximated; lm_head: ...` for the command's summary line."""
    parts = []
    for name, c in counts.items():
        inner = ", ".join(f"{v} {k}" for k, v in c.items() if v)
        parts.append(f"{name}: {inner}")
    return "; ".join(parts)


__all__ = ["SurgeryOptions", "TokenSurgeonPlanner", "Vocabulary", "describe_counts"]
