"""A third-party package adds a merge method through the `mergesmith.methods` entry point.

The plugin is a real package, built and installed by pip (`--target`, no network, no build isolation) into a
folder the child processes put on their path, exactly as `pip install` would make it visible; the merges run
the `mergesmith` command in those processes. Also: a plugin that fails to load is named when its method is
asked for, and never stops a merge with a built-in method.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import write_config

PLUGIN = '''
"""A merge method from outside mergesmith: the entry of largest magnitude across the models."""

import torch

from mergesmith.methods import MethodSpec, ParamSpec


def _largest_magnitude(inputs):
    stacked = torch.stack([t.float() for t in inputs.tensors])
    pick = stacked.abs().argmax(0, keepdim=True)
    return (stacked.gather(0, pick)[0] * float(inputs.params["scale"])).to(inputs.tensors[0].dtype)


def methods():
    return MethodSpec(
        name="largest_magnitude",
        merge=_largest_magnitude,
        params=(ParamSpec("scale", 1.0),),
        description="the entry of largest magnitude across the models",
    )


def broken():
    raise RuntimeError("this plugin needs a GPU it cannot find")


def clashing():
    return MethodSpec(name="linear", merge=_largest_magnitude)
'''

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "mergesmith-largest-magnitude"
version = "0.1"

[project.entry-points."mergesmith.methods"]
largest_magnitude = "largest_magnitude:methods"
gpu_only = "largest_magnitude:broken"
linear = "largest_magnitude:clashing"
"""


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("plugin-source")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "largest_magnitude.py").write_text(textwrap.dedent(PLUGIN))
    site = tmp_path_factory.mktemp("plugin-site")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(site.glob("*.dist-info/entry_points.txt")), "pip installed the package with its entry points"
    return site


def mergesmith(site: Path, *args: Any) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "mergesmith", *map(str, args)],
        env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def two_models(tiny_models: Any) -> tuple[Path, Path]:
    return tiny_models("llama", seed=1), tiny_models("llama", seed=2)


def test_an_installed_plugin_method_merges(plugin_site: Path, two_models: tuple[Path, Path], tmp_path: Path):
    a, b = two_models
    cfg = write_config(tmp_path / "plugin.yml", {
        "merge_method": "largest_magnitude",
        "models": [{"model": str(a)}, {"model": str(b)}],
        "parameters": {"scale": 0.5},
        "dtype": "float32",
    })
    planned = mergesmith(plugin_site, "plan", cfg)
    assert planned.returncode == 0, planned.stderr
    assert "largest_magnitude" in planned.stdout
    done = mergesmith(plugin_site, "merge", cfg, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    x, y = ta[name].float(), tb[name].float()
    expected = torch.where(y.abs() > x.abs(), y, x) * 0.5
    torch.testing.assert_close(out[name].float(), expected.to(out[name].dtype).float(), rtol=0, atol=0)


def test_a_plugin_that_fails_to_load_is_named_when_its_method_is_asked_for(
    plugin_site: Path, two_models: tuple[Path, Path], tmp_path: Path
):
    a, b = two_models
    cfg = write_config(tmp_path / "gpu.yml", {"merge_method": "gpu_only", "models": [{"model": str(a)}]})
    done = mergesmith(plugin_site, "plan", cfg)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "gpu_only = largest_magnitude:broken" in lines[0]
    assert "mergesmith-largest-magnitude" in lines[0] and "cannot find" in lines[0]


def test_a_plugin_cannot_replace_a_built_in_method_and_built_ins_still_merge(
    plugin_site: Path, two_models: tuple[Path, Path], tmp_path: Path
):
    a, b = two_models
    cfg = write_config(tmp_path / "linear.yml", {
        "merge_method": "linear",
        "models": [{"model": str(a), "parameters": {"weight": 1.0}}, {"model": str(b), "parameters": {"weight": 1.0}}],
        "dtype": "float32",
    })
    with_plugin = mergesmith(plugin_site, "merge", cfg, tmp_path / "with")
    assert with_plugin.returncode == 0, with_plugin.stderr
    without = mergesmith(tmp_path / "nothing-installed-here", "merge", cfg, tmp_path / "without")
    assert without.returncode == 0, without.stderr
    assert (tmp_path / "with" / "model.safetensors").read_bytes() == (
        tmp_path / "without" / "model.safetensors"
    ).read_bytes(), "the built-in linear ran, not the plugin's"
