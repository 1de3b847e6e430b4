"""`iterserve serve`'s engine flags, generated from EngineConfig's fields.

In: EngineConfig's fields and their `flag(...)` metadata (group, help, choices, metavar). Out: one
argparse flag per field, named `--field-name`, with the field's type and default; and the
EngineConfig values of parsed arguments. A bool field that defaults to True is turned off with
`--no-field-name`, one that defaults to False is turned on with `--field-name`, and one that
defaults to None (decided at resolve time) takes both forms. Serve's own flags (host, port, model,
tokens...) stay declared in engine/server/cli.py; the operator and the pod runtime read the whole
list from serve's parser, so no copy of it can name a flag serve does not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping

from iterserve.engine.config import EngineConfig


def flag_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that are serve flags, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if "group" in f.metadata]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def value_type(name: str) -> type:
    """The argparse type of a field: int | None -> int; a size (str | int) stays a string."""
    hint = typing.get_type_hints(EngineConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return str if str in args else args[0]


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.default is True:
        return f"{text} (on by default; this flag turns it off)"
    if f.default is None or f.default is False or f.default == ():
        return text  # a None default is explained in the help; False's is the flag's form
    return f"{text} (default {f.default})"


def _add(container: argparse._ActionsContainer, f: dataclasses.Field) -> None:
    name, kind = flag_name(f.name), value_type(f.name)
    if kind is bool and f.default is None:
        container.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=_help(f))
    elif kind is bool and f.default:
        container.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", help=_help(f))
    elif kind is bool:
        container.add_argument(name, dest=f.name, action="store_true", help=_help(f))
    elif isinstance(f.default, tuple):  # a list of values: --flag A B C
        container.add_argument(name, dest=f.name, nargs="+", type=kind, default=f.default,
                               metavar=f.metadata["metavar"], help=_help(f))
    else:
        choices = f.metadata["choices"] or None
        container.add_argument(name, dest=f.name, type=kind, default=f.default, choices=choices,
                               metavar=f.metadata["metavar"], help=_help(f))


def add_engine_flags(groups: Mapping[str, argparse._ActionsContainer]) -> None:
    """Add every engine flag to its help group (groups: name -> the parser's argument group)."""
    for f in flag_fields():
        _add(groups[f.metadata["group"]], f)


def engine_values(args: argparse.Namespace) -> dict:
    """The parsed engine flags as EngineConfig keyword arguments."""
    return {f.name: tuple(value) if isinstance(value := getattr(args, f.name), list) else value
            for f in flag_fields()}
