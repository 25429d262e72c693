"""The warm start reads ahead a fresh merge's local inputs while torch is imported; it must find every local
model a mergekit config names, stay out of reruns and out of files the merge reads around the page cache,
and never raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mergesmith.io import direct_write
from mergesmith.runtime import warm_start


def test_finds_every_local_model_the_config_names(tmp_path: Path) -> None:
    for name in ("a", "b", "c", "lora_base"):
        (tmp_path / name).mkdir()
    config = {
        "base_model": str(tmp_path / "a"),
        "models": [{"model": str(tmp_path / "b")}, {"model": "some-org/not-local"}],
        "slices": [{"sources": [{"model": "c", "layer_range": [0, 2]}, {"model": f"{tmp_path / 'lora_base'}+x"}]}],
    }
    found = list(dict.fromkeys(warm_start._local_model_dirs(config, tmp_path)))
    assert found == [(tmp_path / n).resolve() for n in ("a", "b", "c", "lora_base")]


def test_reads_ahead_only_for_a_fresh_output_and_never_raises(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({"models": [{"model": str(model)}]}))
    thread = warm_start.read_ahead_inputs(config, tmp_path / "fresh")
    assert thread is not None
    thread.join(10)
    out = tmp_path / "rerun"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    assert warm_start.read_ahead_inputs(config, out) is None
    assert warm_start.read_ahead_inputs(config, out / "model.safetensors") is None  # a file: merge's error
    broken = tmp_path / "broken.yml"
    broken.write_text("models: [\n")
    thread = warm_start.read_ahead_inputs(broken, tmp_path / "fresh2")
    assert thread is not None
    thread.join(10)  # the error stays inside the thread


def test_leaves_files_the_merge_reads_around_the_cache_to_the_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read-ahead into the page cache only for the files the merge reads through it: on a filesystem where the
    feed reads with O_DIRECT, cached pages would only be copied out again at a cost."""
    model = tmp_path / "m"
    model.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (model / name).write_bytes(b"\0" * 4096)
    monkeypatch.setattr(direct_write, "filesystem_type", lambda path: "ext4")
    monkeypatch.delenv(direct_write.ENV, raising=False)
    assert warm_start._paged_files(model) == []
    monkeypatch.setenv(direct_write.ENV, "0")
    assert [p.name for p in warm_start._paged_files(model)] == sorted(p.name for p in model.iterdir())
    monkeypatch.delenv(direct_write.ENV)
    monkeypatch.setattr(direct_write, "filesystem_type", lambda path: "nfs4")
    assert len(warm_start._paged_files(model)) == 2
