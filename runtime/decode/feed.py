"""The decode node's one feed to its core: every part hands its events here, and nothing else
calls the core's `handle`.

It wraps the core's `Dispatcher` (which executes each command through the service's table) and
drives its ticks: the first event since the last tick asks for one a tick interval later, and
`Dispatcher.tick` feeds it only when the core has work for it (an idle tick changes nothing but
the core's clock, which the next event moves anyway). A refused event changes nothing in the
core, so it is logged and dropped: what a peer's late or doubled answer makes the node feed never
stops it. A TP rank diverts all but its decode steps' events to its rounds
(`hicache.runtime.tp.tp_rounds`), which feed them in step with the other ranks through
`put_now`.
"""

from __future__ import annotations

import logging
from typing import Protocol

import attrs
import trio

from hicache.core import events as ev
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.dispatch import Dispatcher, Handlers
from hicache.core.errors import CoreError

log = logging.getLogger("hicache.runtime.decode")


class Divert(Protocol):
    """Where a TP rank's events wait for the next round (`Rounds`)."""

    now: float  # the current round's time: a decode step's events carry it

    def feed(self, event: ev.Event) -> bool:
        """Take `event` for the next round; False if it is to be fed at once."""
        ...


class Feed:
    """Feeds `core` and executes its commands through the table given to `attach`."""

    def __init__(self, core: DecodeNodeCore, *, tick_interval: float) -> None:
        self.core = core
        self.tick_interval = tick_interval
        self.dispatch: Dispatcher | None = None
        self.divert: Divert | None = None  # a TP rank's rounds
        self.refused_events = 0  # events the core refused (logged and dropped; the node went on)
        self._tick_due = trio.Event()
        self._fed = trio.Event()  # set (and replaced) after every event fed

    def attach(self, handlers: Handlers, executor: str) -> Dispatcher:
        """Execute the core's commands through `handlers` (checked to cover every command)."""
        self.dispatch = Dispatcher(self.core, handlers, executor)
        return self.dispatch

    @property
    def events(self) -> int:
        """Events fed to the core so far (a skipped idle tick is none)."""
        return self.dispatch.events if self.dispatch is not None else 0

    @staticmethod
    def now() -> float:
        return trio.current_time()

    def put(self, event: ev.Event, *, refuse: bool = False) -> None:
        """Feed `event` (a TP rank: in its next round, but for a decode step's). With `refuse`
        a refused event raises its `CoreError` (an arrival's caller answers it instead)."""
        if self.divert is not None:
            if self.divert.feed(event):
                return
            event = attrs.evolve(event, at=self.divert.now)  # a decode step's: the round's time
        self.put_now(event, refuse=refuse)

    def put_now(self, event: ev.Event, *, refuse: bool = False) -> None:
        """Feed `event` to the core at once (what a TP round feeds)."""
        assert self.dispatch is not None, "Feed.attach first"
        try:
            tick = self.dispatch.feed(event)
        except CoreError as exc:
            if refuse:
                raise
            log.error("the core refused %s: %s", type(event).__name__, exc)
            self.refused_events += 1
            return
        finally:
            self._fed.set()
            self._fed = trio.Event()
        if tick and self.divert is None:
            self._tick_due.set()

    async def next_event(self) -> None:
        """Return once the next event has been fed."""
        await self._fed.wait()

    async def run_ticks(self) -> None:
        """A single rank's ticks: one a tick interval after the first event since the last."""
        assert self.dispatch is not None, "Feed.attach first"
        while True:
            await self._tick_due.wait()
            self._tick_due = trio.Event()
            await trio.sleep(self.tick_interval)
            self.tick_now(self.now())

    def tick_now(self, at: float) -> None:
        """The due tick at `at`, through the dispatcher: skipped when the core has no work for
        it (a TP round calls this every round, and every rank skips alike: their cores agree)."""
        assert self.dispatch is not None, "Feed.attach first"
        try:
            self.dispatch.tick(at)
        except CoreError as exc:
            log.error("the core refused Tick: %s", exc)
            self.refused_events += 1
        finally:
            self._fed.set()
            self._fed = trio.Event()
