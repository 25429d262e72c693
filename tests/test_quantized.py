"""Quantized checkpoints (io/quantized.py, engine/planning/quantization.py): FP8 block-scaled (DeepSeek V3 shaped)
and MXFP4 (gpt-oss shaped) inputs are read dequantized, checked against transformers' own dequantization on the
same bytes; merges of them write bfloat16 by default or the same format again with --out-quantization, and
load in transformers; every other quantization is refused at plan time in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergesmith.cli import main
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from mergesmith.errors import CheckpointError
from mergesmith.io.checkpoint import Checkpoint
from mergesmith.io.quantized import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from tests.helpers import DEFAULT_TOKEN_IDS

BLOCK = (16, 16)  # the tiny model's weights are 16..96 wide: several blocks per tensor, partial ones at the edges
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}


def _is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's FP8 release stores in FP8: the linear layers' weights (not embeddings, norms, router)."""
    return tensor.dim() == 2 and name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def fp8_copy(src: Path, dst: Path) -> Path:
    """`src` (a tiny model) saved as an FP8 block-scaled checkpoint, quantized as DeepSeek's release is laid out."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _is_fp8_weight(name, tensor):
            out[name], out[f"{name}_scale_inv"] = quantize_fp8(tensor, BLOCK)
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def fp8_models(tiny_models, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(float base, its FP8 copy, an FP8 fine-tune) of a tiny DeepSeek V3 (MLA attention, routed experts)."""
    base = tiny_models("deepseek_v3", seed=3, layers=2, dtype=torch.bfloat16, hidden_size=64, intermediate_size=96)
    tuned = tiny_models.derive(base, seed=4, scale=0.05)
    root = tmp_path_factory.mktemp("fp8")
    return base, fp8_copy(base, root / "a"), fp8_copy(tuned, root / "b")


def gpt_oss_model(path: Path, seed: int) -> Path:
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def mxfp4_copy(src: Path, dst: Path) -> Path:
    """`src` with its experts stored as gpt-oss publishes them: `*_blocks` + `*_scales`, quant_method mxfp4."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantize_mxfp4(tensor)
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def mxfp4_models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    return (
        mxfp4_copy(gpt_oss_model(root / "float_a", 5), root / "a"),
        mxfp4_copy(gpt_oss_model(root / "float_b", 6), root / "b"),
    )


def merge(tmp_path: Path, models: list[Path], weights: list[float], **options: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "merge.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [{"model": str(m), "parameters": {"weight": w}} for m, w in zip(models, weights)],
                **({"out_dtype": options.pop("out_dtype")} if "out_dtype" in options else {}),
            }
        )
    )
    out = tmp_path / "out"
    run_merge(cfg, out, MergeOptions(**options))
    return out


def linear_yaml(*models: Path) -> str:
    return yaml.safe_dump(
        {"merge_method": "linear", "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in models]}
    )


def load_model(path: Path) -> Any:
    """The model as transformers loads it (on a CPU it dequantizes FP8 and MXFP4 itself), with no key problem
    and finite logits."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    assert not problems and not info.get("error_msgs"), f"loading {path}: {problems}"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([list(DEFAULT_TOKEN_IDS)])).logits).all()
    return model


# ----- FP8 ---------------------------------------------------------------------------------------------
def test_fp8_reading_is_transformers_dequantization_exactly(fp8_models):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    _base, fp8, _tuned = fp8_models
    stored = load_file(fp8 / "model.safetensors")
    ckpt = Checkpoint.open(str(fp8))
    assert len(ckpt.quantized) == sum(1 for n in stored if n.endswith("_scale_inv")) > 10
    assert not any(n.endswith("_scale_inv") for n in ckpt.tensors)  # scales are not model tensors
    for name in ckpt.quantized:
        q, scale = stored[name], stored[f"{name}_scale_inv"]
        mine = ckpt.get(name)
        assert ckpt.info(name).dtype == "F32" and mine.dtype == torch.float32 and mine.shape == q.shape
        assert torch.equal(mine, _dequantize_fp8_weight(q, scale, list(BLOCK), torch.float32)), name
        if q.shape[0] % BLOCK[0] == 0 and q.shape[1] % BLOCK[1] == 0:  # it derives the block from the scale grid
            assert torch.equal(mine, Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)), name
        for rows in [(0, 16), (3, 19), (16, q.shape[0]), (q.shape[0] - 1, q.shape[0])]:  # aligned or not
            assert torch.equal(ckpt.get(name, rows), mine[rows[0] : rows[1]]), (name, rows)
        assert ckpt.byte_range(name) is None  # never streamed as raw bytes: always through dequantization


