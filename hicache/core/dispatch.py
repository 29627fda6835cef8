"""One dispatch shape for every executor of the core's commands, written once.

A driver (the simulator, the runtime, a test world) hands a `Dispatcher` a table from command
type to handler; the table must cover every member of the `Command` union, checked when the
dispatcher is built, so a new command cannot be missed without a word. The dispatcher also
coalesces ticks: after any event but a `Tick`, one tick is due, and the driver is told to
schedule it only once until it runs; `tick` feeds it only when the core has work for it.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from typing import Any

from hicache.core import events as ev
from hicache.core.commands import Command
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError

COMMAND_TYPES: tuple[type, ...] = typing.get_args(Command)

Handlers = Mapping[type, Callable[[Any], None]]


class MissingHandler(CoreError):
    """An executor's table lacks a command type, or names something that is not a command."""


def check_handlers(handlers: Handlers, executor: str) -> None:
    """Raise `MissingHandler` naming the executor and every command type it cannot execute."""
    missing = [t.__name__ for t in COMMAND_TYPES if t not in handlers]
    extra = [getattr(t, "__name__", repr(t)) for t in handlers if t not in COMMAND_TYPES]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no handler for {', '.join(missing)}")
        if extra:
            parts.append(f"handlers for non-commands {', '.join(extra)}")
        raise MissingHandler(f"{executor}: {'; '.join(parts)}")


class Dispatcher:
    """Feeds one core and executes the commands it returns, in order, through a table."""

    def __init__(self, core: DecodeNodeCore, handlers: Handlers, executor: str) -> None:
        check_handlers(handlers, executor)
        self.core = core
        self.handlers = dict(handlers)
        self.executor = executor
        self.tick_due = False  # a Tick has been asked for and has not run yet
        self.events = 0

    def feed(self, event: ev.Event) -> bool:
        """Apply `event` and execute its commands. True when the caller must now schedule one
        `Tick` (the first event since the last tick); False when one is due already."""
        self.events += 1
        is_tick = event.__class__ is ev.Tick
        if is_tick:
            self.tick_due = False  # events fed while it runs ask for the next one
        for c in self.core.handle(event):
            self.handlers[type(c)](c)
        if is_tick or self.tick_due:
            return False
        self.tick_due = True
        return True

    def tick(self, at: float) -> None:
        """The tick asked for by `feed` is due at `at`: feed it if the core has work for it
        (`DecodeNodeCore.wants_tick`), else only note that it ran. A skipped tick would change
        nothing but the core's clock, which the next event moves anyway, so the core's
        decisions are the same either way; most ticks of a long replay are idle."""
        if self.core.wants_tick:
            self.feed(ev.Tick(at))
        else:
            self.tick_due = False
