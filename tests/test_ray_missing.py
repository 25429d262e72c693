"""Without Ray installed, `--executor ray` is one clear line naming the extra to install (runs with or without Ray)."""

from __future__ import annotations

import sys

import pytest
import yaml

from mergesmith.cli import main


def test_executor_ray_without_ray_says_how_to_install_it(tmp_path, tiny_models, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as when it is absent
    monkeypatch.delitem(sys.modules, "mergesmith.engine.execution.ray_executor", raising=False)
    import mergesmith.engine

    monkeypatch.delattr(mergesmith.engine, "ray", raising=False)
    model = str(tiny_models("llama", seed=1))
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        yaml.safe_dump(
            {"merge_method": "linear", "models": [{"model": model}, {"model": model}], "parameters": {"weight": 1.0}}
        )
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", str(cfg), str(tmp_path / "out"), "--executor", "ray", "-q"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err == "error: `--executor ray` needs Ray, which is not installed: pip install 'mergesmith[ray]'\n"
    assert not (tmp_path / "out").exists()  # refused before planning or touching the output
