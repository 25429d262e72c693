"""The options model (src/mergesmith/options/) is the one place an option is declared.

- README "Adding an option", done as it says: its field is added to a copy of the source, and the flag shows
  in `mergesmith merge --help`, `mergesmith.merge`/`mergesmith.plan` take the keyword (and check its value),
  the value reaches the engine's MergeOptions, and docs/options.md lists it;
- every option of every command, walked through the command line and the Python API: a non-default value
  given both ways reaches the run function (monkeypatched, so nothing is merged) as the same converted values
  (MergeOptions, RunControls, the command's own arguments, the notes printed, the hub settings), and differs
  from what the defaults give; the CLI-only commands (tokensurgeon, evolve) and options (plan's --json) are
  walked through the command line;
- the generated click options are exactly what --help showed before the model (info dicts and help texts are
  compared with the model's own declarations), and docs/options.md is current.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

import mergesmith
from mergesmith.cli import cli
from mergesmith.errors import ConfigError
from mergesmith.io import hub
from mergesmith.options import api_defaults, command_opts
from mergesmith.options.families import API_FUNCTIONS, LAYOUTS
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]


# ----- README: "Adding an option" ------------------------------------------------------------------------


def _readme_field() -> str:
    """The code block of the README's "Adding an option" section (the field to add to SharedMerge)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Adding an option", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "README's 'Adding an option' has no python block"
    return block.group(1)


_ADDED_OPTION_SCRIPT = r"""
import json, sys
from click.testing import CliRunner
import mergesmith
import mergesmith.engine.run as run
from mergesmith.cli import cli, main
from mergesmith.errors import ConfigError

config, out = sys.argv[1], sys.argv[2]
seen = {}

class Captured(Exception):
    pass

def fake_run_merge(config, out_dir, options=None, *, controls=None):
    seen.setdefault("merge", []).append(options.extra.get("keep_going"))
    raise Captured

def fake_build_plan(config, options, out_dir=None, source=None):
    seen.setdefault("plan", []).append(options.extra.get("keep_going"))
    raise Captured

run.run_merge, run.build_plan = fake_run_merge, fake_build_plan
result = {"help": CliRunner().invoke(cli, ["merge", "--help"], terminal_width=200).output}
for args in (["merge", config, out, "--keep-going"], ["plan", config, "--keep-going"], ["merge", config, out]):
    try:
        main(args)
    except SystemExit:
        pass
for call in (lambda: mergesmith.merge(config, out, keep_going=True), lambda: mergesmith.plan(config, keep_going=True)):
    try:
        call()
    except Captured:
        pass
try:
    mergesmith.merge(config, out, keep_going="perhaps")
except ConfigError as exc:
    result["bad_value"] = str(exc)
from mergesmith.options.docs import render
result["in_docs"] = "--keep-going" in render()
result["seen"] = seen
print(json.dumps(result))
"""


def test_adding_an_option_as_the_readme_says(tmp_path: Path, tiny_models: Any) -> None:
    field = _readme_field()
    assert "keep_going" in field and "--keep-going" in field
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "mergesmith", copy / "mergesmith", ignore=shutil.ignore_patterns("__pycache__"))
    families = copy / "mergesmith" / "options" / "families.py"
    text = families.read_text()
    start = text.index("class SharedMerge")
    end = text.index("\n\n\n", start)  # the end of the class body
    families.write_text(text[:end] + "\n" + field.rstrip("\n") + text[end:])

    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}))
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _ADDED_OPTION_SCRIPT, str(config), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "--keep-going / --no-keep-going" in result["help"]
    assert "Go on past a tensor" in result["help"]
    # CLI with the flag, the API with the keyword, CLI without it: the value reaches MergeOptions by name
    assert result["seen"] == {"merge": [True, False, True], "plan": [True, True]}
    assert "`keep_going`" in result["bad_value"]
    assert result["in_docs"]


# ----- every option through the command line and the API ---------------------------------------------------


class Captured(Exception):
    """Raised by the run function stand-in: the options got there, nothing is merged."""


# Where each command hands its converted options over (the module attribute both faces look up at call time).
TARGETS = {
    "merge": ("mergesmith.engine.run", "run_merge"),
    "plan": ("mergesmith.engine.run", "build_plan"),
    "merge-raw": ("mergesmith.raw.merge", "run_raw_merge"),
    "multi": ("mergesmith.multi.stages", "run_multi"),
    "moe": ("mergesmith.moe", "run_moe"),
    "extract-lora": ("mergesmith.lora.extract", "extract_lora"),
    "tokensurgeon": ("mergesmith.tokensurgeon", "run_tokensurgeon"),
    "evolve": ("mergesmith.evolve.command", "run_evolve_command"),
}

