"""The simulator's event loop: order, ties, cancellation, and an M/M/1 queue against the
closed form."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

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
