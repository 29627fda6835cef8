"""Benchmark the simulator's event loop against SimPy 4 on two shared models (a script, not a test).

Usage: python bench/engine_bench.py [--quick] [--repeat 3] [--json PATH]
                                    [--procs 1000] [--horizon 1010] [--customers 200000] [--seed 1]

Each model is written the way its engine is meant to be used -- SimPy with generator processes and
a `Resource`, ours with callbacks scheduled by `call_after` (the handle-free call the simulator uses
wherever it never cancels) -- and both engines see the same random numbers in the same order, so
they must produce the same results, which the script checks:

1. Timeouts: `--procs` processes each wait Exp(1) timeouts in a loop until `--horizon`.
2. M/M/8 at rho = 0.9 (lambda = 7.2, mu = 1): `--customers` customers; the mean wait in queue of
   both engines is compared with each other and with the Erlang-C closed form.

An event is one scheduled callback run by our loop (`EventLoop.events_run`) or one event processed
by SimPy (one `Environment.step()`; the run loop below is SimPy's own `run` plus a counter). Wall
and CPU seconds cover building the model and running it; the M/M/8 arrival and service times are
drawn before timing. After one small untimed pass through everything, repetitions alternate the
engines so background load hits both alike; the best of `--repeat` is reported.

Model 1 also times two references that are no engine at all, to show where the ceiling of an event
loop written in Python lies: the "pure-Python heap floor" runs the same timeouts as one inlined loop
over a heap of float times (pop the earliest, draw, push the next: no callbacks, no tie order, no
cancellation, no map from a time to what is due then); the "callback floor" adds only what a
callback API costs -- each timeout is a Python function that calls a scheduling function, which
pushes its time. Both must fire the same timeouts from the same draws.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from heapq import heappop, heappush
from pathlib import Path
from typing import Any

import attrs
import numpy as np

try:
    import simpy
    from simpy.core import EmptySchedule, StopSimulation
    from simpy.events import URGENT, Event
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise SystemExit(
        f"SimPy is needed for this benchmark ({exc}); install the extra: pip install -e .[bench]"
    ) from None

from hicache.sim.engine import EventLoop

SERVERS = 8
ARRIVAL_RATE = 7.2
SERVICE_RATE = 1.0
DRAW_CHUNK = 1 << 12
ENGINES = ("ours", "simpy")


@attrs.frozen
class Run:
    """One timed run of one model on one engine."""

    events: int  # callbacks run (ours) or SimPy events processed
    work: int  # model-level units: timeouts fired, or customers served
    wall_s: float
    cpu_s: float
    result: Any  # what must agree between engines: draws consumed, or per-customer waits


# ---------------------------------------------------------------------------------------------
# Shared random streams


def exp_stream(seed: int, mean: float) -> Iterator[float]:
    """Exponential draws with `mean`, in a fixed order for a seed, as Python floats.

    Drawn by numpy in chunks so a draw costs one `next()`; both engines call it in event order,
    which is the same in both (time order, FIFO among ties).
    """
    rng = np.random.default_rng(seed)
    while True:
        yield from rng.exponential(mean, DRAW_CHUNK).tolist()


def draws_before(seed: int, mean: float, value: float, limit: int) -> int:
    """Position of `value` in `exp_stream(seed, mean)`: how many draws came before it."""
    rng = np.random.default_rng(seed)
    for start in range(0, limit, DRAW_CHUNK):
        hits = np.flatnonzero(rng.exponential(mean, DRAW_CHUNK) == value)
        if hits.size:
            return start + int(hits[0])
    raise RuntimeError(f"draw {value!r} not found in the first {limit:,} draws of seed {seed}")


def mm_arrivals(customers: int, seed: int) -> tuple[list[float], list[float]]:
    """Inter-arrival gaps and service times of the M/M/8 model, one per customer."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / ARRIVAL_RATE, customers).tolist()
    services = rng.exponential(1 / SERVICE_RATE, customers).tolist()
    return gaps, services


# ---------------------------------------------------------------------------------------------
# Running SimPy with an event count


