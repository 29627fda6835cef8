"""The simulator's event loop: order, ties, cancellation, and an M/M/1 queue against the
closed form."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from typing import Any

import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.sim.engine import EventLoop


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for name, when in [("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 1.0)]:
        loop.at(when, lambda n=name: seen.append((loop.now, n)))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (1.0, "d"), (2.0, "c")]
    assert loop.events_run == 4 and loop.pending == 0


def test_callbacks_can_schedule_and_cancel() -> None:
    loop = EventLoop()
    seen: list[str] = []
    late = loop.at(5.0, seen.append, "late")

    def first() -> None:
        seen.append("first")
        loop.after(0.5, seen.append, "chained")
        late.cancel()

    loop.at(1.0, first)
    loop.run()
    assert seen == ["first", "chained"]
    assert loop.now == 1.5 and loop.events_run == 2


def test_run_until_stops_before_later_events() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, seen.append, t)
    loop.run(until=2.5)
    assert seen == [1.0, 2.0] and loop.now == 2.5
    loop.run()
    assert seen == [1.0, 2.0, 3.0]


def test_scheduling_in_the_past_is_refused() -> None:
    loop = EventLoop(start=3.0)
    with pytest.raises(ValueError, match="already at 3.0"):
        loop.at(2.0, print)
    with pytest.raises(ValueError, match="in the past"):
        loop.after(-1.0, print)


def mm1_mean_wait(lam: float, mu: float, customers: int, seed: int) -> float:
    """Mean time in queue (before service) of an M/M/1 queue simulated on the loop."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / lam, customers)
    services = rng.exponential(1 / mu, customers)
    loop = EventLoop()
    queue: deque[tuple[int, float]] = deque()
    busy = False
    waits: list[float] = []

    def start(i: int, arrived: float) -> None:
        nonlocal busy
        busy = True
        waits.append(loop.now - arrived)
        loop.after(services[i], done)

    def done() -> None:
        nonlocal busy
        busy = False
        if queue:
            start(*queue.popleft())

    def arrive(i: int) -> None:
        if busy:
            queue.append((i, loop.now))
        else:
            start(i, loop.now)
        if i + 1 < customers:
            loop.after(gaps[i + 1], arrive, i + 1)

    loop.at(gaps[0], arrive, 0)
    loop.run()
    return float(np.mean(waits))


def test_mm1_mean_wait_matches_the_closed_form() -> None:
    lam, mu = 0.5, 1.0
    expected = lam / (mu * (mu - lam))  # Wq = rho / (mu - lam)
    got = mm1_mean_wait(lam, mu, 200_000, seed=1)
    assert abs(got - expected) / expected < 0.03, (got, expected)


def test_same_seed_same_run() -> None:
    assert mm1_mean_wait(0.7, 1.0, 5_000, seed=3) == mm1_mean_wait(0.7, 1.0, 5_000, seed=3)


# ---------------------------------------------------------------------------------------------
# Ties, cancellation and errors, against a reference loop


def test_events_scheduled_at_now_run_after_everything_already_due_now() -> None:
    loop = EventLoop()
    seen: list[str] = []

    def a() -> None:
        seen.append("a")
        loop.call_after(0.0, seen.append, "a+0")
        loop.at(loop.now, seen.append, "a@now")

    loop.at(1.0, a)
    loop.call_at(1.0, seen.append, "b")
    loop.after(1.0, seen.append, "c")
    loop.call_at(2.0, seen.append, "d")
    loop.run()
    assert seen == ["a", "b", "c", "a+0", "a@now", "d"]
    assert loop.events_run == 6 and loop.pending == 0 and loop.now == 2.0


def test_a_tied_event_can_cancel_one_due_at_the_same_time() -> None:
    loop = EventLoop()
    seen: list[str] = []
    a = loop.at(1.0, seen.append, "a")  # due first at 1.0, cancelled earlier
    loop.at(0.5, a.cancel)
    b = loop.at(1.0, seen.append, "b")
    loop.at(1.0, lambda: (seen.append("c"), d.cancel()))
    d = loop.at(1.0, seen.append, "d")
    assert loop.pending == 5
    loop.run()
    assert seen == ["b", "c"] and a.cancelled and not b.cancelled and d.cancelled
    assert loop.events_run == 3 and loop.pending == 0 and loop.now == 1.0


def test_cancelled_events_do_not_move_time_or_count() -> None:
    loop = EventLoop()
    loop.at(3.0, print).cancel()
    loop.after(4.0, print).cancel()
    loop.run()
    assert loop.now == 0.0 and loop.events_run == 0 and loop.pending == 0
    loop.at(5.0, print).cancel()
    loop.run(until=4.0)  # the cancelled event lies after `until`: it stays pending
    assert loop.now == 4.0 and loop.pending == 1


