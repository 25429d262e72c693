"""The streaming safetensors writer: any tensor is just bytes, read back equal by the safetensors library."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from safetensors import safe_open

from mergesmith.io import safetensors_writer
from mergesmith.io.dtypes import from_torch
from mergesmith.io.safetensors_writer import ShardWriter, file_checksum, layout

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.bool,
]


def _write(path: Path, tensors: dict[str, torch.Tensor], order: list[str] | None = None) -> str:
    entries = [(n, from_torch(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    writer = ShardWriter(path, path.with_suffix(".partial"), entries)
    for name in order or list(tensors):
        writer.write(name, tensors[name])
    return writer.finish()


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _random_tensor(draw, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


@st.composite
def tensor_sets(draw):
    n = draw(st.integers(1, 8))
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        t = _random_tensor(draw, dtype, shape)
        view = draw(st.sampled_from(["plain", "transpose", "slice", "alias"]))
        if view == "transpose" and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif view == "slice" and t.dim() >= 1 and t.shape[0] > 1:
            t = t[::2]
        elif view == "alias" and out:
            t = next(iter(out.values()))  # the very same storage under a second name
        out[f"t{i}.{view}"] = t
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_sets(), reverse=st.booleans())
def test_any_tensors_round_trip(tmp_path_factory, tensors, reverse):
    path = tmp_path_factory.mktemp("w") / "x.safetensors"
    order = list(tensors)[::-1] if reverse else None
    checksum = _write(path, tensors, order)
    back = _read_all(path)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)
    assert file_checksum(path) == checksum


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_sets(), limit=st.integers(1, 2000))
def test_random_shard_limits_through_the_merge_writer(tmp_path_factory, tensors, limit):
    """Cut the same tensors into shards at a random byte limit, as the planner does; every byte survives."""
    from mergesmith.engine.plan import InputRef, TensorRecipe
    from mergesmith.engine.planning.shared import cut_shards

    recipes = [
        TensorRecipe(n, tuple(t.shape), from_torch(t.dtype), "copy", (InputRef("m", n),)) for n, t in tensors.items()
    ]
    shards = cut_shards(recipes, limit)
    assert sum(len(s.recipes) for s in shards) == len(recipes)
    for s in shards[:-1]:
        assert len(s.recipes) >= 1
    root = tmp_path_factory.mktemp("s")
    for shard in shards:
        _write(root / shard.filename, {r.name: tensors[r.name] for r in shard.recipes})
    back: dict[str, torch.Tensor] = {}
    for shard in shards:
        back.update(_read_all(root / shard.filename))
    for name, t in tensors.items():
        assert torch.equal(back[name], t)


def test_seed_failure_shared_memory_and_non_contiguous(tmp_path):
    """What torch/safetensors' save_file refuses (shared storage, non-contiguous) is just bytes here."""
    emb = torch.randn(16, 8)
    layer = torch.randn(8, 8)
    tensors = {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb,  # tied embeddings
        "model.layers.0.w": layer,
        "model.layers.1.w": layer,  # a layer used twice
        "model.layers.2.w": layer.t(),  # transpose: non-contiguous
        "experts.0": emb[:8],  # experts cut from one tensor
        "experts.1": emb[8:],
        "strided": emb[:, ::2],
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "one_strided": torch.randn(3)[::2][:1],  # shape (1,), stride (2,): "contiguous" to torch
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _write(tmp_path / "m.safetensors", tensors)
    back = _read_all(tmp_path / "m.safetensors")
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name


def test_header_is_aligned_and_has_metadata(tmp_path):
    prefix, slots = layout([("a", "F32", (3,)), ("b", "BF16", (2, 2))])
    n = struct.unpack("<Q", prefix[:8])[0]
    assert n % 8 == 0 and len(prefix) == 8 + n
    header = json.loads(prefix[8:])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["a"]["data_offsets"] == [0, 12] and header["b"]["data_offsets"] == [12, 20]
    assert slots[1].start == len(prefix) + 12


def test_wrong_shape_or_dtype_is_refused(tmp_path):
    writer = ShardWriter(tmp_path / "x.safetensors", tmp_path / "x.partial", [("a", "F32", (2,))])
    with pytest.raises(ValueError, match="planned F32"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="planned F32"):
        writer.write("a", torch.zeros(2, dtype=torch.float16))
    writer.abort()
    assert not (tmp_path / "x.partial").exists()


def test_unfinished_shard_never_gets_its_final_name(tmp_path):
    writer = ShardWriter(tmp_path / "x.safetensors", tmp_path / "x.partial", [("a", "F32", (2,)), ("b", "F32", (1,))])
    writer.write("a", torch.ones(2))
    with pytest.raises(ValueError, match="never written"):
        writer.finish()
    assert not (tmp_path / "x.safetensors").exists()


def test_resume_reopens_partial_file_and_keeps_verified_tensors(tmp_path):
    entries = [("a", "F32", (4,)), ("b", "F32", (4,)), ("c", "F32", (4,))]
    w = ShardWriter(tmp_path / "x.safetensors", tmp_path / "x.partial", entries)
    w.write("a", torch.arange(4.0))
    w.write("b", torch.ones(4))
    durable = w.sync()
    durable["b"] ^= 1  # pretend b was torn: its CRC no longer matches
    w2 = ShardWriter(tmp_path / "x.safetensors", tmp_path / "x.partial", entries, resume=durable)
    assert w2.done == {"a"}
    w2.write("b", torch.ones(4))
    w2.write("c", torch.full((4,), 2.0))
    w2.finish()
    back = _read_all(tmp_path / "x.safetensors")
    assert torch.equal(back["a"], torch.arange(4.0)) and torch.equal(back["c"], torch.full((4,), 2.0))


def test_the_checksum_is_zlibs_crc32() -> None:
    """The journal's checksums are zlib's CRC-32 whichever library computes them (zlib-ng where installed), so a
    journal written by either resumes with the other."""
    import zlib

    data = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).numpy()
    for piece in (data[:0], data[:1], data[:4099], data, data[7:]):
        assert safetensors_writer.crc32(memoryview(piece)) == zlib.crc32(memoryview(piece))
        assert safetensors_writer.crc32(memoryview(piece), 123456) == zlib.crc32(memoryview(piece), 123456)
