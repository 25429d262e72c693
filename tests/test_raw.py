"""Raw merges: bare torch.nn state dicts (.safetensors, .pt), no config.json, loaded back into the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergesmith.cli import main
from mergesmith.engine.planning.shared import MergeOptions
from mergesmith.engine.run import run_merge
from mergesmith.errors import CheckpointError, ConfigError
from mergesmith.io.journal import Journal
from mergesmith.raw.merge import run_raw_merge
from tests.helpers import read_state_dict


class TinyNet(torch.nn.Module):
    """Linear layers, a norm with running buffers (and an int64 counter), and a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(6, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 3)
        self.scale = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.encoder(x)))) * self.scale


def _net(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    net = TinyNet()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        net.norm.running_mean.normal_()
        net.norm.running_var.uniform_(0.5, 2.0)
        net.norm.num_batches_tracked.fill_(seed)
    return net


def _save(net: torch.nn.Module, path: Path) -> Path:
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    if path.suffix == ".safetensors":
        save_file(state, path)
    else:
        torch.save(state, path)
    return path


def _config(tmp_path: Path, doc: dict, name: str = "raw.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_linear_merge_of_two_modules_loads_back_into_the_module(tmp_path):
    a, b = _net(1), _net(2)
    pa, pb = _save(a, tmp_path / "a.safetensors"), _save(b, tmp_path / "b.pt")
    cfg = _config(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [
                {"model": str(pa), "parameters": {"weight": 0.25}},
                {"model": str(pb), "parameters": {"weight": 0.75}},
            ],
        },
    )
    out = tmp_path / "out"
    result = run_raw_merge(cfg, out, MergeOptions())
    assert not result.already_complete
    assert sorted(p.name for p in out.iterdir()) == [".cache", "mergekit_config.yml", "model.safetensors"]
    assert Journal.load(out).complete

    merged = TinyNet()
    merged.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    sa, sb, sm = a.state_dict(), b.state_dict(), merged.state_dict()
    for name, tensor in sm.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, 0.25 * sa[name] + 0.75 * sb[name])
        else:  # integer buffers are copied from the first model, never averaged
            assert tensor.dtype == torch.int64 and tensor.item() == sa[name].item()
    merged.eval()
    assert torch.isfinite(merged(torch.randn(4, 6))).all()

    # Rerun: the journal's `complete` plus the single shard mark it done; nothing is rewritten.
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert run_raw_merge(cfg, out, MergeOptions()).already_complete
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def test_task_arithmetic_with_a_base_sharded_output_and_out_dtype(tmp_path):
    base, ft1, ft2 = _net(0), _net(1), _net(2)
    paths = [_save(n, tmp_path / f"{i}.pt") for i, n in enumerate((base, ft1, ft2))]
    cfg = _config(
        tmp_path,
        {
            "merge_method": "task_arithmetic",
            "base_model": str(paths[0]),
            "models": [
                {"model": str(paths[1]), "parameters": {"weight": 0.5}},
                {"model": str(paths[2]), "parameters": {"weight": [{"filter": "head", "value": 0.0}, {"value": 1.0}]}},
            ],
            "out_dtype": "bfloat16",
        },
    )
    out = tmp_path / "out"
    run_raw_merge(cfg, out, MergeOptions(out_shard_size=300))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (out / "config.json").exists()

    merged = read_state_dict(out)
    sb, s1, s2 = base.state_dict(), ft1.state_dict(), ft2.state_dict()
    for name, tensor in merged.items():
        if not tensor.is_floating_point():
            continue
        assert tensor.dtype == torch.bfloat16
        w2 = 0.0 if "head" in name else 1.0
        expected = sb[name] + 0.5 * (s1[name] - sb[name]) + w2 * (s2[name] - sb[name])
        torch.testing.assert_close(tensor.float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0.02)
    net = TinyNet()
    net.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in merged.items()})


