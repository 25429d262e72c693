"""The model card (README.md) written beside a merge: inputs, method, and the config that made it."""

from __future__ import annotations

import yaml

from . import __version__
from .config import MergeConfiguration, dump_config


def model_card(config: MergeConfiguration, random_seed: int | None = None) -> str:
    """A Hugging Face model card with front matter listing the input models as `base_model`."""
    models = config.referenced_models()
    front = {"base_model": models, "library_name": "transformers", "tags": ["mergesmith", "merge"]}
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "# Merged model",
        "",
        f"This model was made with [mergesmith](https://pypi.org/project/mergesmith/) {__version__} "
        f"using the **{config.merge_method}** merge method.",
        "",
    ]
    if config.base_model:
        lines += [f"Base model: `{config.base_model}`.", ""]
    lines += ["## Input models", ""]
    lines += [f"- `{m}`" for m in models]
    if random_seed is not None:
        lines += ["", f"Random seed: `{random_seed}` (rerun with `--random-seed {random_seed}` to reproduce)."]
    lines += ["", "## Configuration", "", "```yaml", dump_config(config).rstrip(), "```", ""]
    return "\n".join(lines)
