"""Regenerate the FusionBench reference fixtures that tests/test_fusionbench_reference.py compares mergesmith with.

    python tests/reference/fusionbench/make_fusionbench_reference.py

Any python will do: unless it already runs inside a venv holding fusion-bench 0.2.33, the script runs
`scripts/fusionbench_venv.sh` (idempotent; creates ~/.cache/mergesmith/fusionbench-venv on first use, CPU torch)
and re-executes itself with that venv's python. It imports only torch, safetensors and fusion_bench, never
mergesmith. Runs in a few seconds on a CPU.

What it writes, next to itself (committed, ~400 KB in all):

- `inputs.safetensors`: a base and three "fine-tunes" of it, keys `<model>/<tensor name>` with model in
  base, ft0, ft1, ft2, built from one seeded torch generator, float32. Tensor names are llama-style: an
  embedding `model.embed_tokens.weight` (100x48), a tall `...q_proj.weight` (64x48), a wide
  `...down_proj.weight` (48x64), 1-D `...q_proj.bias` (64) and `...input_layernorm.weight` (48). Each task
  vector is a rank-4 component shared by all fine-tunes + a rank-4 one of its own + small dense noise (scale
  ~1e-2, like a fine-tune's), so the SVD methods have structured spectra and the sign elections real conflicts.
  Also RegMean's Gram matrices `gram/<model>/<linear module name>` (X^T X / N of a seeded random input,
  for q_proj: 48x48).
- `outputs/<case>.safetensors`: what FusionBench returned for the case, one entry per tensor of the case's
  `names` (a case holds only the tensors that exercise its rules, to keep the files small).
- `manifest.json`: per case the mergesmith method it checks, the FusionBench callable, its hyperparameters,
  the tensor names, the models, `f64_gap` (the largest |float32 - float64| difference of FusionBench's own
  output when the same inputs are run in float64, beyond 2 float32 ulps of the output, over max |merged task
  vector|: the rounding floor the test's tolerance must sit above), and the sha256 of every file; also
  fusion-bench's and torch's versions.

How FusionBench is called (its public algorithm classes on a dict model pool of tiny nn.Modules, the
`_pretrained_` key being the base, unless said otherwise):

- TaskArithmeticAlgorithm, MagMaxAlgorithm, TaskSingularVectorMerging, ISO_C_Merge, ISO_CTS_Merge,
  WUDIMerging: once on all of the case's tensors; each of these works key by key, so the result is the
  per-tensor merge mergesmith computes.
- TiesMergingAlgorithm: once PER TENSOR (a one-parameter model pool each). FusionBench's TIES flattens the
  whole state dict into one vector and trims the top-k of that vector; run on one tensor it is the per-tensor
  TIES that mergekit and mergesmith compute.
- RegMean: `merging_with_regmean_weights` (the merge step of its RegMean algorithms, given the Gram
  matrices); its Gram collection needs a data loader and a Trainer, which this data-free fixture replaces
  by the stored Gram matrices.
- Consensus merging (TALL masks paper): FusionBench ships only the TALL mask generator
  (`fusion_bench.method.tall_mask.utils.generate_task_masks`), not a consensus merge. The case composes it
  with the paper's two remaining steps, written here: count per entry how many task masks hold it, keep the
  entries held by >= k tasks, and add lambda * (kept entries of the merged task vector) to the base; the
  merged task vector, which the TALL masks also compare with (theta_mt = base + merged), is the plain sum
  (consensus TA) or FusionBench's TIES merge of the tensor, threshold 20, "sum" (consensus TIES), as in the
  paper's code (github.com/nik-dim/tall_masks, src/eval/aggregation.py). Only the mask rule (and the TIES
  merge) is FusionBench's, which the manifest says (`fusionbench_part`).

FusionBench does not implement PCB (Du et al. 2024) or LiNeS (Wang et al. 2025): no fixtures for them; their
tests code the papers' equations in float64 instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
FB_VERSION = "0.2.33"


def _in_reference_venv() -> bool:
    try:
        from importlib.metadata import version

        return version("fusion-bench") == FB_VERSION
    except Exception:  # noqa: BLE001 - not installed: any failure means "not this venv"
        return False


if not _in_reference_venv():
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "fusionbench_venv.sh")], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    python = out.strip().splitlines()[-1]
    os.execv(python, [python, __file__, *sys.argv[1:]])

import logging  # noqa: E402
import warnings  # noqa: E402
from importlib.metadata import version  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

SEED = 32
MODELS = ["ft0", "ft1", "ft2"]
SHAPES = {
    "model.embed_tokens.weight": (100, 48),
    "model.layers.0.self_attn.q_proj.weight": (64, 48),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "model.layers.0.mlp.down_proj.weight": (48, 64),
    "model.layers.0.input_layernorm.weight": (48,),
}
EMBED, Q, QB, DOWN, NORM = SHAPES
ONE_D = [QB, NORM]
ELEMENTWISE = [Q, *ONE_D]  # enough for methods that treat every entry alike
MATRICES = [Q, DOWN, *ONE_D]  # tall and wide matrices, for the SVD methods
ALL = [EMBED, Q, DOWN, *ONE_D]
REGMEAN_MODULES = {Q: "model.layers.0.self_attn.q_proj"}  # linear weight -> module name of its Gram matrix


def make_inputs() -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """base + three fine-tunes (shared and own low-rank task-vector parts + noise), and RegMean Gram matrices."""
    g = torch.Generator().manual_seed(SEED)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    models: dict[str, dict[str, torch.Tensor]] = {"base": {}}
    for name, shape in SHAPES.items():
        models["base"][name] = (1.0 + 0.1 * randn(*shape)) if name == NORM else 0.05 * randn(*shape)
    shared = {n: _part(randn, s) for n, s in SHAPES.items()}
    for m in MODELS:
        models[m] = {}
        for name, shape in SHAPES.items():
            tv = 0.6 * shared[name] + _part(randn, shape) + 0.002 * randn(*shape)
            models[m][name] = models["base"][name] + tv
    grams: dict[str, dict[str, torch.Tensor]] = {}
    for m in MODELS:
        grams[m] = {}
        for weight, module in REGMEAN_MODULES.items():
            d_in = SHAPES[weight][1]
            mix = torch.eye(d_in) + 0.5 * randn(d_in, d_in) / d_in**0.5  # correlated features, per model
            x = randn(256, d_in) @ mix
            grams[m][module] = x.T @ x / x.shape[0]
    return models, grams


def _part(randn, shape: tuple[int, ...]) -> torch.Tensor:
    """A task-vector component: rank 4 (scale ~1e-2) for matrices, dense for vectors."""
    if len(shape) == 2:
        return 0.01 * randn(shape[0], 4) @ randn(4, shape[1]) / 2.0
    return 0.01 * randn(*shape)


def as_module(state: dict[str, torch.Tensor]) -> nn.Module:
    """A bare nn.Module whose state_dict() is `state` (FusionBench's algorithms take model pools of modules)."""
    root = nn.Module()
    for name, tensor in state.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(tensor.clone(), requires_grad=False))
    return root


