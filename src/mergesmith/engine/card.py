"""The model card (README.md) written beside a merge: inputs, method, and the config that made it.

The front matter's `base_model:` is Hub metadata: the Hub, and tools that read it (llama.cpp's converter
writes it into GGUF as `general.base_model.N.repo_url`), turn each entry into
`https://huggingface.co/<entry>`. A local path there becomes a bogus URL (`https://huggingface.co//tmp/a`),
so only Hub ids go there; local inputs are named in the card's text.

`base_model_relation: merge` says how the model relates to those ids (the Hub's values are adapter, merge,
quantized and finetune; left out, the Hub guesses from the files, and a merge's files look like a
fine-tune's). The `merge` tag is the one published merges carry, beside `mergesmith`.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from .._version import __version__
from ..config import MergeConfiguration, dump_config

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""`owner/name` as the Hub spells repository ids (one slash, no leading dot, no path segments)."""
_HF_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<owner>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+")
"""A snapshot directory of the Hugging Face cache (`.../hub/models--owner--name/snapshots/<commit>`)."""


def hub_id(ref: str) -> str | None:
    """The Hub repository id `ref` names, or None for a local path.

    A reference that exists on disk is local even when it looks like `owner/name` (a relative directory),
    as io.checkpoint resolves it, unless it is a snapshot in the Hugging Face cache, whose path names its
    repository; `id@revision` names the repository `id`.
    """
    bare = ref.split("@", 1)[0]
    if Path(ref).expanduser().exists() or Path(bare).expanduser().exists():
        cached = _HF_CACHE_SNAPSHOT.search(ref)
        return f"{cached['owner']}/{cached['name']}" if cached else None
    return bare if _HUB_ID.match(bare) else None


def hub_ids(refs: list[str]) -> list[str]:
    """The Hub ids among model references, each once, in order; a `model+lora` reference gives both parts."""
    found = [hub_id(part) for ref in refs for part in (ref.split("+") if "+" in ref else [ref])]
    return list(dict.fromkeys(h for h in found if h is not None))


def front_matter(refs: list[str], tags: list[str]) -> str:
    """The front matter of a merge's card (MoE assemblies included); `base_model` lists the Hub ids only, and
    is left out when there are none; the tags always include `merge`."""
    front: dict[str, object] = {}
    ids = hub_ids(refs)
    if ids:
        front["base_model"] = ids
    front["base_model_relation"] = "merge"
    front.update({"library_name": "transformers", "tags": list(dict.fromkeys([*tags, "merge"]))})
    return "\n".join(["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---"])


def describe_ref(ref: str) -> str:
    """A model reference for the card's text: local paths say so (they are not in the front matter)."""
    return f"`{ref}`" if hub_ids([ref]) else f"`{ref}` (local)"


def model_card(config: MergeConfiguration, random_seed: int | None = None) -> str:
    """A Hugging Face model card with front matter listing the input models' Hub ids as `base_model`."""
    models = config.referenced_models()
    lines = [
        front_matter(models, ["mergesmith", "merge"]),
        "# Merged model",
        "",
        f"This model was made with [mergesmith](https://pypi.org/project/mergesmith/) {__version__} "
        f"using the **{config.merge_method}** merge method.",
        "",
    ]
    if config.base_model:
        lines += [f"Base model: {describe_ref(config.base_model)}.", ""]
    lines += ["## Input models", ""]
    lines += [f"- {describe_ref(m)}" for m in models]
    if random_seed is not None:
        lines += ["", f"Random seed: `{random_seed}` (rerun with `--random-seed {random_seed}` to reproduce)."]
    lines += ["", "## Configuration", "", "```yaml", dump_config(config).rstrip(), "```", ""]
    return "\n".join(lines)
