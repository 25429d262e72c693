"""Every flag of every mergekit 0.1.5 command is accepted by its mergesmith counterpart.

tests/fixtures/mergekit_flags.json lists them as mergekit's own click parser declares them (written by
scripts/mergekit_flags.py in the venv scripts/mergekit_venv.sh makes). Each spelling (short forms and `--no-`
forms included) is parsed by the counterpart with a sensible value where it takes one; a flag must take a
value here exactly when it does in mergekit (else `--flag VALUE` would misparse), be repeatable where
mergekit's is, and the positional arguments must match in number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest

from mergesmith.cli import cli

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "mergekit_flags.json").read_text())
COMMANDS: dict[str, Any] = FIXTURE["commands"]

# A value mergesmith's counterpart accepts, for options whose mergekit type is free text.
TEXT_VALUES = {"device": "cpu", "lora_merge_dtype": "bfloat16", "transformers_cache": "hf-cache"}
TYPE_VALUES = {"integer": "2", "float": "0.5", "size": "1B"}

# What a command needs besides the flag under test (its required options), so the parse reaches the flag.
REQUIRED = {
    "evolve": ["--storage-path", "store"],
    "extract-lora": ["--model", "m", "--base-model", "b", "--out-path", "o"],
    "multi": ["--intermediate-dir", "stages"],
}


def _value(option: dict[str, Any]) -> str:
    kind = option["type"]
    if kind.startswith("choice:"):
        return kind.split(":", 1)[1].split(",")[0]
    return TYPE_VALUES.get(kind, TEXT_VALUES.get(option["name"], "x"))


def _cases() -> list[Any]:
    cases = []
    for script, spec in COMMANDS.items():
        for option in spec["options"]:
            for spelling in option["flags"]:
                cases.append(pytest.param(script, spec["mergesmith"], option, spelling, id=f"{script} {spelling}"))
    return cases


def _positionals(command: click.Command) -> list[str]:
    return [f"arg{i}" for i, p in enumerate(command.params) if isinstance(p, click.Argument)]


def _ours(command: click.Command, spelling: str) -> click.Option | None:
    for param in command.params:
        if isinstance(param, click.Option) and spelling in (*param.opts, *param.secondary_opts):
            return param
    help_option = command.get_help_option(click.Context(command))
    return help_option if help_option is not None and spelling in help_option.opts else None


def test_the_fixture_covers_every_mergekit_command() -> None:
    assert FIXTURE["mergekit"] == "0.1.5"
    assert {s: c["mergesmith"] for s, c in COMMANDS.items()} == {
        "mergekit-yaml": "merge",
        "mergekit-moe": "moe",
        "mergekit-multi": "multi",
        "mergekit-pytorch": "merge-raw",
        "mergekit-evolve": "evolve",
        "mergekit-tokensurgeon": "tokensurgeon",
        "mergekit-extract-lora": "extract-lora",
    }
    assert sum(len(c["options"]) for c in COMMANDS.values()) > 150  # every option, not a sample


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_positional_arguments_match(script: str) -> None:
    spec = COMMANDS[script]
    ours = [p for p in cli.commands[spec["mergesmith"]].params if isinstance(p, click.Argument)]
    theirs = spec["arguments"]
    assert [(p.nargs, p.required) for p in ours] == [(a["nargs"], a["required"]) for a in theirs], (
        f"{script} takes {[a['name'] for a in theirs]}, mergesmith {spec['mergesmith']} {[p.name for p in ours]}"
    )


@pytest.mark.parametrize(("script", "counterpart", "option", "spelling"), _cases())
def test_every_spelling_is_accepted(script: str, counterpart: str, option: dict[str, Any], spelling: str) -> None:
    command = cli.commands[counterpart]
    ours = _ours(command, spelling)
    assert ours is not None, f"`mergesmith {counterpart}` does not accept {script}'s {spelling}"
    takes_value = not ours.is_flag and not ours.count
    assert takes_value == option["takes_value"], (
        f"{spelling}: mergekit's {'takes' if option['takes_value'] else 'takes no'} value, mergesmith's "
        f"{'takes' if takes_value else 'takes no'} value"
    )
    if option["multiple"]:
        assert ours.multiple, f"{spelling} is repeatable in {script}, not in mergesmith {counterpart}"
    if spelling in ("--help", "-h"):
        return
    args = [*_positionals(command), *REQUIRED.get(counterpart, [])]
    given = [spelling, _value(option)] if option["takes_value"] else [spelling]
    ctx = command.make_context(counterpart, [*args, *given])  # raises NoSuchOption / BadParameter otherwise
    assert ctx.get_parameter_source(ours.name) is click.core.ParameterSource.COMMANDLINE


@pytest.mark.parametrize("counterpart", sorted({c["mergesmith"] for c in COMMANDS.values()}))
def test_help_renders_and_names_the_flags_without_effect(counterpart: str) -> None:
    from mergesmith import mergekit_flags

    command = cli.commands[counterpart]
    text = command.get_help(click.Context(command, info_name=counterpart))
    flat = " ".join(text.split())
    for name in mergekit_flags.hidden_names(counterpart):
        assert name in flat.replace("- ", "-"), f"{name} not named in `mergesmith {counterpart} --help`"
