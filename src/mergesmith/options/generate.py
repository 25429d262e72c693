"""What is generated from the options model (families.py + mergekit_flags.py's table): each command's option
list, its click options, and the Python API's keyword arguments with their defaults and checks.

The CLI decorates its commands with `click_options(command)`; python_api.py asks `api_defaults` and
`api_values` and never sees the command line. Both read the same click.Option objects, so a default, a type
check or an error message cannot differ between the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import click

from .. import mergekit_flags
from ..errors import ConfigError
from .families import API_EXCLUDE, LAYOUTS, MERGEKIT_NAMES
from .spec import Opt, options_of


def _from_flag(flag: mergekit_flags.Flag) -> Opt:
    """A mergekit flag (declared in mergekit_flags.py's table) as an option of the model."""
    attrs = dict(flag.attrs)
    default = attrs.pop("default", None)
    is_flag = attrs.pop("is_flag", None)
    kind = attrs.pop("type", None)
    return Opt(flag.decls[:-1], default=default, type=kind, help=flag.help, hidden=flag.hidden, is_flag=is_flag,
               attrs=attrs, name=flag.name)


def command_opts(command: str) -> list[Opt]:
    """`command`'s options, in --help order: its families' fields (less those it omits) and its mergekit flags."""
    if command not in LAYOUTS:
        raise KeyError(f"no command {command!r} in the options model (options/families.py LAYOUTS)")
    found: list[Opt] = []
    for part in LAYOUTS[command]:
        if part.family is None:
            found.extend(_from_flag(flag) for flag in mergekit_flags.flags_for(command))
            continue
        for opt in options_of(part.family):
            if (not part.only or opt.name in part.only) and command not in opt.omit:
                found.append(opt)
    return found


def click_params(command: str) -> list[click.Option]:
    """New click.Option objects for `command`, in --help order."""
    return [click.Option([*opt.decls, opt.name], **opt.click_kwargs(command)) for opt in command_opts(command)]


def click_options(command: str) -> Callable[[Any], Any]:
    """A decorator giving a click command function `command`'s options, as click.option decorators in a row
    would (put it below the arguments' decorators: the options follow them in --help)."""

    def apply(function: Any) -> Any:
        if not hasattr(function, "__click_params__"):
            function.__click_params__ = []
        function.__click_params__.extend(reversed(click_params(command)))  # click reverses what it collects
        return function

    return apply


def epilog(command: str) -> str | None:
    """The --help epilog naming the mergekit flags `command` accepts without effect."""
    return mergekit_flags.epilog(command, MERGEKIT_NAMES[command]) or None


@functools.cache
def _checker(command: str) -> click.Command:
    """A command object holding `command`'s options, for click's defaults and value checks (no CLI import)."""
    return click.Command(command, params=click_params(command))


def api_defaults(command: str, exclude: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{keyword: default} of `command`'s options as the Python API takes them: what the command function
    receives when the command line does not give the option (less `exclude`; None: those its API function
    takes otherwise, families.API_EXCLUDE)."""
    if exclude is None:
        exclude = API_EXCLUDE.get(command, ())
    checker = _checker(command)
    ctx = click.Context(checker)
    return {p.name: _default(p, ctx) for p in checker.params if p.name and p.name not in exclude}


def _default(param: Any, ctx: click.Context) -> Any:
    """click 8.2+ reports an option without a default as its UNSET marker and passes `()` for a repeatable one,
    None otherwise."""
    value = param.get_default(ctx)
    if param.value_is_missing(value):
        return () if param.multiple else None
    return value


def api_values(
    function: str, command: str, given: Mapping[str, Any], exclude: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The command's defaults updated with `given`: an unknown name is a TypeError (as for any Python
    function), a value the command would refuse is its ConfigError naming the option."""
    defaults = api_defaults(command, exclude)
    unknown = [k for k in given if k not in defaults]
    if unknown:
        names = ", ".join(sorted(defaults))
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r} (options: {names})")
    checker = _checker(command)
    ctx = click.Context(checker)
    params = {p.name: p for p in checker.params}
    resolved = dict(defaults)
    for key, value in given.items():
        if value is not None:
            try:
                value = params[key].type_cast_value(ctx, value)
            except click.BadParameter as exc:
                raise ConfigError(f"`{key}`: {exc.message}") from None
        resolved[key] = value
    return resolved
