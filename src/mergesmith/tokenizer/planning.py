"""The tokenizer planning step: output tokenizer, chat template, and vocabulary recipes.

Run by the merge planner, as the vocabulary step registration.py registers with the engine, only when a
config has a `tokenizer` section, `tokenizer_source` or `chat_template` (a plain merge never imports
transformers). It
- builds the output tokenizer (build.py) and sets the chat template (templates.py);
- saves the tokenizer into a content-addressed staging directory whose files the plan copies into
  the output like any other tokenizer file;
- rewrites the embedding and lm_head recipes into `vocab_merge` recipes that re-index every input
  to the output vocabulary before the merge method runs (align.py);
- gives the output config its new `vocab_size` and moves bos/eos/pad ids to the output tokenizer,
  in config.json and in the base's generation_config.json alike (a staged rewrite of which replaces
  the copied file, since generate() reads its ids from there).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engine.plan import InputRef, TensorRecipe
from ..engine.planning.architecture import LM_HEAD_NAMES, embedding_for_head
from ..errors import CheckpointError, ConfigError
from .align import (
    DTYPE_PARAM,
    MAP_PARAM,
    VOCAB_OP,
    build_alignment,
    parse_token_rules,
    register,
    staging_root,
    write_atomic,
)
from .build import VocabularyBuild, build_vocabulary, load_tokenizer, require_transformers
from .templates import resolve_chat_template

if TYPE_CHECKING:
    from ..engine.extensions import PlanningView as Planner  # what a vocabulary step reads from the planner


# Load-time arguments transformers 5 writes back into tokenizer_config.json; a saved
# `local_files_only: true` would make the published model refuse to load from the hub.
_LOAD_ONLY_KEYS = ("local_files_only", "is_local")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass
class TokenizerPlan:
    """What the tokenizer step changes in the plan."""

    recipes: list[TensorRecipe]
    files: list[tuple[str, str]] | None  # tokenizer files to write instead of the copied ones
    vocab_rows: int | None
    token_ids: dict[str, Any] = field(default_factory=dict)  # config key -> new id(s)
    warnings: list[str] = field(default_factory=list)
    plan_options: dict[str, Any] = field(default_factory=dict)  # entries for Plan.options (a transplant's summary)

    def finish_config(self, config: dict[str, Any]) -> None:
        """Move special-token ids in the output config.json to the output vocabulary."""
        for holder in (config, config.get("text_config")):
            if isinstance(holder, dict):
                for key, value in self.token_ids.items():
                    if key in holder:
                        holder[key] = value


def tokenizer_source(planner: Planner) -> str | None:
    """The configured vocabulary source, or None when the config leaves the tokenizer alone.

    A `tokenizer` section without `source` means `union`, as in mergekit.
    """
    cfg = planner.config
    if cfg.tokenizer is not None:
        return cfg.tokenizer.source  # defaults to "union", as in mergekit
    return cfg.tokenizer_source


def plan_tokenizer(planner: Planner, recipes: list[TensorRecipe]) -> TokenizerPlan:
    """Run the tokenizer step for `planner`'s config over its planned `recipes`."""
    cfg = planner.config
    trust = planner.options.trust_remote_code
    source = tokenizer_source(planner)
    if source is None:
        return _chat_template_only(planner, recipes)
    require_transformers("`tokenizer`/`tokenizer_source`")

    refs = cfg.referenced_models()
    roots = {ref: getattr(planner.ckpts[ref], "tokenizer_root", planner.ckpts[ref].root) for ref in refs}
    rows = {ref: _embedding_rows(planner, ref) for ref in refs}
    tokens = dict(cfg.tokenizer.tokens or {}) if cfg.tokenizer is not None else {}
    pad = cfg.tokenizer.pad_to_multiple_of if cfg.tokenizer is not None else None
    if pad is not None and pad < 1:
        raise ConfigError(f"{planner.source}: `tokenizer.pad_to_multiple_of` must be a positive integer, got {pad}")
    build = build_vocabulary(source, planner.base_ref, refs, roots, rows, list(tokens), pad, trust, planner.source)
    warnings = list(build.warnings)
    if cfg.chat_template:
        _set_chat_template(planner, build.tokenizer, refs)
    files = _stage_tokenizer(build.tokenizer)
    move = _token_mover(planner, build)
    files.extend(_stage_generation_config(planner, move))

    vocab_names = _vocab_tensor_names(planner)
    out: list[TensorRecipe] = []
    for recipe in recipes:
        out.append(_vocab_recipe(planner, recipe, build, tokens) if recipe.name in vocab_names else recipe)
    orphans = torch.stack(list(build.permutations.values())).lt(0).all(dim=0).nonzero().flatten().tolist()
    by_id = build.tokens_by_id
    for tok in (by_id[i] for i in orphans):
        if tok not in tokens:
            warnings.append(f"token {tok!r} is in no input model; its embedding is zero")
    return TokenizerPlan(out, files, build.rows, _moved_token_ids(planner, move), warnings)