# Options whose value only changes what is printed (a traceback on error, a progress display), never what a
# run is given; every other option must change the captured values.
PRINTING_ONLY = {"verbose", "quiet", "as_json", "tensors"}
# Options a command accepts that, by design, change nothing its run is given (the reason for each).
NOT_GIVEN_TO_THE_RUN = {
    ("extract-lora", "num_threads"): "sets torch's threads in the command's process (the API leaves the caller's)",
    ("plan", "lora_merge_cache"): "plan sees a model+lora input through its adapter, never merged into a cache",
    ("plan", "lora_merge_dtype"): "plan sees a model+lora input through its adapter, never merged into a cache",
}


def _value(command: str, param: click.Option, tmp_path: Path) -> Any:
    """A valid value other than the default for `param` (what the walk gives it)."""
    special = {
        "out_shard_size": "2G",
        "max_memory": "8GB",
        "ray_address": "auto",
        "lora_merge_dtype": "float16",
        "dtype": "float16",
        "lm_eval_arg": ("limit=3",),
        "include_regex": ("mlp",),
        "exclude_regex": ("attn",),
        "save_module": ("lm_head",),
    }
    if param.name in special:
        return special[param.name]
    default = param.get_default(click.Context(click.Command(command)))
    if param.is_flag and param.is_bool_flag:
        return not default
    kind = param.type
    if isinstance(kind, click.Choice):
        return next(c for c in kind.choices if c != default)
    if isinstance(kind, click.Path):
        return str(tmp_path / f"{param.name}-dir")
    if isinstance(kind, click.types.IntParamType):
        low = getattr(kind, "min", None) or 1
        return low + 2 if default != low + 2 else low + 3
    if isinstance(kind, click.types.FloatParamType):
        return 0.5
    if param.type is click.BOOL:  # a bool option that is not a flag (--in-memory/--no-in-memory, default None)
        return True
    return ("x",) if param.multiple else "x"


def _argv(param: click.Option, value: Any) -> list[str]:
    """The command-line spelling of `value` for `param`."""
    if param.is_flag and param.is_bool_flag:
        if value:
            return [param.opts[0]]
        return [param.secondary_opts[0]]
    if param.type is click.BOOL and param.secondary_opts:
        return [param.opts[0] if value else param.secondary_opts[0]]
    values = value if param.multiple else (value,)
    return [a for v in values for a in (param.opts[0], str(v))]


def _plain(value: Any) -> Any:
    """A comparable form of a captured argument: dataclasses as dicts, paths as strings, callables dropped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not callable(
            getattr(value, f.name)) and f.name != "stop"}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_NOT_OPTIONS = ("stop", "source")  # the stop event (the CLI's Ctrl-C handler), the config's name in messages


def _named(message: str) -> str:
    """An error message with the option named as an option (the API may name `device`, the CLI `--device`)."""
    return re.sub(r"`--?", "`", message)


class _Recorder:
    """Stands in for a command's run function and keeps what it was given, in comparable form."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keep = args if self.command in ("extract-lora", "evolve", "tokensurgeon") else args[1:]  # not the config
        record = {
            "args": [_plain(a) for a in keep if not callable(a)],
            "kwargs": {k: _plain(v) for k, v in kwargs.items() if k not in _NOT_OPTIONS and not k.startswith("on_")},
            "hub": (str(hub.SETTINGS.cache_dir), hub.SETTINGS.offline),
        }
        if self.command == "evolve":  # evolve's conversion (SearchOptions) happens in the function captured
            from mergesmith.evolve.command import search_options

            try:
                record["search"] = _plain(search_options(dict(args[2])))
            except ConfigError as exc:
                record["search"] = f"error: {exc}"
        self.calls.append(record)
        raise Captured


@pytest.fixture()
def inputs(tmp_path: Path, tiny_models: Any) -> dict[str, Any]:
    a, b = tiny_models("llama", seed=1), tiny_models("llama", seed=2)
    merge = tmp_path / "merge.yml"
    merge.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}))
    moe = tmp_path / "moe.yml"
    moe.write_text(yaml.safe_dump({"base_model": str(a), "gate_mode": "random", "experts": [
        {"source_model": str(a), "positive_prompts": ["one"]}, {"source_model": str(b), "positive_prompts": ["two"]}]}))
    genome = tmp_path / "genome.yml"
    genome.write_text("genome: {}\n")
    out = tmp_path / "out"
    return {
        # (command-line arguments, the API call's positional arguments)
        "merge": ([merge, out], (merge, out)),
        "plan": ([merge], (merge,)),
        "merge-raw": ([merge, out], (merge, out)),
        "multi": ([merge, "--out-dir", out], (merge, out)),
        "moe": ([moe, out], (moe, out)),
        "extract-lora": (["--model", a, "--base", b, "--out", out], (str(a), str(b), out)),
        "tokensurgeon": ([a, b, out], None),
        "evolve": ([genome, "--storage-path", tmp_path / "storage"], None),
    }


