"""From a scenario to the requests both drivers replay.

Generators run with the scenario's parameters and seed; traces are read as they are. Then the
same steps apply to both: keep the first `limit` requests (traces) and the arrivals before
`run.until`, spread sessions over tenants, and sort by arrival. With closed-loop arrivals a
session's requests after its first carry their pause (`WorkItem.think`) instead of a fixed time:
the driver sends each one when the previous is answered, so `run.until` cuts sessions by when
they start here and by when each request is sent there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import attrs

from hicache.scenarios import fit
from hicache.scenarios.generators import AgenticLoop, SharedPrefix
from hicache.scenarios.multiturn import MultiTurnChat
from hicache.scenarios.scenario import GENERATORS, Scenario, ScenarioError
from hicache.scenarios.traces import TraceRequest, iter_mooncake, read_trace
from hicache.scenarios.workload import WorkItem, from_chat, from_trace, iter_from_trace


def make_generator(scenario: Scenario) -> MultiTurnChat | AgenticLoop | SharedPrefix:
    """The generator of a generated workload, seeded by the workload or else the scenario."""
    workload = scenario.workload
    if workload.kind not in GENERATORS:
        detail = f"{workload.kind!r} is not a generated workload"
        raise ScenarioError(scenario.source, "workload.kind", detail)
    params = workload.generator_params()
    cls = GENERATORS[workload.kind]
    defaults = {f.name: f.default for f in attrs.fields(cls)}
    misfit = fit.misfit(workload.kind, params, defaults, fit.memory_budget())
    if misfit is not None:
        raise ScenarioError(scenario.source or scenario.name, f"workload.{misfit[0]}", misfit[1])
    return cls(**params, seed=scenario.workload_seed)


def _trace_requests(scenario: Scenario) -> list[TraceRequest]:
    workload = scenario.workload
    path = Path(workload.path)
    if not path.exists():
        raise ScenarioError(scenario.source, "workload.path", f"no such file or directory: '{path}'")
    requests = read_trace(path, time_scale=workload.time_scale)
    if (path.is_dir() or path.suffix == ".json") and workload.time_scale != 1.0:
        # The kv-cache-tester reader keeps the sessions' own clock.
        requests = [attrs.evolve(r, arrival=r.arrival * workload.time_scale) for r in requests]
    requests.sort(key=lambda r: r.arrival)
    return requests[: workload.limit] if workload.limit else requests


def assign_tenants(items: list[WorkItem], tenants: int) -> list[WorkItem]:
    """Sessions go to tenants t0..t{n-1} round-robin in order of first arrival; a request
    without a session is a session of its own. With one tenant nothing is salted."""
    if tenants <= 1:
        return items
    index: dict[str, int] = {}
    out = []
    for item in items:
        session = item.session or f"request/{item.id}"
        k = index.setdefault(session, len(index))
        out.append(attrs.evolve(item, tenant=f"t{k % tenants}"))
    return out


def close_loop(items: list[WorkItem], think: float | None) -> list[WorkItem]:
    """Every request of a session after its first waits for the previous one's answer, then
    `think` seconds (None: the gap between the two arrivals, a trace's own pause). `items` are
    in arrival order; a request without a session stays where it is."""
    previous: dict[str, WorkItem] = {}
    out = []
    for item in items:
        before = previous.get(item.session) if item.session else None
        if before is not None:
            pause = item.arrival - before.arrival if think is None else think
            item = attrs.evolve(item, think=pause)
        if item.session:
            previous[item.session] = item
        out.append(item)
    return out


def _closed_think(scenario: Scenario) -> float | None:
    """The fixed pause of a closed loop: a generator's mean gap is its clients' pause."""
    workload = scenario.workload
    if workload.kind == "trace":
        return workload.think_time
    params = workload.generator_params()
    return params["tool_time"] if workload.kind == "agentic" else params["think_time"]


def _before(items: list[WorkItem], until: float) -> list[WorkItem]:
    """The requests sent before `until`: open ones by arrival, closed-loop ones with their
    session (the driver stops sending them at `until`)."""
    started: set[str] = set()
    out = []
    for item in items:
        if item.think is None:
            if item.arrival < until:
                out.append(item)
                started.add(item.session)
        elif item.session in started:
            out.append(item)
    return out


def build_workload(scenario: Scenario) -> list[WorkItem]:
    """Every request of the scenario's workload, sorted by arrival (stable)."""
    if scenario.workload.kind == "trace":
        items = from_trace(_trace_requests(scenario))
    else:
        items = from_chat(make_generator(scenario).generate())
    items.sort(key=lambda item: item.arrival)
    if scenario.workload.closed:
        if not any(item.session for item in items):
            detail = "closed-loop sessions need session ids, and this trace has none"
            raise ScenarioError(scenario.source or scenario.name, "workload.arrivals", detail)
        items = close_loop(items, _closed_think(scenario))
    if scenario.run.until > 0:
        items = _before(items, scenario.run.until)
        if not items:
            detail = f"no request arrives before {scenario.run.until:g} s: nothing to replay"
            raise ScenarioError(scenario.source or scenario.name, "run.until", detail)
    return assign_tenants(items, scenario.workload.tenants)


def why_not_streamed(scenario: Scenario) -> str | None:
    """Why `stream_workload` cannot replay this scenario, or None when it can: only an open-loop
    Mooncake trace, untenanted, is read as a stream (the others need the whole workload to sort,
    close loops or assign tenants)."""
    workload = scenario.workload
    if workload.kind != "trace" or Path(workload.path).suffix != ".jsonl":
        return "only a Mooncake .jsonl trace is streamed"
    if workload.closed:
        return "a closed loop needs every session's requests"
    if workload.tenants > 1:
        return "tenants are assigned over the whole workload"
    return None


def stream_workload(scenario: Scenario) -> Iterator[WorkItem]:
    """The items `build_workload` returns, read one at a time from the trace so that memory does
    not grow with it. The trace must already be in arrival order (a `build_workload` sorts it;
    a stream cannot), else `ScenarioError` when the first step back is reached."""
    why = why_not_streamed(scenario)
    if why is not None:
        raise ScenarioError(scenario.source or scenario.name, "workload", f"cannot stream: {why}")
    workload = scenario.workload
    path = Path(workload.path)
    if not path.exists():
        raise ScenarioError(scenario.source, "workload.path", f"no such file or directory: '{path}'")
    requests = iter_mooncake(path, time_scale=workload.time_scale)
    if workload.limit:
        requests = islice(requests, workload.limit)
    until = scenario.run.until
    last = -math.inf
    sent = 0
    for item in iter_from_trace(requests):
        if item.arrival < last:
            detail = f"{path}: request {item.id} arrives before the one ahead of it: not in arrival order"
            raise ScenarioError(scenario.source or scenario.name, "workload.path", detail)
        last = item.arrival
        if until > 0 and item.arrival >= until:
            break  # in arrival order: none after it is sent either
        sent += 1
        yield item
    if until > 0 and not sent:
        detail = f"no request arrives before {until:g} s: nothing to replay"
        raise ScenarioError(scenario.source or scenario.name, "run.until", detail)
