"""How one option is described: its flags, default, click type, help (worded per command where a command
uses it differently) and whether --help shows it. A family of options is a dataclass whose fields carry these
descriptions (`option(...)`), so the family reads as the typed record of its values, and everything the user
sees of an option (the command-line flag, the API keyword, the docs) is generated from the one field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

NOT_GIVEN: Any = object()  # an attribute left to click's own default (click treats "not passed" apart from None)

OPTION = "mergesmith.option"  # the key of a dataclass field's metadata that holds its Opt


@dataclass(frozen=True)
class Opt:
    """One option of one or more commands.

    `decls`: click's declarations without the parameter name (`("--quiet/--no-quiet", "-q")`); the name is the
    dataclass field's. `help` is one text, or {command: text} with "*" for the others. `omit`: commands of the
    family that do not declare it (mergekit_flags.py may declare it there, with a note saying why it does
    nothing). `face_only`: the value only changes what is printed, so convert.to_merge_options leaves it out.
    `attrs`: click.Option keywords beyond these (`callback`, `expose_value`, `metavar`, ...)."""

    decls: tuple[str, ...]
    default: Any = NOT_GIVEN
    type: Any = None
    help: str | Mapping[str, str] | None = None
    hidden: bool = False
    is_flag: bool | None = None
    multiple: bool = False
    show_default: bool = False
    required: bool = False
    omit: tuple[str, ...] = ()
    face_only: bool = False  # what is printed (-v, -q): never reaches the engine's MergeOptions
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""  # set from the field (or the mergekit flag) that holds it

    def help_for(self, command: str) -> str | None:
        if self.help is None or isinstance(self.help, str):
            return self.help
        return self.help.get(command, self.help.get("*"))

    def but(self, **changes: Any) -> Opt:
        """This option as one command words or types it differently (evolve's --threads, extract-lora's
        --device...)."""
        return dataclasses.replace(self, **changes)

    def click_kwargs(self, command: str) -> dict[str, Any]:
        """click.Option's keywords for `command` (only those given, so click's own defaults stay its own)."""
        kw: dict[str, Any] = dict(self.attrs)
        if self.default is not NOT_GIVEN:
            kw["default"] = self.default
        if self.type is not None:
            kw["type"] = self.type
        if self.is_flag is not None:
            kw["is_flag"] = self.is_flag
        if self.multiple:
            kw["multiple"] = True
        if self.show_default:
            kw["show_default"] = True
        if self.required:
            kw["required"] = True
        if self.hidden:
            kw["hidden"] = True
        text = self.help_for(command)
        if text is not None:
            kw["help"] = text
        return kw

    @property
    def value_default(self) -> Any:
        """The value a caller gets when it does not give the option (a flag: False; repeatable: ())."""
        if self.default is not NOT_GIVEN:
            return self.default
        if self.multiple:
            return ()
        return False if self.is_flag else None


def option(*decls: str, **spec: Any) -> Any:
    """A dataclass field that is an option: `threads: int | None = option("--threads", type=..., help=...)`."""
    opt = Opt(decls, **spec)
    return field(default=_frozen(opt.value_default), metadata={OPTION: opt})


def reuse(opt: Opt, **changes: Any) -> Any:
    """A field of another family's option, reworded or retyped for this family's command (`changes`)."""
    changed = opt.but(**changes)
    return field(default=_frozen(changed.value_default), metadata={OPTION: changed})


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def options_of(family: type) -> list[Opt]:
    """A family's options in declaration order (the order --help lists them), each named after its field."""
    return [dataclasses.replace(f.metadata[OPTION], name=f.name) for f in dataclasses.fields(family)]


def opt_of(family: type, name: str) -> Opt:
    """One option of a family, by its field name (for `reuse`)."""
    for opt in options_of(family):
        if opt.name == name:
            return opt
    raise KeyError(f"{family.__name__} has no option {name!r}")


@dataclass(frozen=True)
class Part:
    """A piece of a command's option list: a family, or some of its fields (`only`), in --help order."""

    family: type | None  # None: mergekit's flags for the command (mergekit_flags.py's table)
    only: tuple[str, ...] = ()


Layout = tuple[Part, ...]
Callback = Callable[..., Any]