def test_fp8_merge_writes_bfloat16_without_quantization_config_and_loads(fp8_models, tmp_path):
    _base, a, b = fp8_models
    out = merge(tmp_path, [a, b], [0.5, 0.5])
    written = load_file(out / "model.safetensors")
    assert not any(n.endswith("_scale_inv") for n in written)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ca, cb = Checkpoint.open(str(a)), Checkpoint.open(str(b))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert written[name].dtype == torch.bfloat16
    assert torch.equal(written[name], (0.5 * ca.get(name) + 0.5 * cb.get(name)).to(torch.bfloat16))
    load_model(out)


def test_fp8_merge_in_row_blocks_dequantizes_only_the_blocks(fp8_models, tmp_path, monkeypatch):
    """Merged in row blocks (tiny blocks forced), the output is the same bytes as merged whole."""
    from mergesmith.engine.execution import blocks

    _base, a, b = fp8_models
    whole = load_file(merge(tmp_path / "whole", [a, b], [0.3, 0.7]) / "model.safetensors")
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 100)
    asked: list[tuple[str, tuple[int, int] | None]] = []
    get = Checkpoint.get

    def spy(self: Checkpoint, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name in self.quantized:
            asked.append((name, rows))
        return get(self, name, rows)

    monkeypatch.setattr(Checkpoint, "get", spy)
    cut = load_file(merge(tmp_path / "cut", [a, b], [0.3, 0.7]) / "model.safetensors")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    assert asked and all(rows is not None for _name, rows in asked)  # never the whole tensor once per block
    assert len({rows for _name, rows in asked}) > 3


def fp8_round_trip_errors(reference: torch.Tensor, stored: torch.Tensor) -> tuple[float, float]:
    """(max error relative to its block's largest magnitude, mean |error| / mean |value|)."""
    err = (stored - reference).abs()
    amax = reference.abs().unflatten(-1, (-1, 1)).amax(-1)  # per element: its block's amax below
    rows, cols = reference.shape
    grid = torch.zeros(rows, cols)
    for i in range(0, rows, BLOCK[0]):
        for j in range(0, cols, BLOCK[1]):
            grid[i : i + BLOCK[0], j : j + BLOCK[1]] = amax[i : i + BLOCK[0], j : j + BLOCK[1]].max()
    return float((err / grid).max()), float(err.mean() / reference.abs().mean())


def test_fp8_output_same_block_fresh_scales_round_trip_and_loads(fp8_models, tmp_path, capsys):
    import transformers

    _base, a, b = fp8_models
    exact = load_file(merge(tmp_path / "f32", [a, b], [0.5, 0.5], out_dtype="float32") / "model.safetensors")
    out = merge(tmp_path / "fp8", [a, b], [0.5, 0.5], out_quantization="same")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == FP8_CONFIG  # the inputs' config, block size included
    written = load_file(out / "model.safetensors")
    assert (out / "model.safetensors").stat().st_size < 1.1 * (a / "model.safetensors").stat().st_size
    worst, means = 0.0, []
    for name in Checkpoint.open(str(a)).quantized:
        q, scale = written[name], written[f"{name}_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-q.shape[0] // 16), -(-q.shape[1] // 16))
        back = dequantize_fp8(q, scale, BLOCK)
        max_rel, mean_rel = fp8_round_trip_errors(exact[name], back)
        worst = max(worst, max_rel)
        means.append(mean_rel)
        assert max_rel <= 2**-4 + 1e-6, name  # e4m3 keeps 3 mantissa bits: half a step is at most 1/16 of amax
    with capsys.disabled():
        print(
            f"\nFP8 round trip vs float32: max error / block amax {worst:.4f}, "
            f"mean relative {sum(means) / len(means):.4f}"
        )
    # transformers dequantizes it itself on a CPU (no FP8 kernels there). Its load-time dequantization derives
    # the block from the scale grid, so it scales tensors with a partial edge block (kv_a_proj_with_mqa: 20 rows in
    # blocks of 16 here, 576 in blocks of 128 in DeepSeek V3) wrongly: compare a tensor of whole blocks.
    model = load_model(out)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    ours = dequantize_fp8(written[name], written[f"{name}_scale_inv"], BLOCK).to(torch.bfloat16)
    assert torch.equal(model.get_parameter(name).data, ours)
    assert isinstance(model, transformers.DeepseekV3ForCausalLM)


def test_fp8_passthrough_slices_keep_fp8_layers(fp8_models, tmp_path):
    """A depth-changing frankenmerge of an FP8 model writes its layers FP8 again under their new names."""
    _base, a, _b = fp8_models
    cfg = tmp_path / "slices.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "passthrough",
                "slices": [
                    {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
                    {"sources": [{"model": str(a), "layer_range": [1, 2]}]},
                ],
            }
        )
    )
    run_merge(cfg, tmp_path / "out", MergeOptions(out_quantization="fp8"))
    written = load_file(tmp_path / "out" / "model.safetensors")
    src = load_file(a / "model.safetensors")
    name = "model.layers.{}.self_attn.o_proj.weight"
    assert torch.equal(written[name.format(2)].view(torch.uint8), src[name.format(1)].view(torch.uint8))
    assert torch.equal(written[name.format(2) + "_scale_inv"], src[name.format(1) + "_scale_inv"])


