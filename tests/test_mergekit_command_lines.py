"""Published mergekit command lines run with the command name swapped (`mergekit-yaml` -> `mergesmith merge`).

Each line of tests/fixtures/mergekit_command_lines.txt (where it was published is noted above it) runs
in-process on tiny generated models, really merging: only the config path and the output paths are
replaced, every flag stays as published. A line without a GPU flag must exit 0 and leave a complete
output; one that asks for `--cuda` does the same where CUDA is present and is refused in one `error:`
line elsewhere. A flag that has no effect here prints at most one `note:` line each, never a warning.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.helpers import assert_one_line_error, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
FLAGS = json.loads((FIXTURES / "mergekit_flags.json").read_text())["commands"]
GPU_FLAGS = {"--cuda", "--gpu-rich", "--multi-gpu"}
PATH_OPTIONS = {"--intermediate-dir", "-I", "--out-path"}


def _lines() -> list[Any]:
    found = []
    source = ""
    for number, raw in enumerate((FIXTURES / "mergekit_command_lines.txt").read_text().splitlines(), start=1):
        text = raw.strip()
        if text.startswith("# source:"):
            source = text.removeprefix("# source:").strip()
        if text and not text.startswith("#"):
            found.append(pytest.param(shlex.split(text), source, id=f"line{number}"))
    return found


def _value_options(script: str) -> set[str]:
    return {f for o in FLAGS[script]["options"] if o["takes_value"] for f in o["flags"]}


def _configs(tmp_path: Path, a: Path, b: Path) -> dict[str, Path]:
    linear = {
        "merge_method": "linear",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)],
        "dtype": "float32",
    }
    moe = {
        "base_model": str(a),
        "gate_mode": "random",
        "experts": [{"source_model": str(m), "positive_prompts": ["tok5 tok6"]} for m in (a, b)],
    }
    final = [{"model": "first", "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]
    stages = [{**linear, "name": "first"}, {**linear, "models": final}]
    out = {"mergekit-yaml": tmp_path / "config.yaml", "mergekit-moe": tmp_path / "moe.yaml"}
    out["mergekit-yaml"].write_text(yaml.safe_dump(linear))
    out["mergekit-moe"].write_text(yaml.safe_dump(moe))
    out["mergekit-multi"] = tmp_path / "multi.yaml"
    out["mergekit-multi"].write_text(yaml.safe_dump_all(stages))
    return out


@pytest.mark.parametrize(("words", "source"), _lines())
def test_published_command_line_runs_with_the_name_swapped(
    words: list[str], source: str, tmp_path: Path, tiny_models: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MERGESMITH_CACHE_DIR", str(tmp_path / "cache"))  # router weights of the MoE lines
    script, args = words[0], words[1:]
    assert source, "every command line says where it was published"
    counterpart = FLAGS[script]["mergesmith"]
    config = _configs(tmp_path, tiny_models("llama", seed=1), tiny_models("llama", seed=2))[script]
    takes_value = _value_options(script)
    swapped: list[str] = []
    positionals = 0
    outputs: list[Path] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("-"):
            swapped.append(word)
            if word in takes_value:
                value = args[i + 1]
                if word in PATH_OPTIONS:
                    value = str(tmp_path / Path(value).name)
                    outputs.append(Path(value))
                swapped.append(value)
                i += 1
        else:
            positionals += 1
            if positionals == 1:
                swapped.append(str(config))
            else:
                outputs.append(tmp_path / "out" / Path(word).name)
                swapped.append(str(outputs[-1]))
        i += 1
    code, out, err = run_cli(capsys, counterpart, *swapped)
    if GPU_FLAGS & set(args) and not torch.cuda.is_available():
        if "-v" in args:  # mergesmith's -v shows the traceback of an error too; the error is still one line, last
            assert code == 2 and [line for line in err.splitlines() if line.startswith("error:")] == [
                err.splitlines()[-1]
            ], err
            err = err.splitlines()[-1] + "\n"
        assert_one_line_error(code, err, "cuda")
        assert not any(o.exists() for o in outputs)
        return
    assert code == 0, f"{' '.join(words)}\n{err}"
    assert "wrote" in out
    lines = err.splitlines()
    assert not [line for line in lines if line.startswith(("warning:", "error:"))], err
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == len(set(notes)), f"a note printed twice:\n{err}"
    final = outputs[-1]
    assert (final / "config.json").is_file(), f"no complete output in {final}"
