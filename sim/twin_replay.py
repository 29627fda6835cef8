"""The digital twin's replay (`twin.py`): the recorded requests as the simulator's work items,
run on a scenario.

Requests are replayed with their recorded block ids. A session's next prompt names, block by
block, what its previous answer left in the cache, so a request's output pages take the keys of
the following request of its session where that one extends its prompt (other output pages stay
private, as for any trace). Sessions replay closed-loop: a turn is sent once the previous one is
answered, after the client's own pause (the gap between arrivals less the previous request's
measured response time, or exactly the gap from its end where the recording carries it:
`hicache.sim.twin_clients`), with at most as many sessions open at once as the recorded clients.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from hicache.results import RequestRecord
from hicache.scenarios.scenario import (
    Scenario,
)
from hicache.scenarios.workload import WorkItem
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups
from hicache.sim.twin_clients import think_s
from hicache.sim.twin_recording import Recorded, Recording


def work_items(
    rec: Recording, page_size: int, model: str, *, closed: bool = True
) -> tuple[list[WorkItem], dict[str, np.ndarray]]:
    """The requests to replay and each one's sequence page keys (see the module's docstring);
    `closed`: a session's later turns wait for the turn before (else they arrive as recorded)."""
    items = []
    for r in rec.requests:
        items.append(
            WorkItem(
                r.id,
                r.arrival,
                r.input_length,
                r.output_length,
                session=r.session,
                blocks=r.block_ids,
                block_size=rec.block_size,
            )
        )
    keys = {item.id: item.sequence_keys(page_size, model).copy() for item in items}
    previous: dict[str, tuple[WorkItem, Recorded]] = {}
    out = []
    for item, r in zip(items, rec.requests, strict=True):
        before = previous.get(item.session) if item.session else None
        if before is not None:
            prior, prior_rec = before
            _inherit_output(keys[prior.id], prior, keys[item.id], item, page_size)
            if closed:
                item = attrs.evolve(item, think=think_s(r, prior_rec))
        if item.session:
            previous[item.session] = (item, r)
        out.append(item)
    return out, keys


def _inherit_output(prior: np.ndarray, a: WorkItem, after: np.ndarray, b: WorkItem, page: int) -> None:
    """`a`'s output pages take the keys of `b`'s prompt where `b` extends `a`'s prompt."""
    n_a, n_b = a.prompt_len // page, b.prompt_len // page
    if n_b <= n_a or not np.array_equal(prior[:n_a], after[:n_a]):
        return
    upto = min((a.prompt_len + a.output_len) // page, n_b)
    prior[n_a:upto] = after[n_a:upto]


def one_client(rec: Recording, sc: Scenario) -> bool:
    """Replay one request at a time: a closed loop of a recording whose client sent one request
    at a time. Otherwise a replayed turn that runs longer than it did on the node would overlap
    the next one, which on the node it never did, and their pages would compete for L1."""
    return sc.workload.closed and sc.workload.clients == 0 and rec.one_at_a_time


def replay(
    rec: Recording, sc: Scenario, scales: Mapping[str, float] | None = None
) -> dict[str, RequestRecord]:
    """The simulator's record of every request of `rec` under scenario `sc`, by id; `scales`:
    a factor on each request's prefill compute (by id; 1 where not given)."""
    (setup,) = setups(sc).values()
    items, keys = work_items(rec, setup.decode.page_size, setup.model_name, closed=sc.workload.closed)
    if scales:
        items = [attrs.evolve(i, service_scale=scales.get(i.id, 1.0)) for i in items]
    cluster = Cluster(setup)
    if one_client(rec, sc):
        result = cluster.run(items, keys=keys, sequential=True)
    else:
        result = cluster.run(items, keys=keys, clients=sc.workload.clients, until=sc.run.until)
    return {r.id: r for r in result.records}
