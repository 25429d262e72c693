"""The model card (README.md) written beside an MoE assembly: base, experts, routing and the config."""

from __future__ import annotations

from .._version import __version__
from ..engine.card import describe_ref, front_matter
from .config import MoEConfiguration, dump_moe_config


def moe_model_card(config: MoEConfiguration, architecture: str, random_seed: int | None = None) -> str:
    """A Hugging Face model card whose front matter lists the input models' Hub ids as `base_model`."""
    n = len(config.experts)
    lines = [
        front_matter(config.referenced_models(), ["mergesmith", "moe"]),
        "# Mixture of experts",
        "",
        f"This {architecture} model was assembled with [mergesmith](https://pypi.org/project/mergesmith/) "
        f"{__version__} from {n} dense expert{'s' if n != 1 else ''} ({config.experts_per_token} per token), "
        f"router weights from gate mode `{config.gate_mode}`.",
        "",
        f"Attention and norms: {describe_ref(config.base_model)}.",
        "",
        "## Experts",
        "",
    ]
    lines += [f"{i}. {describe_ref(e.source_model)}" for i, e in enumerate(config.experts)]
    for e in config.shared_experts or []:
        lines += ["", f"Shared expert: {describe_ref(e.source_model)}."]
    if random_seed is not None:
        lines += ["", f"Random seed: `{random_seed}` (rerun with `--random-seed {random_seed}` to reproduce)."]
    lines += ["", "## Configuration", "", "```yaml", dump_moe_config(config).rstrip(), "```", ""]
    return "\n".join(lines)
