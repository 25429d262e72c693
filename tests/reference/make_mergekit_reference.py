"""Regenerate the mergekit 0.1.5 reference fixtures that mergesmith's outputs are compared against.

    python tests/reference/make_mergekit_reference.py

Any python will do: unless it already runs inside a venv holding mergekit 0.1.5, the script runs
`scripts/mergekit_venv.sh` (idempotent; creates the venv on first use) and re-executes itself with that
venv's python. It needs only torch, safetensors, PyYAML and mergekit, never mergesmith.

What it writes, all under tests/reference/ (committed, ~1 MB in all):

- `inputs/<model>/{config.json, model.safetensors}`: tiny llama-style checkpoints (hidden 16, 3 layers,
  vocab 48, GQA with one kv head, float32), built from seeded torch generators. `ft_*` are "fine-tunes" of
  `base`: base + a task vector made of a component shared by all of them and one of their own, so task
  vectors are correlated (model_stock, TIES elections have something to do) but disagree in sign often.
  `ft_vocab` is `ft_a` with 8 more vocabulary rows.
- `configs/<case>.yml`: one merge config per case, exactly as a user would write it (paths relative to
  tests/reference/).
- `outputs/<case>.safetensors`: every tensor mergekit wrote for the case, float32 unless the config asks
  for another dtype.
- `manifest.json`: per case the method, options, output config facts and sha256 of each file;
- `calls.json.gz`: per case and output tensor, the exact call mergekit made: model order, base, input tensor
  names, resolved global and per-model parameters, and (randomised methods) the per-tensor seed. The
  unit-level test rebuilds each call from this without any planner.

Randomised methods (DARE, DELLA): mergekit draws from torch's global RNG in execution order, which no other
implementation can reproduce. Here every tensor's merge is preceded by `torch.manual_seed(s)` with
s = tensor_seed(random_seed, tensor name) (sha256 of "<seed>:<name>", first 8 bytes little-endian, top bit
cleared), the derivation mergesmith uses for its per-tensor generators. The outputs are therefore mergekit's
own arithmetic on the same random stream mergesmith draws from, and comparable bit for bit.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MERGEKIT_VERSION = "0.1.5"


def _ensure_mergekit_python() -> None:
    """Re-exec under the mergekit venv unless this interpreter already has mergekit 0.1.5."""
    try:
        from importlib.metadata import version

        if version("mergekit") == MERGEKIT_VERSION:
            return
    except Exception:
        pass
    if os.environ.get("_MERGESMITH_REFERENCE_REEXEC"):
        sys.exit("mergekit 0.1.5 is not importable even in the mergekit venv")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "mergekit_venv.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    python = out.stdout.strip().splitlines()[-1]
    env = dict(os.environ, _MERGESMITH_REFERENCE_REEXEC="1")
    os.execve(python, [python, str(Path(__file__).resolve()), *sys.argv[1:]], env)


# ----- tiny checkpoints ---------------------------------------------------------------------------

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, HEADS, KV_HEADS = 16, 16, 3, 48, 2, 1
HEAD_DIM = HIDDEN // HEADS

MODEL_SEEDS = {"ft_a": 101, "ft_b": 202, "ft_c": 303}
SHARED_SEED = 7
BASE_SEED = 1


def tensor_shapes(vocab: int = VOCAB) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN)}
    return shapes


def llama_config(vocab: int = VOCAB) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
    }


def build_inputs() -> dict[str, dict[str, torch.Tensor]]:
    import torch

    def noise(seed: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1000 + index)
        return torch.randn(shape, generator=g, dtype=torch.float32)

    shapes = tensor_shapes()
    base = {}
    for k, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            base[name] = 1.0 + 0.1 * noise(BASE_SEED, k, shape)
        else:
            base[name] = 0.2 * noise(BASE_SEED, k, shape)
    models = {"base": base}
    for model, seed in MODEL_SEEDS.items():
        tensors = {}
        for k, (name, shape) in enumerate(shapes.items()):
            shared = noise(SHARED_SEED, k, shape)
            own = noise(seed, k, shape)
            tensors[name] = base[name] + 0.02 * (0.6 * shared + 0.8 * own)
        models[model] = tensors
    vocab = dict(models["ft_a"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = 0.2 * noise(999, 0 if name.startswith("model") else 1, (8, HIDDEN))
        vocab[name] = torch.cat([vocab[name], extra], dim=0)
    models["ft_vocab"] = vocab
    # bf16 copies, for merges of bf16 checkpoints whose config names no `dtype` (mergekit then computes in bf16)
    for name in ("base", "ft_a", "ft_c"):
        models[f"{name}_bf16"] = {k: v.to(torch.bfloat16) for k, v in models[name].items()}
    return models


def write_inputs(models: dict) -> None:
    import torch
    from safetensors.torch import save_file

    root = HERE / "inputs"
    shutil.rmtree(root, ignore_errors=True)
    for name, tensors in models.items():
        d = root / name
        d.mkdir(parents=True)
        vocab = tensors["model.embed_tokens.weight"].shape[0]
        config = llama_config(vocab)
        if tensors["model.embed_tokens.weight"].dtype == torch.bfloat16:
            config["dtype"] = "bfloat16"
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"), {"format": "pt"})


# ----- cases -------------------------------------------------------------------------------------

RANDOM_SEED = 1234

CASES: dict[str, dict] = {}


def case(name: str, yaml_text: str, *, random_seed: int | None = None, options: dict | None = None) -> None:
    CASES[name] = {"yaml": yaml_text.strip() + "\n", "random_seed": random_seed, "options": options or {}}


case(
    "linear",
    """
