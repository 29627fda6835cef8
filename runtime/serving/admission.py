"""The front door's admission: at most `max_running` requests at the decode nodes, holding at
most `max_tokens` of their L1 (a request counts its prompt and the output a node reserves for
it at admission), at most `max_queued` more waiting here in arrival order, and a 503 with
`Retry-After` at once for the next one, rather than accepting work that would only wait
(SGLang's `--max-running-requests` and `--max-queued-requests`).

`Slots` (`hicache.core.door_slots`, which the simulator's front door uses too) holds the
decisions as plain state (property-tested); `Admission` drives it from trio
tasks: a queued request waits on an event, and a slot that frees passes straight to the head of
the queue, so a request never overtakes one that came before it.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from hicache.core.door_slots import Slots
from hicache.runtime.serving.errors import ApiError

RETRY_AFTER_MAX_S = 60
_EWMA = 0.2  # weight of the newest request's duration in the mean a Retry-After is guessed from


class Overloaded(ApiError):
    """The queue is full: a 503 that tells the client when to try again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(503, message, type="server_error", code="overloaded")
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(retry_after_s)}


class Admission:
    """`async with admission.slot():` around the work of one request at the decode nodes."""

    def __init__(
        self,
        max_running: int,
        max_queued: int,
        max_tokens: int = 0,
        reserve_tokens: int = 0,
        *,
        queue_timeout_s: float | None = None,
    ) -> None:
        """`reserve_tokens`: the output tokens a decode node reserves for a request as it admits
        it (its `--decode-reserve-tokens`); a request counts its prompt and up to that much.
        `queue_timeout_s`: a request queued that long leaves with a 503 and Retry-After (None:
        it waits as long as it takes)."""
        if queue_timeout_s is not None and not queue_timeout_s > 0:
            raise ValueError(f"admission: expected queue_timeout_s > 0, got {queue_timeout_s!r}")
        self.slots = Slots(max_running, max_queued, max_tokens)
        self.reserve_tokens = reserve_tokens
        self.queue_timeout_s = queue_timeout_s
        self.timed_out = 0
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
    def tokens(self) -> int:
        return self.slots.tokens

    @property
    def max_tokens(self) -> int:
        return self.slots.max_tokens

    @property
    def queued(self) -> int:
        return len(self.slots.queue)

    def need(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The L1 tokens a request takes at a decode node's admission."""
        return prompt_tokens + min(max_new_tokens, self.reserve_tokens)

    def retry_after_s(self) -> int:
        """About when a slot frees for a newcomer: the queue ahead drains `max_running` at a time."""
        rounds = (self.queued + 1) / self.max_running
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(rounds * self.mean_run_s)))

    @asynccontextmanager
    async def slot(self, tokens: int = 0) -> AsyncIterator[float]:
        """Hold a slot and `tokens` of L1 for the block; yields the seconds spent queued.
        Raises `Overloaded` at once when the queue is full; a request cancelled while queued
        leaves the queue."""
        ticket = self._next
        self._next += 1
        arrived = time.monotonic()
        decision = self.slots.arrive(ticket, tokens)
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
                with trio.move_on_after(self.queue_timeout_s if self.queue_timeout_s else math.inf):
                    await event.wait()
                if not event.is_set():  # still queued: it leaves, and those behind may start
                    self._wake(self.slots.withdraw(ticket) or [])
                    self.timed_out += 1
                    late = Overloaded(
                        f"the request waited {self.queue_timeout_s:g} s in the queue without a slot "
                        f"(--queue-timeout): {self.running} requests running, {self.queued} queued; "
                        "retry later",
                        self.retry_after_s(),
                    )
                    late.code = "queue_timeout"
                    raise late
            except Overloaded:
                raise
            except BaseException:
                started = self.slots.withdraw(ticket)
                if started is None:  # it was started as it was cancelled: give its slot back
                    self._release(ticket)
                else:
                    self._wake(started)
                raise
            finally:
                self._events.pop(ticket, None)
        started = time.monotonic()
        try:
            yield started - arrived
        finally:
            ran = time.monotonic() - started
            self.mean_run_s += _EWMA * (ran - self.mean_run_s)
            self._release(ticket)

    def _release(self, ticket: int) -> None:
        self._wake(self.slots.leave(ticket))

    def _wake(self, tickets: list[int]) -> None:
        for ticket in tickets:
            self._events[ticket].set()