def _chat_template_only(planner: Planner, recipes: list[TensorRecipe]) -> TokenizerPlan:
    """`chat_template` without vocabulary changes: reserialize the copied tokenizer with the template."""
    if not planner.options.copy_tokenizer:
        return TokenizerPlan(recipes, None, None, warnings=["chat_template is set but the tokenizer is not copied"])
    require_transformers("`chat_template`")
    base = planner.ckpts[planner.base_ref]
    root = getattr(base, "tokenizer_root", base.root)
    try:
        tokenizer = load_tokenizer(root, planner.options.trust_remote_code)
    except CheckpointError as exc:
        raise ConfigError(
            f"{planner.source}: `chat_template`: cannot load the base model's tokenizer ({exc})"
        ) from None
    _set_chat_template(planner, tokenizer, planner.config.referenced_models())
    return TokenizerPlan(recipes, _stage_tokenizer(tokenizer), None)


def _set_chat_template(planner: Planner, tokenizer: Any, refs: list[str]) -> None:
    value = planner.config.chat_template or ""
    inputs: list[str | None] = []
    if value == "auto":
        for ref in refs:
            try:
                ck = planner.ckpts[ref]
                root = getattr(ck, "tokenizer_root", ck.root)
                template = load_tokenizer(root, planner.options.trust_remote_code).chat_template
            except CheckpointError:
                template = None
            inputs.append(template.get("default") if isinstance(template, dict) else template)
    template = resolve_chat_template(value, inputs, planner.source)
    if template is not None:
        tokenizer.chat_template = template