def test_an_error_in_a_tie_leaves_the_rest_due_in_order() -> None:
    loop = EventLoop()
    seen: list[str] = []

    def boom() -> None:
        seen.append("boom")
        loop.call_at(loop.now, seen.append, "new")
        raise RuntimeError("boom")

    loop.call_at(1.0, seen.append, "a")
    loop.call_at(1.0, boom)
    loop.call_at(1.0, seen.append, "c")
    loop.call_at(2.0, seen.append, "d")
    with pytest.raises(RuntimeError, match="boom"):
        loop.run()
    assert seen == ["a", "boom"] and loop.events_run == 2 and loop.pending == 3
    loop.run()
    assert seen == ["a", "boom", "c", "new", "d"] and loop.events_run == 5


def test_nan_times_are_refused() -> None:
    loop = EventLoop()
    nan = float("nan")
    for schedule in (loop.at, loop.call_at):
        with pytest.raises(ValueError, match="cannot schedule at nan"):
            schedule(nan, print)
    for schedule in (loop.after, loop.call_after):
        with pytest.raises(ValueError, match="in the past"):
            schedule(nan, print)
        with pytest.raises(ValueError, match="in the past"):
            schedule(-1.0, print)
    assert loop.pending == 0


class ReferenceLoop:
    """The semantics `EventLoop` must keep, written the obvious way: a heap of
    `(time, sequence, handle)` entries, cancelled handles skipped when they surface."""

    class Handle:
        def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
            self.fn, self.args, self.cancelled = fn, args, False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, ReferenceLoop.Handle]] = []
        self._seq = itertools.count()

    def at(self, when: float, fn: Any, *args: Any) -> ReferenceLoop.Handle:
        if when < self.now:
            raise ValueError(when)
        handle = self.Handle(fn, args)
        heapq.heappush(self._heap, (when, next(self._seq), handle))
        return handle

    def after(self, delay: float, fn: Any, *args: Any) -> ReferenceLoop.Handle:
        return self.at(self.now + delay, fn, *args)

    call_at = at
    call_after = after

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        while self._heap:
            when, _, handle = self._heap[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(self._heap)
            if handle.cancelled:
                continue
            self.now = when
            self.events_run += 1
            handle.fn(*handle.args)
        if until is not None and until > self.now:
            self.now = until


class Boom(Exception):
    pass


DELAYS = (0.0, 0.0, 0.25, 0.5, 1.0)  # few distinct times, so ties are common
METHODS = ("at", "after", "call_at", "call_after")

op = st.one_of(
    st.tuples(st.just("schedule"), st.sampled_from(METHODS), st.integers(0, len(DELAYS) - 1)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("raise")),
)


def replay(loop: Any, first: list[tuple[str, int]], scripts: list[list[tuple]], untils: list) -> list:
    """Schedule `first`, then run to each of `untils` in turn; event `i` performs `scripts[i]`.
    Returns everything observable: which event ran when, and the loop's state after each run."""
    trace: list[Any] = []
    handles: dict[int, Any] = {}
    ids = itertools.count()

    def schedule(method: str, delay: float) -> None:
        i = next(ids)
        if method in ("at", "call_at"):
            handle = getattr(loop, method)(loop.now + delay, fire, i)
        else:
            handle = getattr(loop, method)(delay, fire, i)
        if method in ("at", "after"):  # the handle-free methods return none to cancel
            handles[i] = handle

    def fire(i: int) -> None:
        trace.append(("ran", i, loop.now))
        for step in scripts[i] if i < len(scripts) else ():
            if step[0] == "schedule":
                schedule(step[1], DELAYS[step[2]])
            elif step[0] == "cancel" and step[1] in handles:
                handles[step[1]].cancel()
            elif step[0] == "raise":
                raise Boom(i)

    for method, d in first:
        schedule(method, DELAYS[d])
    for until in untils:
        while True:
            try:
                loop.run(until)
                break
            except Boom as e:
                trace.append(("raised", e.args[0]))
        trace.append(("stopped", loop.now, loop.events_run, loop.pending))
    return trace


@settings(max_examples=examples(300), deadline=None)
@given(
    first=st.lists(
        st.tuples(st.sampled_from(METHODS), st.integers(0, len(DELAYS) - 1)), min_size=1, max_size=8
    ),
    scripts=st.lists(st.lists(op, max_size=4), max_size=40),
    untils=st.lists(
        st.one_of(st.none(), st.sampled_from([0.0, 0.25, 0.6, 1.0, 1.5, 3.0])), min_size=1, max_size=4
    ),
)
def test_the_loop_runs_what_a_sequence_numbered_heap_would(
    first: list[tuple[str, int]], scripts: list[list[tuple]], untils: list
) -> None:
    # `until` only moves forward here, as a simulation uses it (then time never goes back).
    untils = sorted(untils, key=lambda u: math.inf if u is None else u)
    assert replay(EventLoop(), first, scripts, untils) == replay(ReferenceLoop(), first, scripts, untils)
