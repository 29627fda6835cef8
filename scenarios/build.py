"""From a scenario to the requests both drivers replay.

Generators run with the scenario's parameters and seed; traces are read as they are. Then the
same steps apply to both: keep the first `limit` requests (traces) and the arrivals before
`run.until`, spread sessions over tenants, and sort by arrival.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from hicache.scenarios.generators import AgenticLoop, SharedPrefix
from hicache.scenarios.multiturn import MultiTurnChat
from hicache.scenarios.scenario import GENERATORS, Scenario, ScenarioError
from hicache.scenarios.traces import TraceRequest, read_trace
from hicache.scenarios.workload import WorkItem, from_chat, from_trace


def make_generator(scenario: Scenario) -> MultiTurnChat | AgenticLoop | SharedPrefix:
    """The generator of a generated workload, seeded by the workload or else the scenario."""
    workload = scenario.workload
    if workload.kind not in GENERATORS:
        detail = f"{workload.kind!r} is not a generated workload"
        raise ScenarioError(scenario.source, "workload.kind", detail)
    return GENERATORS[workload.kind](**workload.generator_params(), seed=scenario.workload_seed)


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


def build_workload(scenario: Scenario) -> list[WorkItem]:
    """Every request of the scenario's workload, sorted by arrival (stable)."""
    if scenario.workload.kind == "trace":
        items = from_trace(_trace_requests(scenario))
    else:
        items = from_chat(make_generator(scenario).generate())
    items.sort(key=lambda item: item.arrival)
    if scenario.run.until > 0:
        items = [item for item in items if item.arrival < scenario.run.until]
    return assign_tenants(items, scenario.workload.tenants)