def _stage_tokenizer(tokenizer: Any) -> list[tuple[str, str]]:
    """Save the tokenizer once per distinct content; return (staged file, output name) pairs."""
    with tempfile.TemporaryDirectory(prefix="mergesmith-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        config_path = Path(tmp) / "tokenizer_config.json"
        if config_path.is_file():
            data = json.loads(config_path.read_text(encoding="utf-8"))
            for key in _LOAD_ONLY_KEYS:
                data.pop(key, None)
            config_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        names = sorted(p.name for p in Path(tmp).iterdir() if p.is_file())
        digest = hashlib.sha256()
        for name in names:
            digest.update(name.encode() + b"\0" + (Path(tmp) / name).read_bytes() + b"\0")
        target = staging_root() / "tokenizers" / digest.hexdigest()
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
            for name in names:
                shutil.copy2(Path(tmp) / name, partial / name)
            try:
                partial.rename(target)
            except OSError:  # another planner staged the same content first
                shutil.rmtree(partial, ignore_errors=True)
    return [(str(target / name), name) for name in names]


def _embedding_rows(planner: Planner, ref: str) -> int:
    """Rows of a model's token embedding: the ids its tokenizer may really use."""
    ck = planner.ckpts[ref]
    name = embedding_for_head(ck.tensors, planner.stacks[ref])
    if name is not None:
        return ck.info(name).shape[0]
    cfg = ck.config or {}
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise CheckpointError(f"model {ref!r}: no token embedding and no vocab_size; cannot merge its vocabulary")
    return size


def _vocab_tensor_names(planner: Planner) -> set[str]:
    """Output tensors indexed by token: the token embedding and the lm_head (not position embeddings)."""
    names = set(LM_HEAD_NAMES)
    embed = embedding_for_head(planner.base.tensors, planner.stacks[planner.base_ref])
    if embed is not None:
        names.add(embed)
    return names


def _vocab_recipe(
    planner: Planner,
    recipe: TensorRecipe,
    build: VocabularyBuild,
    tokens: dict[str, Any],
) -> TensorRecipe:
    """`recipe` re-planned to re-index its inputs to the output vocabulary before merging."""
    inputs = tuple(InputRef(i.model, i.tensor) for i in recipe.inputs)
    if recipe.op == "copy":
        inputs, method, base_index = inputs[:1], None, None
    else:
        method, base_index = recipe.method, recipe.base_index
    refs = [i.model for i in inputs]
    infos = [planner.ckpts[i.model].info(i.tensor) for i in inputs]
    if len({info.shape[1:] for info in infos}) > 1:
        detail = ", ".join(f"{i.model} {list(info.shape)}" for i, info in zip(inputs, infos))
        raise CheckpointError(f"tensor {recipe.name!r}: shapes differ beyond the vocabulary ({detail})")
    for ref, info in zip(refs, infos):
        if info.shape[0] < build.model_rows[ref]:
            raise CheckpointError(
                f"model {ref!r}: {recipe.name!r} has {info.shape[0]} rows but its token embedding has "
                f"{build.model_rows[ref]}; cannot align its vocabulary"
            )
    base_ref = refs[base_index] if base_index is not None else planner.config.base_model
    base_pos = refs.index(base_ref) if base_ref in refs else None
    perms = [build.permutations[r] for r in refs]
    rules = parse_token_rules(
        tokens, build.vocab, refs, perms, build.original_vocabs, build.model_rows, recipe.name, planner.source
    )
    digest = register(build_alignment(perms, base_pos, build.rows, rules))
    params = (*recipe.params, (MAP_PARAM, digest), (DTYPE_PARAM, planner.compute_dtype))
    return replace(
        recipe,
        shape=(build.rows, *recipe.shape[1:]),
        op=VOCAB_OP,
        inputs=inputs,
        method=method,
        base_index=base_index,
        model_params=recipe.model_params[: len(inputs)],
        params=params,
    )


def _token_mover(planner: Planner, build: VocabularyBuild) -> Callable[[Any], Any]:
    """A function re-pointing a base-vocabulary id (or a list of ids) at the same token in the output
    vocabulary; ids it cannot place (not a base token, or a token the output lacks) stay as they are."""
    base_vocab = build.original_vocabs.get(planner.base_ref) or {}
    by_id = {idx: tok for tok, idx in base_vocab.items()}

    def move_one(idx: Any) -> Any:
        if isinstance(idx, int) and not isinstance(idx, bool) and idx in by_id and by_id[idx] in build.vocab:
            return build.vocab[by_id[idx]]
        return idx

    def move(value: Any) -> Any:
        return [move_one(v) for v in value] if isinstance(value, list) else move_one(value)

    return move


def _moved_token_ids(planner: Planner, move: Callable[[Any], Any]) -> dict[str, Any]:
    """Special-token ids of the base config, re-pointed at the same tokens in the output vocabulary."""
    cfg = planner.base.config or {}
    scopes = [cfg, cfg.get("text_config") or {}]
    moved: dict[str, Any] = {}
    for scope in scopes:
        if not isinstance(scope, dict):
            continue
        for key in _TOKEN_ID_KEYS:
            if key in scope and key not in moved:
                value = scope[key]
                new = move(value)
                if new != value:
                    moved[key] = new
    return moved


def _stage_generation_config(planner: Planner, move: Callable[[Any], Any]) -> list[tuple[str, str]]:
    """The base's generation_config.json with its special-token ids moved like config.json's, staged
    (content-addressed) to replace the copied file; nothing when no id moves or there is none."""
    path = planner.base.root / "generation_config.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return []  # copied as it is, like any other small file
    if not isinstance(data, dict):
        return []
    changed = False
    for key in _TOKEN_ID_KEYS:
        if key in data:
            new = move(data[key])
            changed |= new != data[key]
            data[key] = new
    if not changed:
        return []
    text = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    target = staging_root() / "generation" / hashlib.sha256(text).hexdigest() / "generation_config.json"
    if not target.is_file():
        write_atomic(target, text)
    return [(str(target), "generation_config.json")]
