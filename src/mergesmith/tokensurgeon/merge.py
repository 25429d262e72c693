"""`tokenizer_source: transplant:<donor>` in a merge config: models with foreign tokenizers join a merge.

The output takes the donor's tokenizer (the donor is one of the config's models). Each model feeding
the token embedding or the output head is first transplanted onto the donor's vocabulary, exactly as
`mergesmith tokensurgeon MODEL DONOR` would (its own rows for the tokens it shares with the donor, OMP
with k=64 over the donor's embeddings for the others; k is lowered to the shared count when fewer
tokens are shared, and to half the donor's hidden size when that is smaller: a k near the width fits
every token exactly and carries little over, see the README), and the merge method then runs on rows
that mean the same token in every model. The donor's own rows pass through unchanged.

The merge planner runs `plan_transplant` (registered as a vocabulary step in registration.py, standing in
for the tokenizer step) when it sees the prefix, and gets back the same kind of TokenizerPlan (recipes,
files, vocabulary rows, token ids), so config.json, the copied files and `mergesmith plan` follow as for any
tokenizer source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..engine.plan import InputRef, TensorRecipe
from ..engine.planning.architecture import LM_HEAD_NAMES, embedding_for_head
from ..errors import CheckpointError, ConfigError
from ..tokenizer.planning import TokenizerPlan
from .planner import _tokenizer_root, staged_generation_config
from .source import transplant_donor
from .table import TransplantTable, register, transplant_rows
from .vocab import Vocabulary, assign_rows, load_vocabulary

if TYPE_CHECKING:
    from ..engine.extensions import PlanningView as Planner

MERGE_OP = "transplant_merge"
DEFAULT_K = 64


def plan_transplant(planner: Planner, recipes: list[TensorRecipe], source: str) -> TokenizerPlan:
    """Rewrite the embedding and lm_head recipes of a merge to transplant every input onto the donor's
    vocabulary before merging; the output gets the donor's tokenizer files, vocab size and token ids."""
    from ..io.model_files import TOKENIZER_FILES

    donor_ref = transplant_donor(source) or ""
    key = f"{planner.source}: `tokenizer_source`"
    refs = planner.config.referenced_models()
    if donor_ref not in planner.ckpts:
        listed = ", ".join(repr(r) for r in refs)
        raise ConfigError(f"{key}: donor {donor_ref!r} of {source!r} is not one of the config's models ({listed})")
    trust = planner.options.trust_remote_code
    donor = planner.ckpts[donor_ref]
    vocabs: dict[str, Vocabulary] = {}
    for ref in refs:
        vocabs[ref] = load_vocabulary(_tokenizer_root(planner.ckpts[ref]), f"{key}: model {ref!r}", trust)
    donor_vocab = vocabs[donor_ref]
    donor_embed = embedding_for_head(donor.tensors, planner.stacks[donor_ref])
    if donor_embed is None:
        raise CheckpointError(f"{key}: donor {donor_ref!r} has no token embedding (OMP reads it)")
    donor_head = next((n for n in LM_HEAD_NAMES if n in donor.tensors), donor_embed)
    embed = embedding_for_head(planner.base.tensors, planner.stacks[planner.base_ref])
    names = {n: n in LM_HEAD_NAMES for n in (*LM_HEAD_NAMES, embed) if n is not None}

    out: list[TensorRecipe] = []
    rows = donor_vocab.size
    counts: dict[str, dict[str, int]] = {}
    for recipe in recipes:
        if recipe.name not in names:
            out.append(recipe)
            continue
        head = names[recipe.name]
        donor_tensor = donor_head if head else donor_embed
        donor_rows = donor.info(donor_tensor).shape[0]
        digests: list[str] = []
        ks: list[int] = []
        inputs = [InputRef(i.model, i.tensor) for i in recipe.inputs]
        if recipe.op == "copy":
            inputs = inputs[:1]
        widths = {ref.model: planner.ckpts[ref.model].info(ref.tensor).shape[1:] for ref in inputs}
        if len(set(widths.values())) > 1:
            detail = ", ".join(f"{m} {list(w)}" for m, w in widths.items())
            raise CheckpointError(
                f"{key}: tensor {recipe.name!r} has different widths in the merged models ({detail}); "
                "a transplant changes rows, not widths"
            )
        for ref in inputs:
            model_rows = planner.ckpts[ref.model].info(ref.tensor).shape[0]
            found = assign_rows(vocabs[ref.model], donor_vocab, model_rows, donor_rows, False, False)
            shared = found.shared_base.numel()
            if shared == 0:
                raise ConfigError(f"{key}: model {ref.model!r} shares no token with donor {donor_ref!r}")
            counts[f"{recipe.name} <- {ref.model}"] = found.counts
            table = TransplantTable.of(found)
            digests.append(register(table))
            ks.append(max(1, min(DEFAULT_K, shared, donor.info(donor_tensor).shape[1] // 2)))
        params = (
            *recipe.params,
            ("transplant_tables", tuple(digests)),
            ("transplant_k", tuple(ks)),
            ("transplant_device", planner.options.device),
            ("transplant_dtype", planner.compute_dtype),
        )
        out.append(
            replace(
                recipe,
                shape=(rows, *recipe.shape[1:]),
                op=MERGE_OP,
                inputs=(*inputs, InputRef(donor_ref, donor_tensor)),
                method=recipe.method if recipe.op != "copy" else None,
                base_index=recipe.base_index if recipe.op != "copy" else None,
                model_params=recipe.model_params[: len(inputs)] if recipe.op != "copy" else (),
                params=params,
            )
        )
    root = _tokenizer_root(donor)
    files = [(str(root / n), n) for n in TOKENIZER_FILES if (root / n).is_file()]
    ids = {k: v for k, v in donor_vocab.special_ids.items() if v is not None}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in (donor.config or {}):
            ids[k] = (donor.config or {})[k]
    files.extend(staged_generation_config(planner.base.root, ids))
    summary = {"donor": donor_ref, "vocab_size": rows, "tensors": counts}  # for the report (`mergesmith plan`)
    return TokenizerPlan(out, files, rows, ids, plan_options={"tokensurgeon": summary})


def transplant_merge_op(recipe: Any, load: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """The registered op: transplant each input onto the donor's vocabulary, then merge (or copy)."""
    from ..io.dtypes import to_torch
    from ..tokenizer.align import merge_rows
    from .table import lookup

    params = dict(recipe.params)
    digests, ks = params.pop("transplant_tables"), params.pop("transplant_k")
    device = params.pop("transplant_device")
    dtype = to_torch(str(params.pop("transplant_dtype")))
    donor = load(recipe.inputs[-1])
    aligned = []
    for ref, digest, k in zip(recipe.inputs[:-1], digests, ks):
        table = lookup(str(digest))
        rows = transplant_rows(table, load(ref), donor, {"method": "omp", "k": k, "device": device})
        aligned.append(rows.to(dtype))
    return merge_rows(recipe, aligned, params)