merge_method: linear
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.3}
  - model: inputs/ft_c
    parameters: {weight: [0.1, 0.4]}
""",
)
case(
    "slerp",
    """
merge_method: slerp
base_model: inputs/base
models:
  - model: inputs/base
  - model: inputs/ft_a
parameters:
  t: 0.3
""",
)
case(
    "slerp_slices_gradient_filters",
    """
merge_method: slerp
base_model: inputs/ft_a
slices:
  - sources:
      - model: inputs/ft_a
        layer_range: [0, 3]
      - model: inputs/ft_b
        layer_range: [0, 3]
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
""",
)
case(
    "nuslerp_flatten",
    """
merge_method: nuslerp
models:
  - model: inputs/ft_a
    parameters: {weight: 0.7}
  - model: inputs/ft_b
    parameters: {weight: 0.3}
""",
)
case(
    "nuslerp_base_rows",
    """
merge_method: nuslerp
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 1.0}
  - model: inputs/ft_c
    parameters: {weight: 2.0}
parameters:
  nuslerp_flatten: false
""",
)
case(
    "nuslerp_row_wise",
    """
merge_method: nuslerp
models:
  - model: inputs/ft_b
    parameters: {weight: 0.4}
  - model: inputs/ft_c
    parameters: {weight: 0.6}
parameters:
  nuslerp_flatten: false
  nuslerp_row_wise: true
""",
)
case(
    "multislerp_base",
    """
merge_method: multislerp
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.3}
  - model: inputs/ft_c
    parameters: {weight: 0.2}
""",
)
case(
    "multislerp_unnormalized",
    """
merge_method: multislerp
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.4}
  - model: inputs/ft_c
    parameters: {weight: 0.3}
parameters:
  normalize_weights: false
""",
)
case(
    "karcher",
    """
merge_method: karcher
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
  - model: inputs/ft_c
parameters:
  max_iter: 20
  tol: 1.0e-7
""",
)
case(
    "karcher_base_not_listed",
    """
merge_method: karcher
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
""",
)
case(
    "task_arithmetic",
    """
merge_method: task_arithmetic
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters:
      weight:
        - filter: mlp
          value: 0.8
        - value: 0.5
  - model: inputs/ft_b
    parameters: {weight: 0.3}
  - model: inputs/ft_c
    parameters: {weight: -0.2}
parameters:
  lambda: 0.9
""",
)
case(
    "task_arithmetic_base_listed_normalize",
    """
merge_method: task_arithmetic
base_model: inputs/base
models:
  - model: inputs/base
    parameters: {weight: 5.0}
  - model: inputs/ft_a
    parameters: {weight: 0.6}
  - model: inputs/ft_b
    parameters: {weight: [0.2, 1.0]}
parameters:
  normalize: true
""",
)
case(
    "ties",
    """
merge_method: ties
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 1.0, density: [0.3, 0.9]}
  - model: inputs/ft_b
    parameters: {weight: 0.5, density: 0.5}
  - model: inputs/ft_c
    parameters:
      weight: 0.7
      density:
        - filter: self_attn
          value: 0.4
        - value: 0.7
parameters:
  int8_mask: true
""",
)
case(
    "ties_unnormalized_lambda",
    """
merge_method: ties
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.6, density: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.6, density: 0.5}
parameters:
  normalize: false
  lambda: 1.5
  rescale: true
""",
)
case(
    "breadcrumbs",
    """
merge_method: breadcrumbs
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5, density: 0.8, gamma: 0.05}
  - model: inputs/ft_b
    parameters: {weight: 0.5, density: 0.9}
""",
)
case(
    "breadcrumbs_ties",
    """
merge_method: breadcrumbs_ties
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5, density: 0.7, gamma: 0.1}
  - model: inputs/ft_b
    parameters: {weight: 0.3, density: 0.6, gamma: 0.02}
  - model: inputs/ft_c
    parameters: {weight: 0.2, density: 0.5, gamma: 0.3}
