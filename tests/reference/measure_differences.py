"""Measure where mergesmith's outputs equal mergekit 0.1.5's on tensors larger than the fixtures.

    python tests/reference/measure_differences.py [--quick] [--json tests/reference/differences.json]

The reference fixtures (`make_mergekit_reference.py`) are tiny (every tensor under 4,096 entries), so they
cannot show what happens above the sizes where reductions go blocked or threaded. This script builds three
llama-shaped checkpoints whose matrices have 1024 x 1024 = 1,048,576 entries (float32, plus bf16 copies),
runs the reference cases' configs (tests/reference/configs, same parameters) with mergekit's own
`mergekit-yaml` (from the venv `scripts/mergekit_venv.sh` makes) and with mergesmith (this interpreter,
`src/` first on the path), and compares the outputs tensor by tensor:

- `f32`: float32 inputs and output. Where the bytes differ, both are compared with mergekit run again in
  float64 (`dtype: float64`): the column `err` is the largest |x - x64| / max|x64| per implementation.
- `f32->bf16`: float32 inputs, `dtype: bfloat16`.
- `bf16`: bfloat16 inputs, no `dtype`.
- output dtypes (arcee_fusion writes float32 in mergekit whatever `dtype` says).

Randomised methods (DARE, DELLA) are left out: mergekit draws from torch's global generator in execution
order, which no other program reproduces (the fixtures pin them through a seeded hook instead).
Everything is written under a temporary directory; nothing here is needed by the test suite, which pins
each difference found here with a small test of its own (tests/test_mergekit_differences.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SIDE = 1024  # every matrix is SIDE x SIDE = 1,048,576 entries

CASES = [
    "linear",
    "slerp",
    "nuslerp_flatten",
    "nuslerp_row_wise",
    "multislerp_base",
    "karcher",
    "model_stock",
    "task_arithmetic",
    "ties",
    "breadcrumbs",
    "breadcrumbs_ties",
    "sce",
    "nearswap",
    "arcee_fusion",
    "ram",
]
QUICK = ["linear", "slerp", "karcher", "model_stock", "ties", "arcee_fusion"]


def mergekit_python() -> str:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "mergekit_venv.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    return out.stdout.strip().splitlines()[-1]


def build_inputs(root: Path) -> None:
    """base, ft_a, ft_b, ft_c (float32) and *_bf16 copies; fine-tunes = base + shared + own task vectors."""
    names = [
        f"model.layers.0.{n}.weight"
        for n in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ] + ["model.embed_tokens.weight", "lm_head.weight"]
    norms = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": SIDE,
        "intermediate_size": SIDE,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": SIDE,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }

    def make(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {n: torch.randn(SIDE, SIDE, generator=g) * 0.02 for n in names}
        out.update({n: 1 + 0.1 * torch.randn(SIDE, generator=g) for n in norms})
        return out

    base, shared = make(1), make(7)
    models = {"base": base}
    for name, seed in (("ft_a", 101), ("ft_b", 202), ("ft_c", 303)):
        own = make(seed)
        models[name] = {n: base[n] + 0.3 * shared[n] + 0.3 * own[n] for n in base}
    for name, tensors in models.items():
        for suffix, dtype in (("", torch.float32), ("_bf16", torch.bfloat16)):
            d = root / "inputs" / f"{name}{suffix}"
            d.mkdir(parents=True, exist_ok=True)
            save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, d / "model.safetensors")
            cfg = dict(config, torch_dtype="float32" if dtype == torch.float32 else "bfloat16")
            (d / "config.json").write_text(json.dumps(cfg))


def variant(case: str, kind: str) -> str:
    """The reference config of `case`, made to read the large inputs, in the given variant."""
    text = (HERE / "configs" / f"{case}.yml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("dtype:")]
    text = "\n".join(lines) + "\n"
    if kind == "bf16":
        text = text.replace("inputs/base", "inputs/base_bf16").replace("inputs/ft_a", "inputs/ft_a_bf16")
        text = text.replace("inputs/ft_b", "inputs/ft_b_bf16").replace("inputs/ft_c", "inputs/ft_c_bf16")
        return text
    dtype = {"f32": "float32", "f32->bf16": "bfloat16", "f64": "float64"}[kind]
    return text + f"dtype: {dtype}\n"


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")
    return time.monotonic() - started


def merge_both(root: Path, mk_python: str, case: str, kind: str) -> tuple[dict, dict]:
    config = root / f"{case}.{kind}.yml"
    config.write_text(variant(case, kind))
    mk_out, ms_out = root / "out" / f"mk-{case}-{kind}", root / "out" / f"ms-{case}-{kind}"
    mk_yaml = str(Path(mk_python).parent / "mergekit-yaml")
    run([mk_yaml, str(config), str(mk_out), "--no-copy-tokenizer", "--no-write-model-card", "--quiet"], root)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    run([sys.executable, "-m", "mergesmith.cli", "merge", str(config), str(ms_out), "-q", "--overwrite"], root, env)
    return _load(mk_out), _load(ms_out)


def _load(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare(mk: dict, ms: dict, ref: dict | None) -> dict:
    differing = [n for n in mk if not _same_bits(mk[n], ms[n])]
    result = {
        "tensors": len(mk),
        "bit_equal": len(differing) == 0,
        "differing": len(differing),
        "dtypes": sorted({f"mergekit {mk[n].dtype} / mergesmith {ms[n].dtype}" for n in mk}),
    }
    diffs = []
    for n in differing:
        a, b = mk[n].double(), ms[n].double()
        scale = max(a.abs().max().item(), 1e-30)
        diffs.append((a - b).abs().max().item() / scale)
    result["max_rel_diff"] = max(diffs) if diffs else 0.0
    if ref is not None and differing:
        err_mk = max(
            (mk[n].double() - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), 1e-30) for n in differing
        )
        err_ms = max(
            (ms[n].double() - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), 1e-30) for n in differing
        )
        result["err_vs_f64"] = {"mergekit": err_mk, "mergesmith": err_ms}
    return result


def measure_moe(root: Path, mk_python: str) -> dict:
    """`gate_mode: hidden` on a tiny float32 llama (tests/model_factory.py, the size does not matter here):
    mergekit-moe's router rows against mergesmith's and against the base model's own float32 residual
    states (what mergesmith computes) and bf16 ones (what mergekit-moe computes)."""
    sys.path.insert(0, str(REPO))
    from tests.model_factory import ModelCache

    cache = ModelCache(root / "tiny")
    base, other = cache("llama", seed=1), cache("llama", seed=2)
    prompts = [["tok10 tok11 tok12", "tok14"], ["tok60 tok61", "tok62 tok63 tok64"]]
    experts = [{"source_model": str(m), "positive_prompts": p} for m, p in zip((base, other), prompts)]
    import yaml

    config = root / "moe.yml"
    config.write_text(yaml.safe_dump({"base_model": str(base), "gate_mode": "hidden", "experts": experts}))
    mk_out, ms_out = root / "out" / "mk-moe", root / "out" / "ms-moe"
    run([str(Path(mk_python).parent / "mergekit-moe"), str(config), str(mk_out), "--quiet"], root)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MERGESMITH_CACHE_DIR=str(root / "cache"))
    run([sys.executable, "-m", "mergesmith.cli", "moe", str(config), str(ms_out), "-q", "--overwrite"], root, env)
    mk, ms = _load(mk_out), _load(ms_out)

    def by_layer(tensors: dict) -> dict:  # the two name routers differently (mlp.gate, block_sparse_moe.gate)
        return {n.split(".")[2]: t for n, t in tensors.items() if n.endswith(".gate.weight") and ".layers." in n}

    mk, ms = by_layer(mk), by_layer(ms)
    diff = max((mk[n].float() - ms[n].float()).abs().max().item() for n in mk)
    return {
        "gate_tensors": len(mk),
        "bit_equal": all(_same_bits(mk[n], ms[n]) for n in mk),
        "max_abs_diff_of_unit_rows": diff,
        "dtypes": sorted({f"mergekit {mk[n].dtype} / mergesmith {ms[n].dtype}" for n in mk}),
    }


def measure_reductions(trials: int = 20) -> dict:
    """mergesmith's blocked float32 sum, norm and dot product against torch's (what mergekit calls) on
    1M-entry tensors: the largest relative error of each against float64, and how often ours is worse."""
    sys.path.insert(0, str(REPO / "src"))
    from mergesmith.kernels import reductions as r

    g = torch.Generator().manual_seed(0)
    out = {k: {"ours_max_rel_err": 0.0, "torch_max_rel_err": 0.0, "ours_worse": 0} for k in ("sum", "norm", "dot")}
    for k in range(trials):
        n = (1 << 20) + 12345 * k
        a = torch.randn(n, generator=g) * 0.02 + 0.001
        b = torch.randn(n, generator=g) * 0.02 + 0.001
        for name, ours, theirs, exact in (
            ("sum", r.total(a), a.sum(), a.double().sum()),
            ("norm", r.l2(a), torch.linalg.vector_norm(a), a.double().norm()),
            ("dot", r.dot(a, b), torch.dot(a, b), torch.dot(a.double(), b.double())),
        ):
            eo = abs(ours.double().item() - exact.item()) / abs(exact.item())
            et = abs(theirs.double().item() - exact.item()) / abs(exact.item())
            row = out[name]
            row["ours_max_rel_err"] = max(row["ours_max_rel_err"], eo)
            row["torch_max_rel_err"] = max(row["torch_max_rel_err"], et)
            row["ours_worse"] += int(eo > et)
    return {"trials": trials, "threads": torch.get_num_threads(), **out}


def table(logs: list[Path]) -> tuple[str, dict]:
    """A markdown table (and the results as one dict) from the lines this script printed."""
    results: dict[str, dict] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            name, _, rest = line.partition(" ")
            kind, _, payload = rest.partition(" ")
            if payload.startswith("{"):
                results.setdefault(name, {})[kind] = json.loads(payload)
    rows = [
        "| case | float32 | err vs f64 (mergekit / mergesmith) | `dtype: bfloat16` of float32 "
        "| bf16 inputs, no `dtype` |"
    ]
    rows.append("| --- | --- | --- | --- | --- |")

    def cell(r: dict | None) -> str:
        if r is None:
            return "not measured"
        if r["bit_equal"]:
            return "bit-equal"
        text = f"{r['differing']}/{r['tensors']} differ, {r['max_rel_diff']:.1e}"
        mk_dtype = {d.split(" / ")[0] for d in r["dtypes"]}
        return text + (
            f" ({', '.join(sorted(r['dtypes']))})"
            if any("float32" in d for d in mk_dtype) and any("bfloat16" in d.split(" / ")[1] for d in r["dtypes"])
            else ""
        )

    for name, row in results.items():
        if name == "moe":
            continue
        err = row.get("f32", {}).get("err_vs_f64")
        err_text = f"{err['mergekit']:.1e} / {err['mergesmith']:.1e}" if err else ""
        rows.append(
            f"| {name} | {cell(row.get('f32'))} | {err_text} | {cell(row.get('f32->bf16'))} | {cell(row.get('bf16'))} |"
        )
    return "\n".join(rows), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--moe", action="store_true", help="only the MoE `hidden` gate comparison")
    parser.add_argument("--keep", type=Path, help="work here instead of a temporary directory")
    parser.add_argument("--reductions", action="store_true", help="only the blocked-reduction accuracy check")
    parser.add_argument("--table", type=Path, nargs="+", help="print the markdown table from earlier runs' output")
    args = parser.parse_args()
    if args.table:
        text, results = table(args.table)
        print(text)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        return
    if args.reductions:
        print("reductions", json.dumps(measure_reductions()))
        return
    mk_python = mergekit_python()
    cases = args.cases.split(",") if args.cases else QUICK if args.quick else CASES
    results: dict[str, dict] = {
        "setup": {
            "entries_per_matrix": SIDE * SIDE,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": os.uname().machine,
        }
    }
    with tempfile.TemporaryDirectory(prefix="mergesmith-measure-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.moe:
            results["moe_hidden"] = measure_moe(root, mk_python)
            print("moe hidden", json.dumps(results["moe_hidden"]), flush=True)
            cases = []
        else:
            build_inputs(root)
        for case in cases:
            row: dict[str, dict] = {}
            mk64 = None
            for kind in ("f32", "f32->bf16", "bf16"):
                mk, ms = merge_both(root, mk_python, case, kind)
                ref = None
                if kind == "f32" and any(not _same_bits(mk[n], ms[n]) for n in mk):
                    config = root / f"{case}.f64.yml"
                    config.write_text(variant(case, "f64"))
                    out = root / "out" / f"mk-{case}-f64"
                    mk_yaml = str(Path(mk_python).parent / "mergekit-yaml")
                    run(
                        [mk_yaml, str(config), str(out), "--no-copy-tokenizer", "--no-write-model-card", "--quiet"],
                        root,
                    )
                    mk64 = {n: t.double() for n, t in _load(out).items()}
                    ref = mk64
                row[kind] = compare(mk, ms, ref)
                print(case, kind, json.dumps(row[kind]), flush=True)
            results[case] = row
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
