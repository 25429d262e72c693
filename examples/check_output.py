"""Load merged models with transformers and run a forward pass: the proof a merge is usable."""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM


def check(path: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"{path}: loading reported {problems}")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 42]])).logits
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{path}: non-finite logits")
    print(
        f"{path}: loads in transformers ({model.config.num_hidden_layers} layers, {model.dtype}), "
        f"logits finite, shape {list(logits.shape)}"
    )


if __name__ == "__main__":
    for p in sys.argv[1:]:
        check(p)
