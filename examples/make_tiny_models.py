"""Build three tiny llama-style models (random init, seeded) for the quick start: no download needed.

Why transformers: the demo's models must be real checkpoints that `AutoModelForCausalLM` loads, saved
exactly as `save_pretrained` saves them. Each is ~1 MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(root: Path) -> None:
    for seed in range(3):
        out = root / f"tiny-llama-{seed}"
        if (out / "config.json").is_file():
            continue
        torch.manual_seed(seed)
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=256,
        )
        LlamaForCausalLM(config).save_pretrained(out)
        print(f"built {out}")


if __name__ == "__main__":
    build(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/models"))