def simpy_run_counted(env: simpy.Environment, until: float | None = None) -> int:
    """`env.run(until)` that also returns how many events it processed.

    The same loop as SimPy's own `Environment.run` (an URGENT stop event at `until`, then
    `step()` until it raises) with one counter increment per step; the stop event is not counted,
    just as our loop has none.
    """
    if until is not None:
        stop = Event(env)
        stop._ok = True
        stop._value = None
        env.schedule(stop, URGENT, until - env.now)
        stop.callbacks.append(StopSimulation.callback)
    step = env.step
    steps = 0
    try:
        while True:
            step()
            steps += 1
    except (StopSimulation, EmptySchedule):
        pass
    return steps


def timed(build_and_run: Callable[[], tuple[int, int, Any]]) -> Run:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    events, work, result = build_and_run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Run(events=events, work=work, wall_s=wall, cpu_s=cpu, result=result)


# ---------------------------------------------------------------------------------------------
# Model 1: processes looping over exponential timeouts


def timeouts_ours(procs: int, horizon: float, seed: int) -> tuple[int, int, Any]:
    """Each process is a callback that re-schedules itself an Exp(1) delay later."""
    draw = exp_stream(seed, 1.0).__next__
    loop = EventLoop()
    after = loop.call_after

    def wake() -> None:
        after(draw(), wake)

    for _ in range(procs):
        after(draw(), wake)
    loop.run(until=horizon)
    return loop.events_run, loop.events_run, draw()


def timeouts_floor(procs: int, horizon: float, seed: int) -> tuple[int, int, Any]:
    """Model 1 with no engine: one loop pops the earliest time and pushes the next, as floats."""
    draw = exp_stream(seed, 1.0).__next__
    heap: list[float] = []
    for _ in range(procs):
        heappush(heap, draw())
    pop, push = heappop, heappush
    fired = 0
    while True:
        if heap[0] > horizon:
            break
        fired += 1
        push(heap, pop(heap) + draw())
    return fired, fired, draw()


def timeouts_callback_floor(procs: int, horizon: float, seed: int) -> tuple[int, int, Any]:
    """The heap floor with a callback per timeout that calls a scheduling function (which only
    pushes the time: it keeps no callback, so this is a bound, not an engine)."""
    draw = exp_stream(seed, 1.0).__next__
    heap: list[float] = []
    now = 0.0

    def after(delay: float, fn: Callable[..., Any], *args: Any) -> None:
        heappush(heap, now + delay)

    def wake() -> None:
        after(draw(), wake)

    for _ in range(procs):
        after(draw(), wake)
    pop = heappop
    fired = 0
    while True:
        if not heap:
            break
        now = pop(heap)
        if now > horizon:
            break
        fired += 1
        wake()
    return fired, fired, draw()


def timeouts_simpy(procs: int, horizon: float, seed: int) -> tuple[int, int, Any]:
    """Each process is a generator yielding Exp(1) timeouts; SimPy starts each with one event."""
    draw = exp_stream(seed, 1.0).__next__
    env = simpy.Environment()
    timeout = env.timeout

    def process() -> Iterator[simpy.Timeout]:
        while True:
            yield timeout(draw())

    for _ in range(procs):
        env.process(process())
    steps = simpy_run_counted(env, until=horizon)
    return steps, steps - procs, draw()


# ---------------------------------------------------------------------------------------------
# Model 2: M/M/8 queue


def mm_ours(gaps: list[float], services: list[float]) -> tuple[int, int, Any]:
    """Arrivals and departures are callbacks; a deque holds the waiting customers (FIFO)."""
    customers = len(gaps)
    loop = EventLoop()
    after = loop.call_after
    queue: deque[tuple[int, float]] = deque()
    waits = [0.0] * customers
    free = SERVERS

    def arrive(i: int) -> None:
        nonlocal free
        if free:
            free -= 1
            after(services[i], depart)
        else:
            queue.append((i, loop.now))
        if i + 1 < customers:
            after(gaps[i + 1], arrive, i + 1)

    def depart() -> None:
        nonlocal free
        if queue:
            i, arrived = queue.popleft()
            waits[i] = loop.now - arrived
            after(services[i], depart)
        else:
            free += 1

    if customers:
        after(gaps[0], arrive, 0)
    loop.run()
    return loop.events_run, customers, waits


