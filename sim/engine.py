"""The simulator's discrete-event loop: a heap of timed callbacks with deterministic ties.

Events at the same time run in the order they were scheduled (a sequence number breaks ties),
so a run depends only on its inputs and seed. Cancelling marks an event dead instead of
searching the heap; dead events are skipped when they surface.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventHandle:
    """A scheduled callback; `cancel()` keeps it from running."""

    __slots__ = ("at", "fn", "args", "cancelled")

    def __init__(self, at: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.at = at
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Runs callbacks in time order; `now` is the current simulated time in seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.events_run = 0
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> EventHandle:
        """Run `fn(*args)` at simulated time `when` (not before now)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when}: the simulation is already at {self.now}")
        handle = EventHandle(when, fn, args)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        return handle

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> EventHandle:
        """Run `fn(*args)` `delay` seconds from now."""
        if delay < 0:
            raise ValueError(f"cannot schedule {delay} s in the past")
        # The hottest call of a simulation: push here rather than through `at` (one call less).
        when = self.now + delay
        handle = EventHandle(when, fn, args)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        return handle

    @property
    def pending(self) -> int:
        """Scheduled events, including cancelled ones not yet skipped."""
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left, or until the next one is after `until`
        (then `now` becomes `until`)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            when, _, handle = heap[0]
            if until is not None and when > until:
                self.now = until
                return
            pop(heap)
            if handle.cancelled:
                continue
            self.now = when
            self.events_run += 1
            handle.fn(*handle.args)
        if until is not None and until > self.now:
            self.now = until
