"""Write tests/fixtures/mergekit_flags.json: every argument and option of mergekit 0.1.5's commands.

Run it with the python of the venv `scripts/mergekit_venv.sh` makes, with mergekit's `evolve` extra (without
it `mergekit-evolve` cannot be imported):

    "$(MERGEKIT_EXTRAS=evolve bash scripts/mergekit_venv.sh | tail -1)" scripts/mergekit_flags.py

It reads the commands from mergekit's installed entry points and walks their click parameters, so
the list is what mergekit's parser accepts, not what its --help happens to print. Each command is
keyed by its console-script name and names its mergesmith counterpart; tests/test_mergekit_flags.py
checks that the counterpart accepts every spelling.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

import click

# mergekit console script -> the mergesmith command that does its job
COUNTERPARTS = {
    "mergekit-yaml": "merge",
    "mergekit-moe": "moe",
    "mergekit-multi": "multi",
    "mergekit-pytorch": "merge-raw",
    "mergekit-evolve": "evolve",
    "mergekit-tokensurgeon": "tokensurgeon",
    "mergekit-extract-lora": "extract-lora",
}

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mergekit_flags.json"


def _type_name(param: click.Parameter) -> str:
    """A short, stable name of what the parameter takes (the choices for a Choice)."""
    kind = param.type
    if isinstance(kind, click.Choice):
        return "choice:" + ",".join(str(c) for c in kind.choices)
    return kind.name


def _option(param: click.Option) -> dict:
    """One option: every spelling, whether it takes a value, and mergekit's help."""
    takes_value = not param.is_flag and not param.count
    entry = {
        "name": param.name,
        "flags": sorted(param.opts) + sorted(param.secondary_opts),
        "takes_value": takes_value,
        "type": "flag" if not takes_value else _type_name(param),
        "multiple": bool(param.multiple),
        "required": bool(param.required),
        "help": " ".join((param.help or "").split()),
    }
    if param.secondary_opts:
        entry["off_flags"] = sorted(param.secondary_opts)
    if not param.is_flag and param.flag_value is not None and getattr(param, "_flag_needs_value", False):
        entry["optional_value"] = True  # `--opt` alone or `--opt VALUE`
    return entry


def _command(command: click.Command) -> dict:
    arguments = [
        {"name": p.name, "nargs": p.nargs, "required": bool(p.required)}
        for p in command.params
        if isinstance(p, click.Argument)
    ]
    options = [_option(p) for p in command.params if isinstance(p, click.Option)]
    # click's own --help is a parameter too (added by the context), listed for completeness
    help_option = command.get_help_option(click.Context(command))
    if help_option is not None:
        options.append(_option(help_option))
    return {"arguments": arguments, "options": sorted(options, key=lambda o: o["flags"][0])}


def _stand_in_for_vllm() -> None:
    """mergekit 0.1.5's evolve module names `lm_eval.models.vllm_causallms.VLLM` in a class-level type
    annotation, evaluated at import, so without vLLM (a CUDA-only install) `mergekit-evolve` cannot even be
    imported. Only for reading its parameters here, a placeholder module stands in for lm-eval's vLLM
    wrapper when the real one cannot be imported; nothing runs it."""
    try:
        import lm_eval.models.vllm_causallms  # noqa: F401
    except ImportError:
        import types

        import lm_eval.models

        placeholder = types.ModuleType("lm_eval.models.vllm_causallms")
        placeholder.VLLM = type("VLLM", (), {})
        sys.modules[placeholder.__name__] = placeholder
        lm_eval.models.vllm_causallms = placeholder


def main() -> None:
    scripts = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name in COUNTERPARTS}
    missing = sorted(set(COUNTERPARTS) - set(scripts))
    if missing:
        sys.exit(f"error: mergekit's entry points lack {', '.join(missing)}; is mergekit 0.1.5 installed here?")
    commands = {}
    for name in COUNTERPARTS:
        if name == "mergekit-evolve":
            _stand_in_for_vllm()
        command = scripts[name].load()
        if not isinstance(command, click.Command):
            sys.exit(f"error: {name} ({scripts[name].value}) is not a click command")
        commands[name] = {"mergesmith": COUNTERPARTS[name], "entry_point": scripts[name].value, **_command(command)}
    fixture = {
        "generated_by": "scripts/mergekit_flags.py",
        "mergekit": version("mergekit"),
        "click": version("click"),
        "commands": commands,
    }
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    total = sum(len(c["options"]) for c in commands.values())
    print(f"wrote {OUT} ({len(commands)} commands, {total} options)")


if __name__ == "__main__":
    main()
