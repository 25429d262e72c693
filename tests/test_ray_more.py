"""Ray executor: one local Ray for a whole multi-stage run, and raw merges on Ray.

Kept small: every local Ray start costs seconds. No Ray is initialised when these tests begin (they
do not use test_ray.py's module fixture), since what is tested is whether mergesmith starts one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'mergesmith[ray]')")

from mergesmith.engine.planning.shared import MergeOptions  # noqa: E402
from mergesmith.multi.stages import run_multi  # noqa: E402
from mergesmith.raw.merge import run_raw_merge  # noqa: E402


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture
def counted_ray_init(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Calls of ray.init (made to start a small local Ray); no Ray may be running before or after."""
    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls: list[dict] = []
    real = ray.init

    def init(**kwargs):
        calls.append(kwargs)
        return real(**{**kwargs, "num_cpus": 2})

    monkeypatch.setattr(ray, "init", init)
    yield calls
    if ray.is_initialized():  # only reached when a test failed midway
        ray.shutdown()


def test_multi_on_ray_starts_one_local_ray_for_all_stages(tmp_path, tiny_models, counted_ray_init):
    a, b, c = (str(tiny_models("llama", seed=s)) for s in (1, 2, 3))
    docs = [
        {
            "name": "one",
            "merge_method": "linear",
            "models": [{"model": a}, {"model": b}],
            "parameters": {"weight": 1.0},
        },
        {
            "name": "two",
            "merge_method": "linear",
            "models": [{"model": "one"}, {"model": c}],
            "parameters": {"weight": 1.0},
        },
    ]
    cfg = tmp_path / "multi.yml"
    cfg.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    local = run_multi(cfg, tmp_path / "local", MergeOptions(out_shard_size=60_000))
    results = run_multi(cfg, tmp_path / "ray", MergeOptions(out_shard_size=60_000, executor="ray"))
    assert [r.name for r in results if r.ran] == ["one", "two"]
    assert len(counted_ray_init) == 1, counted_ray_init  # not one per stage
    assert not ray.is_initialized()  # and it was shut down at the end
    for r in local:  # the weights (the card and the config copy name the stage paths, which differ)
        weights = {n: v for n, v in _files(r.out_dir).items() if n.endswith((".safetensors", ".index.json"))}
        assert len(weights) >= 3 and weights.items() <= _files(tmp_path / "ray" / r.name).items()
    # Nothing to do: no Ray is started at all.
    assert not any(r.ran for r in run_multi(cfg, tmp_path / "ray", MergeOptions(out_shard_size=60_000, executor="ray")))
    assert len(counted_ray_init) == 1


def test_merge_raw_on_ray_is_byte_identical_to_local(tmp_path, counted_ray_init):
    generator = torch.Generator().manual_seed(0)
    for name in ("a", "b", "base"):
        state = {f"layer{i}.weight": torch.randn(64, 64, generator=generator) for i in range(6)}
        state["steps"] = torch.tensor(7)
        torch.save(state, tmp_path / f"{name}.bin")
    cfg = tmp_path / "raw.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "merge_method": "dare_ties",  # randomised: the same bytes also prove per-tensor seeding on Ray
                "base_model": str(tmp_path / "base.bin"),
                "models": [
                    {"model": str(tmp_path / f"{m}.bin"), "parameters": {"weight": 0.5, "density": 0.5}}
                    for m in ("a", "b")
                ],
            }
        )
    )
    options = {"out_shard_size": 40_000, "random_seed": 3}
    run_raw_merge(cfg, tmp_path / "local", MergeOptions(**options))
    run_raw_merge(cfg, tmp_path / "ray", MergeOptions(**options, executor="ray"))
    expected = _files(tmp_path / "local")
    assert sum(n.startswith("model-") for n in expected) >= 3  # several shards: several Ray tasks
    assert _files(tmp_path / "ray") == expected
    assert len(counted_ray_init) == 1 and not ray.is_initialized()
