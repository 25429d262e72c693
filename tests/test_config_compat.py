"""Configs read as mergekit reads them: what is ignored changes nothing, `modules:` means what mergekit's
does, `revision:` picks a revision, numbers written as text are numbers, and --strict refuses warnings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from mergesmith.config import parse_config
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from mergesmith.errors import ConfigError
from tests.helpers import run_cli


def _merge(tmp_path: Path, name: str, config: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / name
    run_merge(path, out, MergeOptions(threads=1))
    return load_file(str(out / "model.safetensors"))


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name


@pytest.fixture(scope="module")
def pair(tiny_models: Any) -> tuple[str, str]:
    return str(tiny_models("llama", seed=1)), str(tiny_models("llama", seed=2))


def test_numbers_written_as_text_are_numbers() -> None:
    cfg = parse_config(
        {
            "merge_method": "karcher",
            "models": [{"model": "a"}, {"model": "b"}],
            "parameters": {"tol": "1e-5", "max_iter": "1E3"},
        }
    )
    assert cfg.parameters == {"tol": 1e-5, "max_iter": 1000.0}
    cfg = parse_config(
        {
            "merge_method": "linear",
            "models": [{"model": "a", "parameters": {"weight": [{"filter": "mlp", "value": [".5e-2", "1e0"]}]}}],
        }
    )
    assert cfg.models is not None and cfg.models[0].parameters["weight"][0].value == [0.005, 1.0]  # type: ignore[index]


def test_revision_key_is_the_model_at_revision() -> None:
    cfg = parse_config(
        {
            "merge_method": "passthrough",
            "slices": [{"sources": [{"model": "org/m", "revision": "v2", "layer_range": [0, 2]}]}],
        }
    )
    assert cfg.slices is not None and cfg.slices[0].sources[0].model == "org/m@v2"
    assert cfg.warnings == []


def test_leftovers_change_nothing_in_the_output(tmp_path: Path, pair: tuple[str, str]) -> None:
    a, b = pair
    clean = {"merge_method": "slerp", "base_model": a, "models": [{"model": a}, {"model": b}], "parameters": {"t": 0.3}}
    messy = {
        "name": "my-merge",
        "merge_method": "slerp",
        "base_model": a,
        "models": [{"model": a, "parameters": {"weight": 0.5}}, {"model": b, "parameters": {"weight": 0.5, "t": 0.9}}],
        "parameters": {"t": 0.3, "density": 0.5},
        "tokenzer_source": "union",
    }
    assert len(parse_config(messy).warnings) == 6
    _same(_merge(tmp_path, "clean", clean), _merge(tmp_path, "messy", messy))


def test_modules_default_is_the_plain_form_and_its_parameters_sit_between_slice_and_top(
    tmp_path: Path, pair: tuple[str, str]
) -> None:
    a, b = pair
    sources = [{"model": a, "layer_range": [0, 4]}, {"model": b, "layer_range": [0, 4]}]
    plain = {"merge_method": "slerp", "base_model": a, "slices": [{"sources": sources}], "parameters": {"t": 0.8}}
    module = {
        "merge_method": "slerp",
        "base_model": a,
        "modules": {"default": {"slices": [{"sources": sources}], "parameters": {"t": 0.8}}},
        "parameters": {"t": 0.1},  # the module's value wins over the top level's
    }
    _same(_merge(tmp_path, "plain", plain), _merge(tmp_path, "module", module))


def test_llava_modules_each_merged_by_its_own_definition(tmp_path: Path, load_causal_lm: Any) -> None:
    import json

    from tests.test_compat_corpus import _tiny_llava

    a, b = str(_tiny_llava(tmp_path / "a", 1)), str(_tiny_llava(tmp_path / "b", 2))
    config = {
        "merge_method": "linear",
        "modules": {
            "text_decoder": {
                "slices": [
                    {"sources": [{"model": a, "layer_range": [0, 2], "parameters": {"weight": 1.0}}]},
                    {"sources": [{"model": b, "layer_range": [1, 2], "parameters": {"weight": 1.0}}]},
                ]
            },
            # mergekit's name for this module when it infers llava's (the stack's prefix)
            "model.vision_tower.encoder.layers": {
                "slices": [{"sources": [{"model": b, "layer_range": [0, 2], "parameters": {"weight": 1.0}}]}]
            },
            "multi_modal_projector": {
                "models": [{"model": a, "parameters": {"weight": 0.5}}, {"model": b, "parameters": {"weight": 0.5}}]
            },
        },
    }
    out = _merge(tmp_path, "vlm", config)
    ta, tb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert out["language_model.model.layers.2.mlp.up_proj.weight"].equal(
        tb["language_model.model.layers.1.mlp.up_proj.weight"]
    )
    assert out["language_model.model.layers.0.mlp.up_proj.weight"].equal(
        ta["language_model.model.layers.0.mlp.up_proj.weight"]
    )
    assert "vision_tower.encoder.layers.2.mlp.fc1.weight" not in out  # the tower was cut to 2 layers
    assert out["vision_tower.encoder.layers.1.mlp.fc1.weight"].equal(tb["vision_tower.encoder.layers.1.mlp.fc1.weight"])
    assert out["vision_tower.embeddings.patch_embedding.weight"].equal(
        tb["vision_tower.embeddings.patch_embedding.weight"]
    )
    mean = (ta["multi_modal_projector.linear_1.weight"] + tb["multi_modal_projector.linear_1.weight"]) / 2
    assert out["multi_modal_projector.linear_1.weight"].allclose(mean)
    written = json.loads((tmp_path / "vlm" / "config.json").read_text())
    assert written["text_config"]["num_hidden_layers"] == 3 and written["vision_config"]["num_hidden_layers"] == 2

    import transformers

    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(tmp_path / "vlm"), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_strict_refuses_what_is_otherwise_a_warning_and_plan_lists_warnings(
    tmp_path: Path, capsys: Any, pair: tuple[str, str]
) -> None:
    a, b = pair
    path = tmp_path / "c.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": a, "parameters": {"weight": 1, "density": 0.5}},
                    {"model": b, "parameters": {"weight": 1}},
                ],
            }
        )
    )
    code, out, err = run_cli(capsys, "plan", path)
    assert code == 0 and "warning:" in out + err and "does not use 'density'" in out + err
    for command in ("plan", "merge"):
        args = [command, path] + ([tmp_path / "out"] if command == "merge" else []) + ["--strict"]
        code, _out, err = run_cli(capsys, *args)
        assert code == 2 and err.count("error:") == 1 and "(an error under --strict)" in err
    assert not (tmp_path / "out").exists()


def test_near_miss_of_a_used_parameter_stays_an_error() -> None:
    with pytest.raises(ConfigError, match=r"did you mean `density`"):
        parse_config(
            {"merge_method": "ties", "base_model": "a", "models": [{"model": "b", "parameters": {"densty": 1}}]}
        )


def test_model_at_revision_resolves_that_snapshot_of_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pair: tuple[str, str]
) -> None:
    import huggingface_hub.constants

    from mergesmith.errors import CheckpointError
    from mergesmith.io.checkpoint import resolve_model_path
    from tests.test_compat_corpus import _cache_model

    a, b = pair
    _cache_model(tmp_path / "hub", "org/model", Path(a), {"v2": Path(b)})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    main, v2 = resolve_model_path("org/model"), resolve_model_path("org/model@v2")
    assert main != v2
    assert (main / "model.safetensors").read_bytes() == (Path(a) / "model.safetensors").read_bytes()
    assert (v2 / "model.safetensors").read_bytes() == (Path(b) / "model.safetensors").read_bytes()
    assert resolve_model_path(f"{a}@v2") == Path(a)  # a local directory has no revisions
    with pytest.raises(CheckpointError, match="at revision 'v3'"):
        resolve_model_path("org/model@v3")