def pool(models: dict[str, dict[str, torch.Tensor]], names: list[str], dtype: torch.dtype):
    from fusion_bench.modelpool import BaseModelPool

    pick = {k: {n: models[k][n].to(dtype) for n in names} for k in ["base", *MODELS]}
    return BaseModelPool({"_pretrained_": as_module(pick["base"]), **{m: as_module(pick[m]) for m in MODELS}})


def run_algorithm(make, models, names, dtype) -> dict[str, torch.Tensor]:
    out = make().run(pool(models, names, dtype))
    state = out.state_dict()
    return {n: state[n].detach().clone() for n in names}


def run_per_tensor(make, models, names, dtype) -> dict[str, torch.Tensor]:
    return {n: run_algorithm(make, models, [n], dtype)[n] for n in names}


def run_regmean(ratio: float):
    def run(models, names, dtype, grams) -> dict[str, torch.Tensor]:
        from fusion_bench.method.regmean.regmean import merging_with_regmean_weights

        params = {n: [models[m][n].to(dtype) for m in MODELS] for n in names}
        weights = [{k: v.to(dtype) for k, v in grams[m].items()} for m in MODELS]
        merged = merging_with_regmean_weights(params, weights, reduce_non_diagonal_ratio=ratio, weight_transpose=True)
        return {n: merged[n].detach().clone() for n in names}

    return run


