"""Config validation: every mistake is one line naming the key; parameter precedence and gradients."""

from __future__ import annotations

import pytest

from mergesmith.config import ConditionalParameter, load_config, parse_config
from mergesmith.engine.planning.parameters import evaluate_setting, interpolate_gradient, is_missing, resolve
from mergesmith.errors import ConfigError


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_valid_models_config_parses():
    cfg = parse_config(
        {
            "merge_method": "linear",
            "models": [{"model": "a", "parameters": {"weight": 0.5}}, {"model": "b", "parameters": {"weight": [0, 1]}}],
            "dtype": "float32",
        }
    )
    assert cfg.referenced_models() == ["a", "b"]
    assert cfg.base_or_first_model() == "a"


def test_unknown_method_suggests_the_closest():
    msg = _err({"merge_method": "lineer", "models": [{"model": "a"}]})
    assert "`merge_method`" in msg and "did you mean `linear`" in msg


def test_unknown_top_level_key_has_did_you_mean():
    # mergekit ignores the unknown key, then misses `models`: so do we, and the error names the near miss
    msg = _err({"merge_method": "linear", "modles": [{"model": "a"}]})
    assert "one of `models`, `slices` or `modules` is required" in msg
    assert "`modles` was ignored: did you mean" in msg


def test_unknown_nested_key_names_its_path():
    cfg = parse_config({"merge_method": "linear", "models": [{"model": "a", "paramters": {"weight": 1}}]})
    assert len(cfg.warnings) == 1
    assert "`models[0].paramters`" in cfg.warnings[0] and "did you mean `parameters`" in cfg.warnings[0]
    with pytest.raises(ConfigError, match=r"models\[0\]\.paramters.*--strict"):
        parse_config({"merge_method": "linear", "models": [{"model": "a", "paramters": {"weight": 1}}]}, strict=True)


def test_unknown_key_inside_a_condition():
    data = {
        "merge_method": "linear",
        "models": [{"model": "a", "parameters": {"weight": [{"filtr": "mlp", "value": 1}]}}],
    }
    cfg = parse_config(data)
    assert "filtr" in cfg.warnings[0] and "did you mean `filter`" in cfg.warnings[0]
    assert cfg.models is not None and cfg.models[0].parameters == {"weight": [ConditionalParameter(value=1)]}


def test_models_and_slices_together_is_refused():
    msg = _err(
        {
            "merge_method": "linear",
            "models": [{"model": "a"}],
            "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}]}],
        }
    )
    assert "`models` or `slices`, not both" in msg


def test_neither_models_nor_slices_is_refused():
    assert "one of `models`, `slices` or `modules` is required" in _err({"merge_method": "linear"})


def test_slice_sources_of_different_lengths():
    msg = _err(
        {
            "merge_method": "linear",
            "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 3]}]}],
        }
    )
    assert "slices[0]" in msg and "different numbers of layers" in msg


def test_layer_range_must_be_ordered():
    msg = _err({"merge_method": "passthrough", "slices": [{"sources": [{"model": "a", "layer_range": [3, 1]}]}]})
    assert "slices[0].sources[0].layer_range" in msg


def test_passthrough_takes_one_source_per_slice():
    msg = _err(
        {
            "merge_method": "passthrough",
            "slices": [{"sources": [{"model": "a", "layer_range": [0, 2]}, {"model": "b", "layer_range": [0, 2]}]}],
        }
    )
    assert "slices[0].sources" in msg and "at most 1 model" in msg


def test_method_requiring_base_without_one():
    from mergesmith.methods import method_names

    needs_base = [n for n in method_names() if n in ("task_arithmetic", "ties", "slerp")]
    if not needs_base:
        pytest.skip("no method that requires a base model is registered")
    msg = _err({"merge_method": needs_base[0], "models": [{"model": "a"}, {"model": "b"}]})
    assert "`base_model`" in msg and "requires a base model" in msg


def test_top_level_not_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config(["merge_method", "linear"])


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("merge_method: linear\nmodels:\n  - model: a\n   parameters: {weight: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "malformed YAML at line" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yml")


# ----- parameter resolution --------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "t", "expected"),
    [
        ([0.0, 1.0], 0.0, 0.0),
        ([0.0, 1.0], 1.0, 1.0),
        ([0.0, 1.0], 0.25, 0.25),
        ([0.0, 1.0, 0.0], 0.5, 1.0),
        ([0.0, 1.0, 0.0], 0.75, 0.5),
        ([0.2, 0.4, 0.6, 0.8], 1 / 3, 0.4),
        ([0.2, 0.4, 0.6, 0.8], 0.5, 0.5),
        ([0.7], 0.3, 0.7),
    ],
)
def test_gradient_interpolation(values, t, expected):
    assert interpolate_gradient(values, t) == pytest.approx(expected)


def test_gradient_over_a_slice_of_n_layers():
    # layer i of n gets t = i / (n - 1)
    n = 5
    got = [interpolate_gradient([0.0, 1.0], i / (n - 1)) for i in range(n)]
    assert got == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_filters_first_match_wins_and_default_last():
    setting = [
        ConditionalParameter(filter="self_attn", value=0.1),
        ConditionalParameter(filter="mlp", value=[0.0, 1.0]),
        ConditionalParameter(value=0.9),
    ]
    assert evaluate_setting(setting, "model.layers.3.self_attn.q_proj.weight", 0.5) == 0.1
    assert evaluate_setting(setting, "model.layers.3.mlp.up_proj.weight", 0.5) == pytest.approx(0.5)
    assert evaluate_setting(setting, "model.norm.weight", 0.0) == 0.9


def test_precedence_source_over_slice_over_model_over_top():
    top = {"weight": 0.1, "density": 0.5}
    model = {"weight": 0.2}
    sl = {"weight": 0.3}
    src = {"weight": 0.4}
    name = "model.layers.0.mlp.up_proj.weight"
    assert resolve("weight", [src, sl, model, top], name, 0.0) == 0.4
    assert resolve("weight", [None, sl, model, top], name, 0.0) == 0.3
    assert resolve("weight", [None, None, model, top], name, 0.0) == 0.2
    assert resolve("weight", [None, None, None, top], name, 0.0) == 0.1
    assert resolve("density", [src, sl, model, top], name, 0.0) == 0.5
    assert is_missing(resolve("gamma", [src, sl, model, top], name, 0.0))


def test_unmatched_condition_falls_through_to_the_next_level():
    src = {"weight": [ConditionalParameter(filter="self_attn", value=0.9)]}
    top = {"weight": 0.1}
    assert resolve("weight", [src, top], "model.layers.0.self_attn.q_proj.weight", 0.0) == 0.9
    assert resolve("weight", [src, top], "model.layers.0.mlp.up_proj.weight", 0.0) == 0.1


def test_star_filter_matches_everything_and_switch_lists_step():
    cfg = parse_config(
        {
            "merge_method": "linear",
            "models": [{"model": "a", "parameters": {"weight": [{"filter": "*", "value": 3}]}}],
            "parameters": {"normalize": [True, False]},
        }
    )
    params = cfg.models[0].parameters
    assert resolve("weight", [params], "model.norm.weight", 0.0) == 3
    assert resolve("normalize", [cfg.parameters], "x", 0.4) is True
    assert resolve("normalize", [cfg.parameters], "x", 1.0) is False


def test_model_count_problems_are_config_errors():
    msg = _err({"merge_method": "nuslerp", "models": [{"model": "a"}, {"model": "b"}, {"model": "c"}]})
    assert "`models`" in msg and "nuslerp" in msg