parameters:
  rescale: true
""",
)
case(
    "sce",
    """
merge_method: sce
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
  - model: inputs/ft_c
parameters:
  select_topk: 0.6
""",
)
case(
    "model_stock",
    """
merge_method: model_stock
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
  - model: inputs/ft_c
""",
)
case(
    "model_stock_filter_wise",
    """
merge_method: model_stock
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
parameters:
  filter_wise: true
""",
)
case(
    "nearswap",
    """
merge_method: nearswap
base_model: inputs/base
models:
  - model: inputs/ft_a
parameters:
  t: 0.01
""",
)
case(
    "arcee_fusion",
    """
merge_method: arcee_fusion
base_model: inputs/base
models:
  - model: inputs/ft_b
""",
)
case(
    "ram",
    """
merge_method: ram
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
  - model: inputs/ft_c
parameters:
  epsilon: 0.012
""",
)
case(
    "ramplus_tl",
    """
merge_method: ramplus_tl
base_model: inputs/base
models:
  - model: inputs/ft_a
  - model: inputs/ft_b
parameters:
  epsilon: 0.015
  r: 0.5
  alpha: 0.6
""",
)
case(
    "task_arithmetic_slices",
    """
merge_method: task_arithmetic
base_model: inputs/base
slices:
  - sources:
      - model: inputs/base
        layer_range: [0, 2]
      - model: inputs/ft_a
        layer_range: [0, 2]
        parameters: {weight: 0.7}
      - model: inputs/ft_b
        layer_range: [0, 2]
        parameters: {weight: [0.2, 0.8]}
    parameters:
      lambda: 0.9
  - base_model: inputs/ft_a
    sources:
      - model: inputs/ft_a
        layer_range: [2, 3]
      - model: inputs/ft_c
        layer_range: [1, 2]
      - model: inputs/base
        layer_range: [2, 3]
        parameters: {weight: 0.25}
    parameters:
      lambda: 1.2
parameters:
  weight: 0.4
""",
)
case(
    "linear_bf16",
    """
merge_method: linear
models:
  - model: inputs/ft_a
    parameters: {weight: 0.3}
  - model: inputs/ft_b
    parameters: {weight: 0.5}
  - model: inputs/ft_c
    parameters: {weight: 0.7}
dtype: bfloat16
""",
)
case(
    "ties_bf16",
    """
merge_method: ties
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.6, density: 0.6}
  - model: inputs/ft_c
    parameters: {weight: 0.4, density: 0.6}
dtype: bfloat16
""",
)
# bf16 checkpoints and no `dtype`: mergekit computes in bf16, mergesmith in float32 (a deliberate deviation, see
# DEVIATIONS_E2E in test_mergekit_reference.py); the second case is mergekit told to compute in float32, which
# mergesmith's no-dtype output must equal bit for bit.
case(
    "ties_bf16_inputs_no_dtype",
    """
merge_method: ties
base_model: inputs/base_bf16
models:
  - model: inputs/ft_a_bf16
    parameters: {weight: 0.6, density: 0.6}
  - model: inputs/ft_c_bf16
    parameters: {weight: 0.4, density: 0.6}
""",
)
case(
    "ties_bf16_inputs_f32_compute",
    """
merge_method: ties
base_model: inputs/base_bf16
models:
  - model: inputs/ft_a_bf16
    parameters: {weight: 0.6, density: 0.6}
  - model: inputs/ft_c_bf16
    parameters: {weight: 0.4, density: 0.6}
dtype: float32
out_dtype: bfloat16
""",
)
case(
    "slerp_bf16_out_f32",
    """
merge_method: slerp
base_model: inputs/base
models:
  - model: inputs/ft_c
parameters:
  t: 0.6
dtype: bfloat16
out_dtype: float32
""",
)
case(
    "linear_vocab_truncated",
    """
merge_method: linear
models:
  - model: inputs/ft_vocab
    parameters: {weight: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.5}
""",
    options={"unsafe_truncate_embeddings": True},
)
case(
    "dare_ties",
    """
merge_method: dare_ties
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5, density: 0.5}
  - model: inputs/ft_b
    parameters: {weight: 0.3, density: 0.6}
  - model: inputs/ft_c
    parameters: {weight: 0.2, density: [0.3, 0.7]}
""",
    random_seed=RANDOM_SEED,
)
case(
    "dare_linear",
    """
merge_method: dare_linear
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.6, density: 0.4}
  - model: inputs/ft_b
    parameters: {weight: 0.6, density: 0.4}
parameters:
  normalize: true
""",
    random_seed=RANDOM_SEED,
)
case(
    "della",
    """
