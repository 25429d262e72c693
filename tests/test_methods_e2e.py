"""Every merge method, end to end on tiny real checkpoints: the output loads in transformers and gives
finite logits (the numbers themselves are pinned against mergekit in test_mergekit_reference.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from mergesmith.methods import method_names
from tests.helpers import finite_logits, load_causal_lm, read_state_dict

CALIBRATION = Path(__file__).parent / "fixtures" / "regmean" / "calibration.txt"
TASK_VECTOR = {"weight": 0.6, "density": 0.5}
CASES: dict[str, dict] = {
    "linear": {"models": [("a", {"weight": 1.0}), ("b", {"weight": 0.5})]},
    "slerp": {"base": True, "models": [("base", {}), ("a", {})], "parameters": {"t": [0.0, 0.5, 1.0]}},
    "nuslerp": {"models": [("a", {"weight": 0.4}), ("b", {"weight": 0.6})]},
    "multislerp": {"base": True, "models": [("a", {"weight": 0.5}), ("b", {"weight": 0.5})]},
    "karcher": {"models": [("a", {}), ("b", {}), ("c", {})]},
    "task_arithmetic": {"base": True, "models": [("a", {"weight": 0.7}), ("b", {"weight": 0.3})]},
    "ties": {"base": True, "models": [("a", TASK_VECTOR), ("b", TASK_VECTOR)]},
    "dare_linear": {"base": True, "models": [("a", TASK_VECTOR), ("b", TASK_VECTOR)]},
    "dare_ties": {"base": True, "models": [("a", TASK_VECTOR), ("b", TASK_VECTOR)]},
    "della": {"base": True, "models": [("a", {**TASK_VECTOR, "epsilon": 0.1}), ("b", TASK_VECTOR)]},
    "della_linear": {"base": True, "models": [("a", {**TASK_VECTOR, "epsilon": 0.1}), ("b", TASK_VECTOR)]},
    "breadcrumbs": {"base": True, "models": [("a", {**TASK_VECTOR, "gamma": 0.05}), ("b", TASK_VECTOR)]},
    "breadcrumbs_ties": {"base": True, "models": [("a", TASK_VECTOR), ("b", TASK_VECTOR)]},
    "sce": {"base": True, "models": [("a", {}), ("b", {})], "parameters": {"select_topk": 0.5}},
    "model_stock": {"base": True, "models": [("a", {}), ("b", {}), ("c", {})]},
    "nearswap": {"base": True, "models": [("base", {}), ("a", {})], "parameters": {"t": 0.001}},
    "arcee_fusion": {"base": True, "models": [("base", {}), ("a", {})]},
    "ram": {"base": True, "models": [("a", {}), ("b", {})]},
    "ramplus_tl": {"base": True, "models": [("a", {}), ("b", {})]},
    "lines": {"base": True, "models": [("a", {"weight": 1.0}), ("b", {})], "parameters": {"alpha": 0.3, "beta": 0.6}},
    "tsv": {"base": True, "models": [("a", {}), ("b", {"weight": 0.8}), ("c", {})], "parameters": {"alpha": 1.2}},
    "iso_c": {"base": True, "models": [("a", {}), ("b", {}), ("c", {})], "parameters": {"scaling_factor": 1.5}},
    "iso_cts": {
        "base": True,
        "models": [("a", {}), ("b", {}), ("c", {})],
        "parameters": {"scaling_factor": 1.5, "common_space_fraction": 0.8},
    },
    # regmean runs the models on a calibration text (tests/test_regmean.py has its math and collection); the tiny
    # qwen2's tokenizer loads as Qwen2Tokenizer, which makes no token of the fixture's words, hence a llama
    "regmean": {
        "arch": "llama",
        "models": [("a", {}), ("b", {})],
        "parameters": {"calibration": str(CALIBRATION), "num_regmean_examples": 8, "max_length": 16},
    },
    "consensus_ta": {"base": True, "models": [("a", {"weight": 1.0, "k": 2, "lambda": 0.5}), ("b", {"weight": 1.0})]},
    "consensus_ties": {"base": True, "models": [("a", {**TASK_VECTOR, "lambda": 0.4}), ("b", TASK_VECTOR)]},
    "magmax": {"base": True, "models": [("a", {}), ("b", {}), ("c", {})]},
    "pcb": {"base": True, "models": [("a", {}), ("b", {}), ("c", {})], "parameters": {"pcb_ratio": 0.2}},
    "wudi": {"base": True, "models": [("a", {}), ("b", {}), ("c", {})], "parameters": {"iter_num": 20, "lr": 1e-4}},
}


def test_every_registered_method_has_an_end_to_end_case():
    missing = set(method_names()) - set(CASES) - {"passthrough"}
    assert not missing, f"add an end-to-end case for: {sorted(missing)}"


@pytest.mark.parametrize("method", sorted(CASES))
def test_method_output_loads_in_transformers(tmp_path, tiny_models, method):
    base = tiny_models(CASES[method].get("arch", "qwen2"), seed=11)
    models = {
        "base": base,
        **{k: tiny_models.derive(base, seed=s, scale=0.02) for k, s in (("a", 1), ("b", 2), ("c", 3))},
    }
    case = CASES[method]
    config = {
        "merge_method": method,
        "models": [{"model": str(models[name]), "parameters": params} for name, params in case["models"]],
        "out_dtype": "bfloat16",
    }
    if case.get("base"):
        config["base_model"] = str(base)
    if case.get("parameters"):
        config["parameters"] = case["parameters"]
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(config))
    run_merge(path, tmp_path / "out", MergeOptions(threads=2, random_seed=5))
    merged = read_state_dict(tmp_path / "out")
    if "arch" not in case:
        assert "lm_head.weight" not in merged  # qwen2 ties its embeddings; so does the output
    finite_logits(load_causal_lm(tmp_path / "out"))