def test_missing_tensors_need_union_or_intersection(tmp_path):
    a = _save(_net(1), tmp_path / "a.safetensors")
    extra = {k: v.contiguous() for k, v in _net(2).state_dict().items()}
    extra["adapter.weight"] = torch.full((2, 2), 3.0)
    b = tmp_path / "b.safetensors"
    save_file(extra, b)
    cfg = _config(
        tmp_path,
        {"merge_method": "linear", "models": [{"model": str(a)}, {"model": str(b)}], "parameters": {"weight": 1.0}},
    )

    with pytest.raises(
        CheckpointError, match=r"tensor 'adapter.weight' is missing from '.*a.safetensors'.*--tensor-union"
    ):
        run_raw_merge(cfg, tmp_path / "exact", MergeOptions())

    run_raw_merge(cfg, tmp_path / "union", MergeOptions(), tensor_set="union")
    union = load_file(tmp_path / "union" / "model.safetensors")
    assert torch.equal(union["adapter.weight"], torch.full((2, 2), 3.0))  # held by one model: copied

    run_raw_merge(cfg, tmp_path / "inter", MergeOptions(), tensor_set="intersection")
    inter = load_file(tmp_path / "inter" / "model.safetensors")
    assert "adapter.weight" not in inter and set(inter) == set(union) - {"adapter.weight"}
    torch.testing.assert_close(inter["head.weight"], union["head.weight"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"slices": [{"sources": [{"model": "{a}", "layer_range": [0, 1]}]}], "models": None},
            "`slices` is not supported",
        ),
        ({"parameters": {"weight": [0.0, 1.0]}}, "`parameters.weight`: a gradient interpolates over layers"),
        ({"tokenizer_source": "base"}, "`tokenizer_source` is not supported"),
    ],
)
def test_raw_configs_reject_what_needs_layers_or_a_tokenizer(tmp_path, extra, message):
    a = _save(_net(1), tmp_path / "a.safetensors")
    doc = {"merge_method": "linear", "models": [{"model": str(a)}, {"model": str(a)}], "parameters": {"weight": 1.0}}
    doc.update(yaml.safe_load(yaml.safe_dump(extra).replace("{a}", str(a))))
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        run_raw_merge(_config(tmp_path, doc), tmp_path / "out", MergeOptions())


def test_cli_merge_raw_and_the_ordinary_merge_still_wants_a_config_json(tmp_path, capsys):
    a, b = _save(_net(1), tmp_path / "a.pt"), _save(_net(2), tmp_path / "b.pt")
    cfg = _config(
        tmp_path,
        {
            "merge_method": "slerp",
            "base_model": str(a),
            "models": [{"model": str(a)}, {"model": str(b)}],
            "parameters": {"t": 0.5},
        },
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["merge-raw", str(cfg), str(tmp_path / "out"), "-q"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    TinyNet().load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))

    with pytest.raises(SystemExit) as exit_info:
        main(["merge-raw", str(cfg), str(tmp_path / "out2"), "-u", "-i", "-q"])
    assert exit_info.value.code == 2 and "not both" in capsys.readouterr().err

    with pytest.raises(CheckpointError, match="no config.json"):
        run_merge(cfg, tmp_path / "model_out", MergeOptions())


def test_cli_merge_raw_of_bin_files(tmp_path, capsys):
    """`.bin` file names (mergekit-pytorch's other spelling of a pickled state dict) load like `.pt`."""
    a, b = _save(_net(1), tmp_path / "a.bin"), _save(_net(2), tmp_path / "b.bin")
    cfg = _config(
        tmp_path,
        {
            "merge_method": "linear",
            "models": [
                {"model": str(a), "parameters": {"weight": 0.25}},
                {"model": str(b), "parameters": {"weight": 0.75}},
            ],
        },
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["merge-raw", str(cfg), str(tmp_path / "out"), "-q"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    merged, sa, sb = load_file(tmp_path / "out" / "model.safetensors"), torch.load(a), torch.load(b)
    assert merged.keys() == sa.keys()
    for name, value in merged.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.25 * sa[name] + 0.75 * sb[name])
    TinyNet().load_state_dict(merged)
