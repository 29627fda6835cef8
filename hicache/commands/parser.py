"""What a subcommand and its arguments are described with, and the loop that turns such a
description into argparse: `build_parser(COMMANDS)` (the table is `hicache.commands.table`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import attrs

from hicache.runtime import cache_flags

Run = Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """Bad input gets one line naming the flag and exit 2: argparse's usage block would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@attrs.frozen
class Arg:
    """One argument: what `add_argument` takes, as data."""

    names: tuple[str, ...]
    options: Mapping[str, Any]


def arg(*names: str, **options: Any) -> Arg:
    return Arg(names, options)


@attrs.frozen
class SettingFlag:
    """A decode-node setting's flag, as the core describes it (`hicache.core.settings`), with
    other wording for this command's --help where `help` is given."""

    name: str
    help: str | None = None


@attrs.frozen
class CacheFlags:
    """Every cache, storage, transfer and estimate flag of a decode node (`cache_flags.add_flags`)."""


@attrs.frozen
class Group:
    """Arguments listed under a title in --help."""

    title: str
    args: tuple[Spec, ...]


@attrs.frozen
class OneOf:
    """Arguments of which exactly one (`required`) or at most one may be given."""

    args: tuple[Arg, ...]
    required: bool = False


Spec = Arg | SettingFlag | CacheFlags | Group | OneOf


@attrs.frozen
class Command:
    """A subcommand: its help, its arguments and what runs it; or a group of subcommands, whose
    chosen name goes to `dest`."""

    name: str
    help: str | None = None
    description: str | None = None
    args: tuple[Spec, ...] = ()
    run: Run | None = None
    dest: str | None = None
    subcommands: tuple[Command, ...] = ()


def build_parser(root: Command) -> argparse.ArgumentParser:
    """The parser of `root` and all its subcommands; each leaf sets `handler` to its `run`."""
    parser = Parser(prog=root.name, description=root.description)
    _fill(parser, root)
    return parser


def _fill(parser: argparse.ArgumentParser, command: Command) -> None:
    for spec in command.args:
        _add(parser, spec)
    if command.run is not None:
        parser.set_defaults(handler=command.run)
    if command.subcommands:
        sub = parser.add_subparsers(dest=command.dest, required=True)
        for c in command.subcommands:
            _fill(sub.add_parser(c.name, help=c.help, description=c.description), c)


def _add(container: argparse._ActionsContainer, spec: Spec) -> None:
    if isinstance(spec, Arg):
        container.add_argument(*spec.names, **spec.options)
    elif isinstance(spec, SettingFlag):
        cache_flags.flag(spec.name).add_to(container, help=spec.help)
    elif isinstance(spec, CacheFlags):
        assert isinstance(container, argparse.ArgumentParser)  # it makes groups of its own
        cache_flags.add_flags(container)
    elif isinstance(spec, Group):
        group = container.add_argument_group(spec.title)
        for inner in spec.args:
            _add(group, inner)
    else:
        exclusive = container.add_mutually_exclusive_group(required=spec.required)
        for inner in spec.args:
            _add(exclusive, inner)
