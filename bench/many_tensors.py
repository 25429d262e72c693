"""A merge's cost per tensor, at growing tensor counts: the overhead a mixture of experts stored one expert per
tensor meets (Qwen3-30B-A3B ~18,900 tensors, DeepSeek-V3 ~91,000), which the 1b bench's 201 tensors never show.

    python bench/many_tensors.py [--layers 250,1000,2000] [--method linear] [--runs 1]
                                 [--with-mergekit [--mergekit-max-layers 250] [--mergekit-timeout 900]]

For each size, three llama-shaped bf16 checkpoints of that many layers (9 tensors a layer of hidden 16, so the
bytes are negligible and what is timed is the work per tensor) are written under the models root (once; reused),
and each tool merges them in a fresh process, page cache warm (the inputs are a few MB). It prints seconds and
milliseconds per tensor: a tool whose per-tensor cost grows with the count has a step that is quadratic in the
tensor count. mergekit runs only up to --mergekit-max-layers and under --mergekit-timeout (it is much slower).

Why by hand: no library writes thousands of tiny tensors faster than safetensors' own `save_file`, and the
random init of transformers for 2,000 layers would take longer than the merges timed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import benchlib as bl
import compare_mergekit as cm
import make_models

HIDDEN, INTERMEDIATE, VOCAB = 16, 32, 64
TENSORS_A_LAYER = 9
DEFAULT_ROOT = make_models.DEFAULT_ROOT / "many"


def write_llama(root: Path, layers: int, seed: int) -> Path:
    """A llama-shaped bf16 checkpoint of `layers` layers of hidden 16: 9 tensors a layer plus 3, one file."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    shapes["model.norm.weight"] = (HIDDEN,)
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}mlp.gate_proj.weight"] = shapes[f"{p}mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{p}mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (HIDDEN,)
    tensors = {name: torch.randn(*shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (root / "config.json").write_text(json.dumps(config))
    return root


def models_of(root: Path, layers: int) -> list[Path]:
    """The three checkpoints of one size, written unless a complete set is there."""
    out = []
    for seed in range(3):
        path = root / f"L{layers}" / f"model{seed}"
        if not (path / "config.json").exists():
            write_llama(path, layers, seed)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="250,1000,2000", help="comma-separated layer counts (9 tensors a layer)")
    ap.add_argument("--method", default="linear", choices=["linear", "ties", "dare_ties"])
    ap.add_argument("--runs", type=int, default=1, help="runs per tool and size; medians reported")
    ap.add_argument("--with-mergekit", action="store_true", help="also run mergekit (scripts/mergekit_venv.sh)")
    ap.add_argument("--mergekit-yaml", type=Path, default=None, help="a mergekit-yaml of a venv made elsewhere")
    ap.add_argument("--mergekit-max-layers", type=int, default=250, help="largest size mergekit runs (default 250)")
    ap.add_argument("--mergekit-timeout", type=float, default=900, help="seconds before a mergekit run is stopped")
    ap.add_argument("--models-root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--out-root", type=Path, default=bl.DEFAULT_OUT_ROOT)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.layers.split(",") if x]
    mergekit = args.mergekit_yaml or (cm.install_mergekit() if args.with_mergekit else None)
    # both tools' command lines as compare_mergekit runs them (its defaults: 5B shards, no tokenizer, seed 0)
    tools = cm.Tools(cm.build_parser().parse_args(["--mergekit-yaml", str(mergekit)] if mergekit else []))
    rows = []
    for layers in sizes:
        models = models_of(args.models_root, layers)
        tensors = layers * TENSORS_A_LAYER + 3
        config = bl.write_config(bl.make_config(args.method, models), args.out_root / "configs" / f"many-{layers}.yml")
        times: dict[str, str] = {}
        for tool in tools.names:
            if tool == "mergekit" and layers > args.mergekit_max_layers:
                times[tool] = "-"
                continue
            out = args.out_root / f"many-{tool}-{layers}"
            cmd = tools.command(tool, args.method, config, out)
            walls = []
            for _ in range(max(1, args.runs)):
                bl.rm_out(out)
                bl.log(f"[{layers} layers, {tensors} tensors] {tool} ...")
                try:
                    walls.append(bl.run_timed(cmd, cold=False, out_dir=out, timeout=args.mergekit_timeout
                                              if tool == "mergekit" else None).total_s)
                except subprocess.TimeoutExpired:
                    walls.append(float("inf"))
                    break
            bl.rm_out(out)
            wall = bl.median(walls)
            times[tool] = (f"{wall:.1f} s, {1000 * wall / tensors:.2f} ms/tensor" if wall != float("inf")
                           else f"> {args.mergekit_timeout:.0f} s (stopped)")
        rows.append([str(layers), str(tensors), times["mergesmith"], times.get("mergekit", "not run")])
    print(f"{args.method} merge of 3 llama-shaped bf16 checkpoints (hidden {HIDDEN}), page cache warm, wall+sync, "
          f"median of {args.runs}")
    print(bl.table(["layers", "tensors", "mergesmith", "mergekit"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