def run_consensus(kind: str, tall_mask_lambda: float, k: int, scaling: float):
    """Consensus TA / TIES: FusionBench's TALL masks + the paper's count-and-keep and the final sum (see top)."""

    def run(models, names, dtype, grams) -> dict[str, torch.Tensor]:
        from fusion_bench.method.tall_mask.utils import generate_task_masks
        from fusion_bench.method.ties_merging.ties_merging_utils import ties_merging

        out = {}
        for n in names:
            flat_ptm = models["base"][n].to(dtype).reshape(-1)
            flat_ft = torch.stack([models[m][n].to(dtype).reshape(-1) for m in MODELS])
            tvs = flat_ft - flat_ptm
            merged = tvs.sum(0) if kind == "ta" else ties_merging(tvs, reset_thresh=20, merge_func="sum")
            masks = generate_task_masks(tvs, flat_ft, flat_ptm, tv=merged, tall_mask_lambda=tall_mask_lambda)
            keep = masks.float().sum(0) >= k
            out[n] = (flat_ptm + scaling * merged * keep).reshape(models["base"][n].shape)
        return out

    return run


def cases() -> list[dict]:
    from fusion_bench.method import (
        ISO_C_Merge,
        ISO_CTS_Merge,
        MagMaxAlgorithm,
        TaskArithmeticAlgorithm,
        TaskSingularVectorMerging,
        TiesMergingAlgorithm,
        WUDIMerging,
    )

    def algo(cls, per_tensor=False, **hp):
        runner = run_per_tensor if per_tensor else run_algorithm
        return lambda models, names, dtype, grams: runner(lambda: cls(**hp), models, names, dtype)

    def case(name, method, callable_, hp, names, fn, **extra):
        return {
            "case": name,
            "method": method,
            "fusionbench": callable_,
            "hyperparameters": hp,
            "names": names,
            "run": fn,
            **extra,
        }

    ties = "fusion_bench.method.TiesMergingAlgorithm (run per tensor)"
    ties_hp = {"scaling_factor": 0.3, "threshold": 20, "remove_keys": [], "merge_func": "sum"}
    ties_mean = ties_hp | {"scaling_factor": 1.0, "merge_func": "mean"}
    cts = {"scaling_factor": 1.0, "common_space_fraction": 0.8}
    return [
        case(
            "task_arithmetic",
            "task_arithmetic",
            "fusion_bench.method.TaskArithmeticAlgorithm",
            {"scaling_factor": 0.3},
            ELEMENTWISE,
            algo(TaskArithmeticAlgorithm, scaling_factor=0.3),
        ),
        case(
            "task_arithmetic_sf1",
            "task_arithmetic",
            "fusion_bench.method.TaskArithmeticAlgorithm",
            {"scaling_factor": 1.0},
            ELEMENTWISE,
            algo(TaskArithmeticAlgorithm, scaling_factor=1.0),
        ),
        case("ties", "ties", ties, ties_hp, ELEMENTWISE, algo(TiesMergingAlgorithm, True, **ties_hp)),
        case("ties_mean", "ties", ties, ties_mean, ELEMENTWISE, algo(TiesMergingAlgorithm, True, **ties_mean)),
        case(
            "magmax",
            "magmax",
            "fusion_bench.method.MagMaxAlgorithm",
            {"scaling_factor": 0.5},
            ELEMENTWISE,
            algo(MagMaxAlgorithm, scaling_factor=0.5),
        ),
        case(
            "tsv",
            "tsv",
            "fusion_bench.method.TaskSingularVectorMerging",
            {"alpha": 1.0, "exclude_keys": None},
            ALL,
            algo(TaskSingularVectorMerging, alpha=1.0),
        ),
        case(
            "iso_c",
            "iso_c",
            "fusion_bench.method.ISO_C_Merge",
            {"scaling_factor": 1.0, "exclude_keys": None},
            ALL,
            algo(ISO_C_Merge, scaling_factor=1.0),
        ),
        case(
            "iso_cts",
            "iso_cts",
            "fusion_bench.method.ISO_CTS_Merge",
            cts | {"exclude_keys": None},
            ALL,
            algo(ISO_CTS_Merge, **cts),
        ),
        case(
            "iso_cts_half",
            "iso_cts",
            "fusion_bench.method.ISO_CTS_Merge",
            {"scaling_factor": 1.5, "common_space_fraction": 0.5, "exclude_keys": None},
            MATRICES,
            algo(ISO_CTS_Merge, scaling_factor=1.5, common_space_fraction=0.5),
        ),
        case(
            "wudi",
            "wudi",
            "fusion_bench.method.WUDIMerging",
            {"iter_num": 400, "exclude_keys": None},
            MATRICES,
            algo(WUDIMerging, iter_num=400),
        ),
        case(
            "regmean",
            "regmean",
            "fusion_bench.method.regmean.regmean.merging_with_regmean_weights",
            {"reduce_non_diagonal_ratio": 0.95, "weight_transpose": True},
            [EMBED, Q, *ONE_D],
            run_regmean(0.95),
            gram_modules=REGMEAN_MODULES,
        ),
        case(
            "regmean_r01",
            "regmean",
            "fusion_bench.method.regmean.regmean.merging_with_regmean_weights",
            {"reduce_non_diagonal_ratio": 0.1, "weight_transpose": True},
            [Q],
            run_regmean(0.1),
            gram_modules=REGMEAN_MODULES,
        ),
        case(
            "consensus_ta",
            "consensus_ta",
            "paper composition (see make_fusionbench_reference.py)",
            {"tall_mask_lambda": 0.6, "k": 2, "scaling_factor": 0.3},
            ELEMENTWISE,
            run_consensus("ta", 0.6, 2, 0.3),
            fusionbench_part="fusion_bench.method.tall_mask.utils.generate_task_masks (the TALL masks)",
        ),
        case(
            "consensus_ties",
            "consensus_ties",
            "paper composition (see make_fusionbench_reference.py)",
            {"tall_mask_lambda": 0.6, "k": 2, "scaling_factor": 0.3, "threshold": 20, "merge_func": "sum"},
            ELEMENTWISE,
            run_consensus("ties", 0.6, 2, 0.3),
            fusionbench_part="generate_task_masks (the TALL masks) and ties_merging_utils.ties_merging (the "
            "merged TIES vector)",
        ),
    ]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    models, grams = make_inputs()
    out_dir = HERE / "outputs"
    out_dir.mkdir(exist_ok=True)
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    inputs = {f"{m}/{n}": t.contiguous() for m, state in models.items() for n, t in state.items()}
    inputs |= {f"gram/{m}/{mod}": t.contiguous() for m, g in grams.items() for mod, t in g.items()}
    save_file(inputs, HERE / "inputs.safetensors")
    manifest = {
        "fusion_bench": version("fusion-bench"),
        "torch": torch.__version__,
        "seed": SEED,
        "inputs": "inputs.safetensors",
        "inputs_sha256": sha256(HERE / "inputs.safetensors"),
        "base": "base",
        "models": MODELS,
        "cases": [],
    }
    models64 = {k: {n: t.double() for n, t in v.items()} for k, v in models.items()}
    grams64 = {k: {n: t.double() for n, t in v.items()} for k, v in grams.items()}
    for c in cases():
        run = c.pop("run")
        out32 = run(models, c["names"], torch.float32, grams)
        out64 = run(models64, c["names"], torch.float64, grams64)
        gap = 0.0
        for n in c["names"]:
            ref = models["base"][n] if c["method"] != "regmean" else 0.0
            scale = float((out64[n] - ref).abs().max())
            # beyond 2 float32 ulps of the output, as the test measures: what rounding adds to the task vector
            excess = (out32[n].double() - out64[n]).abs() - 2 * torch.finfo(torch.float32).eps * out64[n].abs()
            gap = max(gap, float(excess.max().clamp(min=0)) / max(scale, 1e-30))
            assert out32[n].dtype == torch.float32 and torch.isfinite(out32[n]).all(), (c["case"], n)
        path = out_dir / f"{c['case']}.safetensors"
        save_file({n: out32[n].contiguous() for n in c["names"]}, path)
        c |= {"output": f"outputs/{path.name}", "output_sha256": sha256(path), "f64_gap": float(f"{gap:.3g}")}
        manifest["cases"].append(c)
        print(f"{c['case']:22s} f64_gap {gap:.2e}", file=sys.stderr)
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file() and p.suffix != ".py")
    print(f"wrote {HERE} ({total / 1024:.0f} KB of fixtures)", file=sys.stderr)


if __name__ == "__main__":
    main()
