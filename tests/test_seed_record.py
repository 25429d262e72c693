"""A randomised merge without --random-seed draws a seed, records it where users look, and reproduces from it."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml

from tests.helpers import read_state_dict


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from mergesmith.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300)


def test_drawn_seed_is_recorded_and_reproduces_the_bytes(tmp_path, tiny_models):
    base = tiny_models("llama", seed=11)
    a, b = tiny_models.derive(base, seed=1, scale=0.02), tiny_models.derive(base, seed=2, scale=0.02)
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({
        "merge_method": "dare_ties",
        "base_model": str(base),
        "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in (a, b)],
    }))
    first = _run(["merge", str(cfg), str(tmp_path / "one"), "-q"])
    assert first.returncode == 0, first.stderr
    card = (tmp_path / "one" / "README.md").read_text()
    saved = (tmp_path / "one" / "mergekit_config.yml").read_text()
    seeds = {int(m) for m in re.findall(r"random-seed (\d+)", card) + re.findall(r"seed used: (\d+)", saved)}
    assert len(seeds) == 1, (card, saved)
    seed = seeds.pop()
    again = _run(["merge", str(cfg), str(tmp_path / "two"), "-q", "--random-seed", str(seed), "--threads", "1"])
    assert again.returncode == 0, again.stderr
    one, two = read_state_dict(tmp_path / "one"), read_state_dict(tmp_path / "two")
    assert one.keys() == two.keys() and all(one[k].equal(two[k]) for k in one)
    other = _run(["merge", str(cfg), str(tmp_path / "three"), "-q", "--random-seed", str(seed + 1)])
    assert other.returncode == 0, other.stderr
    three = read_state_dict(tmp_path / "three")
    assert any(not one[k].equal(three[k]) for k in one if "layers" in k)  # the seed matters


def test_deterministic_methods_record_no_seed(tmp_path, tiny_models):
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    cfg = tmp_path / "c.yml"
    models = [{"model": str(m), "parameters": {"weight": 1.0}} for m in (a, b)]
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "models": models}))
    done = _run(["merge", str(cfg), str(tmp_path / "o"), "-q"])
    assert done.returncode == 0, done.stderr
    assert "seed" not in (tmp_path / "o" / "README.md").read_text().lower()
    assert "seed" not in (tmp_path / "o" / "mergekit_config.yml").read_text().lower()