def mm_simpy(gaps: list[float], services: list[float]) -> tuple[int, int, Any]:
    """A source process starts one process per customer, which holds a `Resource` slot."""
    customers = len(gaps)
    env = simpy.Environment()
    servers = simpy.Resource(env, capacity=SERVERS)
    waits = [0.0] * customers

    def customer(i: int) -> Iterator[simpy.Event]:
        arrived = env.now
        with servers.request() as request:
            yield request
            waits[i] = env.now - arrived
            yield env.timeout(services[i])

    def source() -> Iterator[simpy.Event]:
        for i in range(customers):
            yield env.timeout(gaps[i])
            env.process(customer(i))

    env.process(source())
    steps = simpy_run_counted(env)
    return steps, customers, waits


# ---------------------------------------------------------------------------------------------
# Queueing theory


def erlang_c_wait(servers: int, arrival_rate: float, service_rate: float) -> float:
    """Mean wait in queue of M/M/c (Erlang C): P(wait) / (c*mu - lambda)."""
    load = arrival_rate / service_rate
    if load >= servers:
        raise ValueError(f"unstable queue: load {load} >= {servers} servers")
    top = load**servers / math.factorial(servers) * servers / (servers - load)
    p_wait = top / (sum(load**k / math.factorial(k) for k in range(servers)) + top)
    return p_wait / (servers * service_rate - arrival_rate)


def batch_means_halfwidth(values: list[float], batches: int = 20) -> float:
    """Approximate 95% half-width of the mean of a correlated series by non-overlapping batch means."""
    size = len(values) // batches
    if size < 2:
        return math.nan
    means = [math.fsum(values[b * size : (b + 1) * size]) / size for b in range(batches)]
    return 2.093 * statistics.stdev(means) / math.sqrt(batches)  # t(0.975, 19 d.o.f.)


# ---------------------------------------------------------------------------------------------
# Reporting


def engine_figures(runs: list[Run]) -> dict[str, Any]:
    """Rates from the best wall time (and, as a check on background load, the best CPU time)."""
    best = min(runs, key=lambda r: r.wall_s)
    best_cpu = min(r.cpu_s for r in runs)
    return {
        "events": best.events,
        "work_units": best.work,
        "best_wall_s": best.wall_s,
        "best_cpu_s": best_cpu,
        "wall_s": [r.wall_s for r in runs],
        "cpu_s": [r.cpu_s for r in runs],
        "events_per_s": best.events / best.wall_s,
        "work_units_per_s": best.work / best.wall_s,
        "events_per_cpu_s": best.events / best_cpu,
    }


def model_figures(runs: dict[str, list[Run]]) -> dict[str, Any]:
    figures: dict[str, Any] = {engine: engine_figures(runs[engine]) for engine in ENGINES}
    ours, peer = figures["ours"], figures["simpy"]
    figures["ratio_events_per_s"] = ours["events_per_s"] / peer["events_per_s"]
    figures["ratio_work_units_per_s"] = ours["work_units_per_s"] / peer["work_units_per_s"]
    figures["ratio_events_per_cpu_s"] = ours["events_per_cpu_s"] / peer["events_per_cpu_s"]
    return figures


