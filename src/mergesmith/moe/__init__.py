"""Mixture-of-experts assembly from dense models (mergekit-moe's config format).

`build_moe_plan` turns a config into a Plan for the shared executor; `run_moe` computes the router
weights and writes the model through the same journaled, resumable output protocol as merges.
Importing this package never imports transformers; only the prompt gate modes do, when they run.
"""

from __future__ import annotations

from .api import build_moe_plan, run_moe
from .config import MoEConfiguration, is_moe_config_file, load_moe_config, looks_like_moe, parse_moe_config

__all__ = [
    "MoEConfiguration",
    "build_moe_plan",
    "is_moe_config_file",
    "load_moe_config",
    "looks_like_moe",
    "parse_moe_config",
    "run_moe",
]