# ----- MXFP4 -------------------------------------------------------------------------------------------
def test_mxfp4_reading_is_transformers_dequantization_exactly(mxfp4_models):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    a, _b = mxfp4_models
    stored = load_file(a / "model.safetensors")
    ckpt = Checkpoint.open(str(a))
    assert sorted(ckpt.quantized) == sorted(n[: -len("_blocks")] for n in stored if n.endswith("_blocks"))
    assert not any(n.endswith(("_blocks", "_scales")) for n in ckpt.tensors)
    for name in ckpt.quantized:
        blocks, scales = stored[f"{name}_blocks"], stored[f"{name}_scales"]
        mine = ckpt.get(name)
        assert torch.equal(mine, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)), name
        assert torch.equal(ckpt.get(name, (1, 3)), mine[1:3])  # by whole experts
    model = load_model(a)  # transformers reads the same checkpoint (dequantizing on a CPU): the same values
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(model.get_parameter(name).data.to(torch.bfloat16), ckpt.get(name))


def test_mxfp4_merge_bfloat16_by_default_and_mxfp4_with_the_option(mxfp4_models, tmp_path):
    a, b = mxfp4_models
    ca, cb = Checkpoint.open(str(a)), Checkpoint.open(str(b))
    name = "model.layers.1.mlp.experts.down_proj"
    plain = merge(tmp_path / "plain", [a, b], [0.5, 0.5])
    written = load_file(plain / "model.safetensors")
    assert name in written and f"{name}_blocks" not in written
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    expected = 0.5 * ca.get(name).float() + 0.5 * cb.get(name).float()
    assert torch.equal(written[name], expected.to(torch.bfloat16))
    load_model(plain)

    again = merge(tmp_path / "mxfp4", [a, b], [0.5, 0.5], out_quantization="mxfp4")
    written = load_file(again / "model.safetensors")
    assert json.loads((again / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    blocks, scales = quantize_mxfp4(expected)
    assert torch.equal(written[f"{name}_blocks"], blocks) and torch.equal(written[f"{name}_scales"], scales)
    back = dequantize_mxfp4(written[f"{name}_blocks"], written[f"{name}_scales"]).float()
    # per group of 32 (along the input dimension) the error is at most half an e2m1 step: 1 of a largest value > 3
    err = (back - expected).abs().transpose(-1, -2).unflatten(-1, (-1, 32))
    amax = expected.abs().transpose(-1, -2).unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert float((err / amax.clamp_min(1e-30)).max()) <= 1 / 3 + 1e-6
    model = load_model(again)
    assert torch.equal(model.get_parameter(name).data.to(torch.bfloat16), back.to(torch.bfloat16))


def test_out_quantization_of_a_format_the_inputs_lack_is_refused(fp8_models, tmp_path, capsys):
    _base, a, b = fp8_models
    cfg = tmp_path / "c.yml"
    cfg.write_text(linear_yaml(a, b))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(cfg), "--out-quantization", "mxfp4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out-quantization mxfp4")


# ----- other quantizations: refused ----------------------------------------------------------------------
def _quantized_like(src: Path, dst: Path, method: str | None, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    save_file({**state, **tensors}, dst / "model.safetensors", metadata={"format": "pt"})
    if method is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method, "bits": 4}
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "method, tensors",
    [
        ("bitsandbytes", {"model.layers.0.mlp.up_proj.weight.absmax": torch.ones(4)}),
        ("gptq", {"model.layers.0.mlp.up_proj.qweight": torch.zeros(8, 64, dtype=torch.int32)}),
        ("awq", {"model.layers.0.mlp.up_proj.qzeros": torch.zeros(1, 8, dtype=torch.int32)}),
        ("compressed-tensors", {"model.layers.0.mlp.up_proj.weight_packed": torch.zeros(64, 8, dtype=torch.int32)}),
        ("hqq", {"model.layers.0.mlp.up_proj.W_q": torch.zeros(64, 16, dtype=torch.uint8)}),
        ("fbgemm_fp8", {}),
        (None, {"model.layers.0.mlp.up_proj.qweight": torch.zeros(8, 64, dtype=torch.int32)}),
        (None, {"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32, dtype=torch.int8)}),
    ],
)
def test_other_quantizations_are_refused_at_plan_time_in_one_line(tiny_models, tmp_path, capsys, method, tensors):
    model = _quantized_like(tiny_models("llama", seed=1), tmp_path / "q", method, tensors)
    cfg = tmp_path / "c.yml"
    other = tiny_models("llama", seed=2)
    cfg.write_text(linear_yaml(other, model))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(cfg)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model "), err
    assert str(model) in err[0] and "dequantize it first" in err[0]
    assert (method or ("qweight" if "qweight" in str(tensors) else "integer weights")) in err[0]
    with pytest.raises(CheckpointError):  # refused from the headers: no tensor read
        Checkpoint.open(str(model))


# ----- plan -------------------------------------------------------------------------------------------
def test_plan_shows_each_input_architecture_layers_moe_and_quantization(
    fp8_models, mxfp4_models, tiny_models, tmp_path, capsys
):
    _base, a, b = fp8_models
    cfg = tmp_path / "c.yml"
    cfg.write_text(linear_yaml(a, b))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(cfg), "--json"])
    assert exit_.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert not any("stored" in t for t in report["tensors"])  # written in the output dtype
    stored = sum((m / "model.safetensors").stat().st_size for m in (a, b))
    assert report["bytes_read"] <= stored  # what is read is the FP8 bytes, not the dequantized float32
    assert report["inputs"][0] == {
        "model": str(a),
        "architecture": "DeepseekV3ForCausalLM",
        "layers": 2,
        "moe": True,
        "experts": 4,
        "quantization": f"fp8 (blocks 16x16, {len(Checkpoint.open(str(a)).quantized)} tensors)",
    }
    with pytest.raises(SystemExit):
        main(["plan", str(cfg), "--json", "--out-quantization", "same"])
    report = json.loads(capsys.readouterr().out)
    name = "model.layers.0.self_attn.o_proj.weight"
    entry = next(t for t in report["tensors"] if t["name"] == name)
    assert entry["stored"] == [[name, "F8_E4M3", [64, 32]], [f"{name}_scale_inv", "F32", [4, 2]]]
    mx, _ = mxfp4_models
    dense = tiny_models("llama", seed=1)
    for model, line in [
        (
            mx,
            f"input {mx}: GptOssForCausalLM, 2 layers, MoE (4 experts), quantization: mxfp4 (blocks of 32, 4 tensors)",
        ),
        (dense, f"input {dense}: LlamaForCausalLM, 4 layers, dense, quantization: none"),
    ]:
        cfg.write_text(linear_yaml(model))
        with pytest.raises(SystemExit):
            main(["plan", str(cfg)])
        assert line in capsys.readouterr().out.splitlines()