def _through_cli(capsys: Any, command: str, args: list[Any], extra: list[str], recorder: _Recorder) -> Any:
    import torch

    threads = torch.get_num_threads()
    try:
        code, _out, err = run_cli(capsys, command, *args, *extra)
    finally:
        torch.set_num_threads(threads)
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    if recorder.calls:
        return {**recorder.calls.pop(), "notes": notes}
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error) == 1, f"{command} {extra}: exit {code}\n{err}"
    return {"error": _named(error[0].removeprefix("error: ")), "notes": notes}


def _through_api(
    caplog: Any, command: str, positional: tuple[Any, ...], kw: dict[str, Any], recorder: _Recorder
) -> Any:
    caplog.clear()
    try:
        getattr(mergesmith, API_FUNCTIONS[command])(*positional, **kw)
    except Captured:
        notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note:")]
        return {**recorder.calls.pop(), "notes": notes}
    except ConfigError as exc:
        notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note:")]
        return {"error": _named(str(exc)), "notes": notes}
    raise AssertionError(f"mergesmith.{API_FUNCTIONS[command]} ran to the end")


@pytest.mark.parametrize("command", list(LAYOUTS))
def test_every_option_means_the_same_on_the_command_line_and_in_the_api(
    command: str, inputs: dict[str, Any], tmp_path: Path, capsys: Any, caplog: Any, monkeypatch: Any
) -> None:
    import importlib

    caplog.set_level(logging.INFO, logger="mergesmith")
    monkeypatch.setattr(hub, "SETTINGS", hub.HubSettings())
    module, name = TARGETS[command]
    recorder = _Recorder(command)
    monkeypatch.setattr(importlib.import_module(module), name, recorder)
    args, positional = inputs[command]
    keywords = api_defaults(command) if positional is not None else {}
    params = {p.name: p for p in cli.commands[command].params if isinstance(p, click.Option)}
    required = {n for n, p in params.items() if p.required}

    default_cli = _through_cli(capsys, command, args, [], recorder)
    assert "error" not in default_cli, default_cli
    if positional is not None:
        default_api = _through_api(caplog, command, positional, {}, recorder)
        assert default_api == default_cli, json.dumps([default_api, default_cli], indent=1, default=str)
    walked = []
    for opt in command_opts(command):
        if opt.name in required:  # given in every call above (positional in the API)
            continue
        param = params[opt.name]
        value = _value(command, param, tmp_path)
        on_cli = _through_cli(capsys, command, args, _argv(param, value), recorder)
        if opt.name in keywords:
            on_api = _through_api(caplog, command, positional, {opt.name: value}, recorder)
            assert on_api == on_cli, f"{command} {opt.name}={value!r}: the API and the command line differ"
        if opt.name not in PRINTING_ONLY and (command, opt.name) not in NOT_GIVEN_TO_THE_RUN:
            assert on_cli != default_cli, f"{command} {opt.name}={value!r} changed nothing a run is given"
        walked.append(opt.name)
    assert len(walked) + len(required) == len(params)


# ----- the generated options ------------------------------------------------------------------------------


def test_the_cli_options_are_generated_from_the_model() -> None:
    for command, layout in LAYOUTS.items():
        assert layout, command
        options = [p for p in cli.commands[command].params if isinstance(p, click.Option)]
        assert [p.name for p in options] == [o.name for o in command_opts(command)]
        for param, opt in zip(options, command_opts(command)):
            assert param.help == opt.help_for(command), (command, opt.name)
            assert param.hidden == opt.hidden


def test_help_texts_differ_per_command_where_the_option_does() -> None:
    def help_of(command: str, name: str) -> str | None:
        return next(p.help for p in cli.commands[command].params if p.name == name)

    assert help_of("merge", "device") == "Where the merge arithmetic runs."
    assert help_of("moe", "device") == "Where the router pass (gate_mode hidden) and the arithmetic run."
    assert help_of("evolve", "threads") == "Torch threads (default: 1, tiny models)."
    assert help_of("merge", "threads") == "Worker threads (default: number of cores)."
    evolve_seed = next(p for p in cli.commands["evolve"].params if p.name == "random_seed")
    assert evolve_seed.default == 0 and evolve_seed.show_default


def test_the_api_imports_nothing_from_the_command_line() -> None:
    code = (
        "import sys, mergesmith.python_api, mergesmith.display.notebook, mergesmith.display.command_output, "
        "mergesmith.display.interrupts; mergesmith.python_api.command_options('merge'); "
        "print('mergesmith.cli' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_docs_options_md_is_current() -> None:
    from mergesmith.options.docs import render

    assert (ROOT / "docs" / "options.md").read_text() == render(), "run `python -m mergesmith.options.docs`"
