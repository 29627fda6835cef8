"""The front door's admission: at most `max_running` requests at the decode nodes, at most
`max_queued` more waiting here in arrival order, and a 503 with `Retry-After` at once for the
next one, rather than accepting work that would only wait (SGLang's `--max-running-requests`
and `--max-queued-requests`).

`Slots` holds the decisions as plain state (property-tested); `Admission` drives it from trio
tasks: a queued request waits on an event, and a slot that frees passes straight to the head of
the queue, so a request never overtakes one that came before it.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import attrs
import trio

from hicache.runtime.serving.errors import ApiError

Decision = Literal["run", "queued", "refused"]
RETRY_AFTER_MAX_S = 60
_EWMA = 0.2  # weight of the newest request's duration in the mean a Retry-After is guessed from


class Overloaded(ApiError):
    """The queue is full: a 503 that tells the client when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(503, message, type="server_error", code="overloaded")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}


@attrs.define
class Slots:
    """Who runs and who waits. Invariants: `running <= max_running`, `len(queue) <= max_queued`,
    and a request waits only while every slot is taken."""

    max_running: int
    max_queued: int
    running: int = 0
    queue: collections.deque[int] = attrs.field(factory=collections.deque)

    def __attrs_post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0:
            raise ValueError(
                f"admission: expected max_running >= 1 and max_queued >= 0, "
                f"got {self.max_running} and {self.max_queued}"
            )

    def arrive(self, ticket: int) -> Decision:
        if self.running < self.max_running and not self.queue:
            self.running += 1
            return "run"
        if len(self.queue) >= self.max_queued:
            return "refused"
        self.queue.append(ticket)
        return "queued"

    def leave(self) -> int | None:
        """A running request ended: its slot goes to the head of the queue (returned), if any."""
        if self.running < 1:
            raise ValueError("admission: a request left that was not running")
        if self.queue:
            return self.queue.popleft()  # the slot passes on: `running` stays
        self.running -= 1
        return None

    def withdraw(self, ticket: int) -> bool:
        """A queued request gave up (its client left); False if it was not queued."""
        try:
            self.queue.remove(ticket)
        except ValueError:
            return False
        return True


class Admission:
    """`async with admission.slot():` around the work of one request at the decode nodes."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.slots = Slots(max_running, max_queued)
        self._events: dict[int, trio.Event] = {}
        self._next = 0
        self.mean_run_s = 1.0  # a first guess, replaced by what requests take
        self.refused = 0

    @property
    def max_running(self) -> int:
        return self.slots.max_running

    @property
    def max_queued(self) -> int:
        return self.slots.max_queued

    @property
    def running(self) -> int:
        return self.slots.running

    @property
    def queued(self) -> int:
        return len(self.slots.queue)

    def retry_after_s(self) -> int:
        """About when a slot frees for a newcomer: the queue ahead drains `max_running` at a time."""
        rounds = (self.queued + 1) / self.max_running
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(rounds * self.mean_run_s)))

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a slot for the block; yields the seconds spent queued. Raises `Overloaded` at
        once when the queue is full; a request cancelled while queued leaves the queue."""
        ticket = self._next
        self._next += 1
        arrived = time.monotonic()
        decision = self.slots.arrive(ticket)
        if decision == "refused":
            self.refused += 1
            raise Overloaded(
                f"the server is full: {self.running} requests running and {self.queued} queued "
                "(--max-running-requests, --max-queued-requests); retry later",
                self.retry_after_s(),
            )
        if decision == "queued":
            event = self._events[ticket] = trio.Event()
            try:
                await event.wait()
            except BaseException:
                if not self.slots.withdraw(ticket):  # the slot was handed over as it was cancelled
                    self._release()
                raise
            finally:
                self._events.pop(ticket, None)
        started = time.monotonic()
        try:
            yield started - arrived
        finally:
            ran = time.monotonic() - started
            self.mean_run_s += _EWMA * (ran - self.mean_run_s)
            self._release()

    def _release(self) -> None:
        ticket = self.slots.leave()
        if ticket is not None:
            self._events[ticket].set()