def test_a_plan_writing_no_quantized_tensor_never_keeps_a_quantization_config():
    """The safety net under every planner (an MoE assembly or a tokenizer transplant copies the base's config)."""
    from mergesmith.engine.planning.quantization import written_config

    config = {"a": 1, "quantization_config": FP8_CONFIG, "text_config": {"quantization_config": FP8_CONFIG}}
    assert written_config(config, quantized=False) == {"a": 1, "text_config": {}}
    assert config["text_config"] == {"quantization_config": FP8_CONFIG}  # the plan's own config is left alone
    assert written_config(config, quantized=True) is config


def test_mxfp4_conversions_in_chunks_are_the_same_as_whole(mxfp4_models, monkeypatch):
    """(De)quantization runs a few rows at a time to bound its temporaries: the bytes do not depend on it."""
    from mergesmith.io import quantized

    a, _b = mxfp4_models
    stored = load_file(a / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    whole = dequantize_mxfp4(stored[f"{name}_blocks"], stored[f"{name}_scales"])
    packed = quantize_mxfp4(whole.float() * 1.3)
    monkeypatch.setattr(quantized, "CHUNK_VALUES", 100)
    assert torch.equal(dequantize_mxfp4(stored[f"{name}_blocks"], stored[f"{name}_scales"]), whole)
    chunked = quantize_mxfp4(whole.float() * 1.3)
    assert torch.equal(chunked[0], packed[0]) and torch.equal(chunked[1], packed[1])
