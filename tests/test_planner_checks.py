"""Plan-time checks: mixed architectures and --allow-crimes, shape mismatches, merge-parameter names,
dtype names, and the config.json rewrite of sliced outputs. Each is one line on stderr, exit 2, before
any tensor is read (and, where the check needs no checkpoint, before any checkpoint is opened)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import assert_one_line_error, run_cli, write_config


def linear(tmp_path: Path, *models: Path, **top: Any) -> Path:
    models_ = [{"model": str(m), "parameters": {"weight": 1.0}} for m in models]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": models_, "dtype": "float32", **top})


# ----- architectures and --allow-crimes -------------------------------------------------------------


def test_different_architectures_need_allow_crimes(tmp_path, tiny_models, capsys):
    llama, mistral = tiny_models("llama", seed=1), tiny_models("mistral", seed=2)
    cfg = linear(tmp_path, llama, mistral)
    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q")
    line = assert_one_line_error(code, err, str(llama), str(mistral), "LlamaForCausalLM", "MistralForCausalLM")
    assert "--allow-crimes" in line
    assert not (tmp_path / "out").exists()

    code, _out, err = run_cli(capsys, "merge", cfg, tmp_path / "out", "-q", "--allow-crimes")
    assert code == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


def test_same_architecture_needs_no_allow_crimes(tmp_path, tiny_models, capsys):
    cfg = linear(tmp_path, tiny_models("llama", seed=1), tiny_models("llama", seed=2))
    code, _out, err = run_cli(capsys, "plan", cfg)
    assert code == 0, err


@pytest.mark.parametrize("crimes", [False, True])
def test_shape_mismatch_is_a_plan_time_error_even_with_allow_crimes(tmp_path, tiny_models, capsys, crimes):
    llama, wider = tiny_models("llama", seed=1), tiny_models("llama", seed=3, intermediate_size=96)
    out = tmp_path / "out"
    args = ["merge", linear(tmp_path, llama, wider), out, "-q"] + (["--allow-crimes"] if crimes else [])
    code, _out, err = run_cli(capsys, *args)
    line = assert_one_line_error(code, err, "mlp.", "shapes differ", str(llama), str(wider))
    assert "internal error" not in line
    assert not out.exists()  # refused before the output directory (or its state directory) was made


# ----- merge-parameter names --------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("config", "key", "hint"),
    [
        (
            {"merge_method": "linear", "models": [{"model": "a"}, {"model": "b"}], "parameters": {"normalise": False}},
            "parameters.normalise",
            "did you mean `normalize`",
        ),
        (
            {
                "merge_method": "ties",
                "base_model": "base",
                "models": [{"model": "a", "parameters": {"weight": 1, "densty": 0.5}}],
            },
            "models[0].parameters.densty",
            "did you mean `density`",
        ),
        (
            {
                "merge_method": "slerp",
                "base_model": "a",
                "slices": [
                    {
                        "sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 2]}],
                        "parameters": {"tt": 0.5},
                    }
                ],
            },
            "slices[0].parameters.tt",
            "did you mean `t`",
        ),
        (
            {
                "merge_method": "passthrough",
                "slices": [{"sources": [{"model": "a", "layer_range": [0, 2], "parameters": {"scael": 0.5}}]}],
            },
            "slices[0].sources[0].parameters.scael",
            "did you mean `scale`",
        ),
        (
            {"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": 1, "normalize": True}}]},
            "models[0].parameters.normalize",
            "of the whole merge",
        ),
        (
            {"merge_method": "karcher", "models": [{"model": "a", "parameters": {"weight": 1}}, {"model": "b"}]},
            "models[0].parameters.weight",
            "does not use 'weight'",
        ),
    ],
)
def test_unknown_parameter_names_fail_before_any_checkpoint_is_opened(tmp_path, capsys, config, key, hint):
    # the models do not exist: the error must be about the parameter, found before anything is opened. A near
    # miss is an error anyway; the last two (leftovers mergekit ignores) are warnings that --strict refuses.
    cfg = write_config(tmp_path / "c.yml", config)
    code, _out, err = run_cli(capsys, "plan", cfg, "--strict")
    assert_one_line_error(code, err, str(cfg), f"`{key}`", f"{config['merge_method']!r}", hint)


def test_declared_parameters_at_every_level_are_accepted():
    from mergesmith.config import parse_config

    parse_config(
        {
            "merge_method": "task_arithmetic",
            "base_model": "base",
            "slices": [
                {
                    "sources": [
                        {"model": "base", "layer_range": [0, 2]},
                        {"model": "a", "layer_range": [0, 2], "parameters": {"weight": 0.5, "density": 0.9}},
                    ],
                    "parameters": {"lambda": 0.9, "weight": [{"filter": "mlp", "value": 0.3}, {"value": 1}]},
                }
            ],
            "parameters": {"normalize": True, "rescale": False, "int8_mask": False, "weight": 1.0},
        }
    )


def test_shipped_and_reference_configs_still_validate():
    from mergesmith.config import parse_config

    paths = sorted((REPO / "tests" / "reference" / "configs").glob("*.yml"))
    paths += [REPO / "examples" / name for name in ("linear.yml", "frankenmerge.yml")]
    assert len(paths) > 20
    for path in paths:
        parse_config(yaml.safe_load(path.read_text()), str(path))
    for doc in yaml.safe_load_all((REPO / "examples" / "multi-stage.yml").read_text()):
        doc.pop("name")
        parse_config(doc, "multi-stage.yml")


# ----- config.json of sliced outputs --------------------------------------------------------------


def test_rewrite_config_reindexes_only_per_layer_lists():
    from mergesmith.engine.planning.architecture import rewrite_config

    config = {
        "num_hidden_layers": 2,
        "eos_token_id": [2, 3],
        "architectures": ["LlamaForCausalLM", "X"],
        "mlp_only_layers": [0, 1],  # layer indices, not one entry per layer: output layers from listed sources
        "layer_types": ["sliding_attention", "full_attention"],
        "no_rope_layers": [1, 0],
        "text_config": {"bos_token_id": [1, 4]},
    }
    out = rewrite_config(config, [0, 1, 1], "F32")
    assert out["num_hidden_layers"] == 3
    assert out["eos_token_id"] == [2, 3] and out["text_config"]["bos_token_id"] == [1, 4]
    assert out["architectures"] == ["LlamaForCausalLM", "X"] and out["mlp_only_layers"] == [0, 1, 2]
    assert out["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    assert out["no_rope_layers"] == [1, 0, 0]


def test_sliced_output_keeps_a_list_of_eos_token_ids(tmp_path, tiny_models):
    from mergesmith.engine.run import run_merge
    from tests.helpers import load_causal_lm

    model = tiny_models("qwen2", seed=1, layers=2, eos_token_id=[2, 3])
    source = json.loads((model / "config.json").read_text())
    assert source["eos_token_id"] == [2, 3] and len(source["layer_types"]) == 2
    cfg = write_config(
        tmp_path / "c.yml",
        {
            "merge_method": "passthrough",
            "slices": [
                {"sources": [{"model": str(model), "layer_range": [0, 2]}]},
                {"sources": [{"model": str(model), "layer_range": [1, 2]}]},
            ],
        },
    )
    run_merge(cfg, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["num_hidden_layers"] == 3
    assert out["eos_token_id"] == [2, 3]
    assert out["layer_types"] == [source["layer_types"][i] for i in (0, 1, 1)]
    load_causal_lm(tmp_path / "out")


# ----- dtype names ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["dtype", "out_dtype"])
def test_an_unknown_dtype_fails_before_any_checkpoint_is_opened(tmp_path, capsys, monkeypatch, key):
    from mergesmith.io.checkpoint import Checkpoint

    def never(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a checkpoint was opened before the config was validated")

    monkeypatch.setattr(Checkpoint, "open", never)
    cfg = write_config(
        tmp_path / "c.yml", {"merge_method": "linear", "models": [{"model": "a"}, {"model": "b"}], key: "banana"}
    )
    code, _out, err = run_cli(capsys, "plan", cfg)
    line = assert_one_line_error(code, err, str(cfg), f"`{key}`", "unknown dtype 'banana'", "bfloat16")
    assert "internal error" not in line


def test_known_dtype_spellings_are_accepted():
    from mergesmith.config import parse_config

    for name in ("bfloat16", "bf16", "float16", "fp16", "float32", "torch.float32", "float64"):
        parse_config({"merge_method": "linear", "models": [{"model": "a"}], "dtype": name, "out_dtype": name})
