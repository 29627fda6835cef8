"""The simulator's discrete-event loop: timed callbacks with deterministic ties.

Events at the same time run in the order they were scheduled, so a run depends only on its
inputs and seed. The heap holds plain floats, one per distinct pending time: comparing floats is
several times cheaper than comparing `(time, sequence, ...)` tuples, and heap comparisons are a
large share of the loop's own cost. A dict maps each pending time to the first event scheduled
for it; later events at the same time (ties: rare with random times, but they occur in the
simulator) wait in a list beside it, in scheduling order.

`call_at` / `call_after` schedule without a handle (the cheap path); `at` / `after` return an
`EventHandle` whose `cancel()` marks the event dead in O(1); dead events are skipped when they
surface rather than searched for.

CPython 3.11 specializes a function's bytecode once it is warm, counting calls and plain
`JUMP_BACKWARD`s but not the conditional jump that closes a `while cond:` loop. `run` is usually
called once per simulation, so its loops are `while True` with explicit breaks: otherwise the
whole run would execute unspecialized bytecode.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

from hicache.sim.event_handle import EventHandle

_INF = float("inf")
_COLLECT_EVERY = 1 << 20  # events between young collections while the collector is paused


class EventLoop:
    """Runs callbacks in time order; `now` is the current simulated time in seconds.

    `events_run` counts the callbacks run (cancelled events are not counted).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.events_run = 0
        self._times: list[float] = []  # heap of the distinct pending times
        self._first: dict[float, Any] = {}  # time -> the first entry scheduled for it
        self._ties: dict[float, list[Any]] = {}  # time -> the entries scheduled after the first

    # ------------------------------------------------------------------ scheduling

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` at simulated time `when` (not before now); it cannot be cancelled."""
        if not when >= self.now:  # also refuses NaN
            raise ValueError(f"cannot schedule at {when}: the simulation is already at {self.now}")
        entry: object = (fn, args)  # one boxed object: compared by identity below
        if self._first.setdefault(when, entry) is entry:
            heappush(self._times, when)
        else:
            self._tie(when, entry)

    def call_after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` `delay` seconds from now; it cannot be cancelled.

        The hottest call of a simulation, hence written out rather than through `call_at`.
        """
        if not delay >= 0:
            raise ValueError(f"cannot schedule {delay} s in the past")
        when = self.now + delay
        entry: object = (fn, args)  # one boxed object: compared by identity below
        if self._first.setdefault(when, entry) is entry:
            heappush(self._times, when)
        else:
            self._tie(when, entry)

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> EventHandle:
        """Run `fn(*args)` at simulated time `when` (not before now); the handle can cancel it."""
        if not when >= self.now:
            raise ValueError(f"cannot schedule at {when}: the simulation is already at {self.now}")
        handle = EventHandle((fn, args))
        if self._first.setdefault(when, handle) is handle:
            heappush(self._times, when)
        else:
            self._tie(when, handle)
        return handle

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> EventHandle:
        """Run `fn(*args)` `delay` seconds from now; the handle can cancel it."""
        if not delay >= 0:
            raise ValueError(f"cannot schedule {delay} s in the past")
        when = self.now + delay
        handle = EventHandle((fn, args))
        if self._first.setdefault(when, handle) is handle:
            heappush(self._times, when)
        else:
            self._tie(when, handle)
        return handle

    def _tie(self, when: float, entry: Any) -> None:
        ties = self._ties.get(when)
        if ties is None:
            self._ties[when] = [entry]
        else:
            ties.append(entry)

    @property
    def pending(self) -> int:
        """Scheduled events, including cancelled ones not yet skipped."""
        return len(self._times) + sum(map(len, self._ties.values()))

    # ------------------------------------------------------------------ running

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left, or until the next one is after `until`
        (then `now` becomes `until`).

        The cyclic garbage collector is paused meanwhile: a replay makes next to no reference
        cycles (7 objects in the whole Mooncake conversation trace), while the collector's
        passes over the growing heap of tree nodes and keys cost a tenth of the run. A young
        collection every `_COLLECT_EVERY` events still frees whatever cycles a callback makes
        (an exception's traceback, say), so memory stays what refcounting keeps."""
        paused = gc.isenabled()
        gc.disable()
        try:
            self._run(until)
        finally:
            if paused:
                if not gc.get_freeze_count():
                    # What the run made and kept (its trees) is long-lived: move it to the
                    # oldest generation unscanned, rather than have the first collection after
                    # the run walk all of it as young. Cycles among it are still collected,
                    # by the next full collection.
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()

    def _run(self, until: float | None) -> None:
        times = self._times
        first = self._first
        ties = self._ties
        pop = heappop
        limit = _INF if until is None else until
        while True:
            if not times:
                break
            when = pop(times)
            if when > limit:
                heappush(times, when)  # cheaper once per run than peeking at every event
                self.now = limit
                return
            fn, args = first.pop(when)
            if ties and when in ties:
                self._run_tied(when, fn, args, ties.pop(when))
                continue
            if fn is not None:
                self.now = when
                self.events_run += 1
                if not self.events_run % _COLLECT_EVERY:
                    gc.collect(1)
                # `fn()` is a plain call, which 3.11 runs without re-entering the C evaluator
                if args:
                    fn(*args)
                else:
                    fn()
        if until is None:
            return
        if until > self.now:
            self.now = until

    def _run_tied(
        self, when: float, fn: Callable[..., Any] | None, args: tuple[Any, ...], rest: list[Any]
    ) -> None:
        """Run the events due at `when`: `fn(*args)` (the first scheduled), then `rest` in order.

        Events these callbacks schedule at `when` run after all of them (a new group). If one
        raises, the events of the group not yet run are put back ahead of that new group, so a
        later `run` goes on with them in order, as if they had never been taken out.
        """
        if fn is not None:
            self.now = when
            self.events_run += 1
            try:
                fn(*args)
            except BaseException:
                self._requeue(when, rest)
                raise
        for i, (fn, args) in enumerate(rest):
            if fn is None:
                continue
            self.now = when
            self.events_run += 1
            try:
                fn(*args)
            except BaseException:
                self._requeue(when, rest[i + 1 :])
                raise

    def _requeue(self, when: float, entries: list[Any]) -> None:
        """Put `entries` back as the first events due at `when`, ahead of any scheduled since."""
        if not entries:
            return
        later = self._first.pop(when, None)
        if later is None:
            heappush(self._times, when)
        else:
            entries = [*entries, later, *self._ties.pop(when, ())]
        self._first[when] = entries[0]
        if len(entries) > 1:
            self._ties[when] = entries[1:]