merge_method: della
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.5, density: 0.5, epsilon: 0.1}
  - model: inputs/ft_b
    parameters: {weight: 0.5, density: 0.6}
  - model: inputs/ft_c
    parameters: {weight: 0.3, density: 0.4, epsilon: 0.2}
""",
    random_seed=RANDOM_SEED,
)
case(
    "della_linear",
    """
merge_method: della_linear
base_model: inputs/base
models:
  - model: inputs/ft_a
    parameters: {weight: 0.7, density: 0.6, epsilon: 0.2}
  - model: inputs/ft_c
    parameters: {weight: 0.4, density: 0.5, epsilon: 0.1}
parameters:
  lambda: 1.1
""",
    random_seed=RANDOM_SEED,
)


def tensor_seed(global_seed: int, tensor_name: str) -> int:
    """Per-tensor seed: sha256 of "<seed>:<name>", first 8 bytes little-endian, top bit cleared."""
    digest = hashlib.sha256(f"{global_seed}:{tensor_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ----- running mergekit ---------------------------------------------------------------------------


def _jsonable(value):
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


class Recorder:
    """Wraps mergekit's per-tensor task: records each call, seeds the global RNG for randomised cases."""

    def __init__(self):
        self.calls: dict[str, dict] = {}
        self.seed: int | None = None

    def install(self):
        import torch
        from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask

        original = ExecuteMergeMethodTask.execute
        recorder = self

        def execute(task, tensors, **kwargs):
            name = task.output_weight.name
            info = task.gather_tensors
            while type(info).__name__ != "GatherTensors":  # vocabulary wrappers hold the gather task
                info = info.gather_tensors
            call = {
                "models": [str(m.model.path) for m in task.model_order],
                "tensors": [info.weight_info[m].name for m in task.model_order],
                "base": str(task.base_model.model.path) if task.base_model else None,
                "params": _jsonable(dict(task.parameters.items())),
                "model_params": [_jsonable(dict(task.input_parameters[m].items())) for m in task.model_order],
            }
            if recorder.seed is not None:
                call["seed"] = tensor_seed(recorder.seed, name)
                torch.manual_seed(call["seed"])
            recorder.calls[name] = call
            return original(task, tensors, **kwargs)

        ExecuteMergeMethodTask.execute = execute


def run_case(name: str, spec: dict, recorder: Recorder) -> tuple[dict, dict]:
    import torch
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
    from safetensors.torch import load_file, save_file

    (HERE / "configs" / f"{name}.yml").write_text(spec["yaml"])
    config = MergeConfiguration.model_validate(yaml.safe_load(spec["yaml"]))
    recorder.calls = {}
    recorder.seed = spec["random_seed"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        options = MergeOptions(
            copy_tokenizer=False,
            write_model_card=False,
            random_seed=spec["random_seed"],
            quiet=True,
            **spec["options"],
        )
        run_merge(config, str(out), options=options)
        tensors = {}
        for f in sorted(out.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        out_config = json.loads((out / "config.json").read_text())
    path = HERE / "outputs" / f"{name}.safetensors"
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(path), {"format": "pt"})
    return {
        "method": config.merge_method,
        "random_seed": spec["random_seed"],
        "mergekit_options": spec["options"],
        # (mergekit takes the output config.json from the base, else from an arbitrary referenced model, so
        # vocab_size is only meaningful with a base model)
        "output_layers": out_config.get("num_hidden_layers"),
        "output_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
        "output_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "torch": torch.__version__,
    }, recorder.calls


def main() -> None:
    _ensure_mergekit_python()
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    os.chdir(HERE)  # configs name models by paths relative to tests/reference/
    models = build_inputs()
    write_inputs(models)
    for sub in ("configs", "outputs"):
        shutil.rmtree(HERE / sub, ignore_errors=True)
        (HERE / sub).mkdir()

    recorder = Recorder()
    recorder.install()
    manifest = {
        "mergekit": MERGEKIT_VERSION,
        "torch": torch.__version__,
        "seed_derivation": "sha256(f'{random_seed}:{tensor_name}') first 8 bytes little-endian & 0x7FFFFFFFFFFFFFFF",
        "inputs": {
            name: hashlib.sha256((HERE / "inputs" / name / "model.safetensors").read_bytes()).hexdigest()
            for name in models
        },
        "cases": {},
    }
    calls: dict[str, dict] = {}
    for name, spec in CASES.items():
        print(f"mergekit {MERGEKIT_VERSION}: {name}", flush=True)
        manifest["cases"][name], calls[name] = run_case(name, spec, recorder)
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    # gzip without a timestamp, so regenerating identical calls gives identical bytes
    payload = json.dumps(calls, sort_keys=True, separators=(",", ":")).encode()
    (HERE / "calls.json.gz").write_bytes(gzip.compress(payload, compresslevel=9, mtime=0))


if __name__ == "__main__":
    main()