def print_model(title: str, unit: str, figures: dict[str, Any]) -> None:
    print(f"\n{title}")
    header = f"  {'engine':<7} {'events':>11} {unit + 's':>11} {'best wall s':>12} {'best cpu s':>11}"
    header += f" {'events/s':>11} {unit + 's/s':>13}  all wall s"
    print(header)
    for engine in ENGINES:
        f = figures[engine]
        walls = " ".join(f"{w:.3f}" for w in f["wall_s"])
        print(
            f"  {engine:<7} {f['events']:>11,} {f['work_units']:>11,} {f['best_wall_s']:>12.3f} "
            f"{f['best_cpu_s']:>11.3f} {f['events_per_s']:>11,.0f} {f['work_units_per_s']:>13,.0f}  {walls}"
        )
    print(
        f"  ours/SimPy: {figures['ratio_events_per_s']:.2f}x events/s, "
        f"{figures['ratio_work_units_per_s']:.2f}x {unit}s/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models for a smoke run (seconds)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per engine (default 3)")
    parser.add_argument("--procs", type=int, default=None, help="model 1 processes (default 1000)")
    parser.add_argument("--horizon", type=float, default=None, help="model 1 end time (default 1010)")
    parser.add_argument("--customers", type=int, default=None, help="model 2 customers (default 200000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random stream")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)

    small = args.quick
    repeat = args.repeat if args.repeat is not None else (2 if small else 3)
    procs = args.procs if args.procs is not None else (100 if small else 1000)
    horizon = args.horizon if args.horizon is not None else (100.0 if small else 1010.0)
    customers = args.customers if args.customers is not None else (5_000 if small else 200_000)
    if repeat < 1 or procs < 1 or horizon <= 0 or customers < 40:
        parser.error(
            f"need --repeat >= 1 (got {repeat}), --procs >= 1 (got {procs}), --horizon > 0 "
            f"(got {horizon}) and --customers >= 40 (got {customers})"
        )

    print(
        f"python {platform.python_version()} ({platform.python_implementation()}), simpy "
        f"{simpy.__version__}, numpy {np.__version__}, os.cpu_count()={os.cpu_count()}, "
        f"{platform.machine()} {platform.system()}; best of {repeat}, seed {args.seed}"
    )

    # One small untimed pass through every model and engine, so no timed run pays first-call costs.
    timeouts_ours(100, 10.0, args.seed)
    timeouts_simpy(100, 10.0, args.seed)
    timeouts_floor(100, 10.0, args.seed)
    timeouts_callback_floor(100, 10.0, args.seed)
    mm_ours(*mm_arrivals(1_000, args.seed))
    mm_simpy(*mm_arrivals(1_000, args.seed))

    # Model 1
    runs: dict[str, list[Run]] = {engine: [] for engine in ENGINES}
    models = {"ours": timeouts_ours, "simpy": timeouts_simpy}
    floors = {
        "pure_python_heap_floor": ("pure-Python heap floor (no engine, one inlined loop)", timeouts_floor),
        "callback_floor": ("callback floor (the heap floor + a callback per event)", timeouts_callback_floor),
    }
    floor_runs: dict[str, list[Run]] = {name: [] for name in floors}
    for rep in range(repeat):
        for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            runs[engine].append(timed(lambda m=models[engine]: m(procs, horizon, args.seed)))
        for name, (_, model) in floors.items():
            floor_runs[name].append(timed(lambda m=model: m(procs, horizon, args.seed)))
    first = {engine: runs[engine][0] for engine in ENGINES}
    if first["ours"].result != first["simpy"].result:
        raise SystemExit("model 1: the engines consumed different numbers of draws")
    for name, (label, _) in floors.items():
        ref = floor_runs[name][0]
        if ref.result != first["ours"].result or ref.work != first["ours"].work:
            raise SystemExit(f"model 1: the {label} fired {ref.work:,} timeouts, ours {first['ours'].work:,}")
    limit = 2 * (first["ours"].events + procs) + DRAW_CHUNK
    drawn = draws_before(args.seed, 1.0, first["ours"].result, limit)
    fired = drawn - procs  # one draw per process at the start, then one per timeout fired
    if first["ours"].work != fired or first["simpy"].work != fired:
        raise SystemExit(
            f"model 1: {fired:,} timeouts fired by the draws, but ours counted {first['ours'].work:,} "
            f"and SimPy {first['simpy'].work:,}"
        )
    timeouts = model_figures(runs)
    timeouts["config"] = {"procs": procs, "horizon": horizon, "mean_delay": 1.0}
    for name in floors:
        floor = engine_figures(floor_runs[name])
        floor["ratio_events_per_s_vs_simpy"] = floor["events_per_s"] / timeouts["simpy"]["events_per_s"]
        floor["ratio_events_per_cpu_s_vs_simpy"] = (
            floor["events_per_cpu_s"] / timeouts["simpy"]["events_per_cpu_s"]
        )
        floor["ours_share_events_per_cpu_s"] = (
            timeouts["ours"]["events_per_cpu_s"] / floor["events_per_cpu_s"]
        )
        timeouts[name] = floor
    print_model(
        f"1. {procs:,} processes x Exp(1) timeouts until t={horizon:g} "
        f"(identical draws: {drawn:,} consumed by each engine)",
        "timeout",
        timeouts,
    )
    for name, (label, _) in floors.items():
        floor = timeouts[name]
        print(
            f"  {label}: {floor['events_per_s']:,.0f} events/s, best cpu {floor['best_cpu_s']:.3f} s = "
            f"{floor['ratio_events_per_s_vs_simpy']:.2f}x SimPy events/s "
            f"({floor['ratio_events_per_cpu_s_vs_simpy']:.2f}x per cpu s); ours runs at "
            f"{floor['ours_share_events_per_cpu_s']:.0%} of its events per cpu s"
        )

    # Model 2
    gaps, services = mm_arrivals(customers, args.seed)
    runs = {engine: [] for engine in ENGINES}
    mm_models = {"ours": mm_ours, "simpy": mm_simpy}
    for rep in range(repeat):
        for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            runs[engine].append(timed(lambda m=mm_models[engine]: m(gaps, services)))
    waits = {engine: runs[engine][0].result for engine in ENGINES}
    mean_wait = {engine: math.fsum(waits[engine]) / customers for engine in ENGINES}
    engines_diff = abs(mean_wait["ours"] - mean_wait["simpy"]) / mean_wait["simpy"]
    identical = waits["ours"] == waits["simpy"]
    expected = erlang_c_wait(SERVERS, ARRIVAL_RATE, SERVICE_RATE)
    rel_error = (mean_wait["ours"] - expected) / expected
    halfwidth = batch_means_halfwidth(waits["ours"])
    queue = model_figures(runs)
    queue["config"] = {
        "servers": SERVERS,
        "arrival_rate": ARRIVAL_RATE,
        "service_rate": SERVICE_RATE,
        "customers": customers,
    }
    queue["mean_wait"] = {
        **mean_wait,
        "engines_rel_diff": engines_diff,
        "per_customer_identical": identical,
        "erlang_c": expected,
        "rel_error_vs_erlang_c": rel_error,
        "ci95_halfwidth": halfwidth,
    }
    rho = ARRIVAL_RATE / (SERVERS * SERVICE_RATE)
    print_model(f"2. M/M/{SERVERS}, rho={rho:g}, {customers:,} customers", "customer", queue)
    print(
        f"  mean wait in queue: ours {mean_wait['ours']:.6f}, SimPy {mean_wait['simpy']:.6f} "
        f"(relative difference {engines_diff:.2e}; per-customer waits identical: {identical})"
    )
    inside = abs(mean_wait["ours"] - expected) <= halfwidth
    queue["mean_wait"]["erlang_c_inside_ci95"] = inside
    print(
        f"  Erlang C {expected:.6f}: relative error {rel_error:+.2%}; batch-means 95% half-width of the "
        f"simulated mean +/-{halfwidth / expected:.2%} (closed form inside: {'yes' if inside else 'no'})"
    )
    if engines_diff > 0.01:
        raise SystemExit(f"model 2: the engines' mean waits differ by {engines_diff:.2%} (> 1%)")

    print(
        f"\n{'model':<16} {'ours ev/s':>11} {'SimPy ev/s':>11} {'x ev/s':>7} {'x work/s':>9} "
        f"{'x ev/s cpu':>11}"
    )
    for name, figures in (("timeouts", timeouts), (f"M/M/{SERVERS} rho=0.9", queue)):
        ours, peer = figures["ours"], figures["simpy"]
        print(
            f"{name:<16} {ours['events_per_s']:>11,.0f} {peer['events_per_s']:>11,.0f} "
            f"{figures['ratio_events_per_s']:>7.2f} {figures['ratio_work_units_per_s']:>9.2f} "
            f"{figures['ratio_events_per_cpu_s']:>11.2f}"
        )
    print(
        "(x = ours / SimPy on each engine's best wall time, or on its best CPU time in the last\n"
        " column; work = timeouts fired or customers served)"
    )

    if args.json is not None:
        report = {
            "python": platform.python_version(),
            "simpy": simpy.__version__,
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
            "repeat": repeat,
            "seed": args.seed,
            "timeouts": timeouts,
            "mm8": queue,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
