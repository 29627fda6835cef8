"""The simulator's front door (`cluster.front_door_running`), as `hicache serve`'s admission:
at most that many requests at the decode nodes, holding together at most their L1 (a request
counting its prompt and min(output, decode_reserve_tokens), one alone always let in), the
others waiting at the door in arrival order; a request's record counts from its arrival at the
door. A door that never binds changes nothing."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from hicache.results import RequestRecord
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import ScenarioError, parse_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

PAGE = 16


def scenario(running: int, l1_tokens: int, rate: float, seed: int) -> Any:
    doc: dict[str, Any] = {
        "seed": seed,
        "workload": {
            "kind": "multiturn",
            "conversations": 6,
            "turns": 3,
            "rate": rate,
            "think_time": 0.2,
            "system_prompt": 64,
            "user_tokens": [16, 120],
            "output_tokens": [4, 40],
        },
        "cache": {
            "page_size": PAGE,
            "l1_tokens": l1_tokens,
            "hicache_ratio": 1.0,
            "decode_reserve_tokens": PAGE,
        },
        "cluster": {"front_door_running": running},
        "run": {"baselines": ["l1_l2"]},
    }
    return parse_scenario(doc, "door.toml")


def run_watched(sc: Any) -> tuple[list[RequestRecord], list[tuple[str, str, int, int]]]:
    """The records, and each door event as (what, request, requests let in, their tokens)."""
    (setup,) = setups(sc).values()
    cluster = Cluster(setup)
    cluster.door_log = []
    result = cluster.run(build_workload(sc))
    return result.records, cluster.door_log


@settings(max_examples=25, deadline=None)
@given(
    running=st.integers(1, 4),
    l1_pages=st.integers(40, 80),
    rate=st.floats(2.0, 40.0),
    seed=st.integers(0, 1000),
)
def test_the_door_lets_in_what_fits_in_arrival_order(
    running: int, l1_pages: int, rate: float, seed: int
) -> None:
    sc = scenario(running, l1_pages * PAGE, rate, seed)
    records, seen = run_watched(sc)
    items = {i.id: i for i in build_workload(sc)}
    assert len(records) == len(items) and all(r.outcome == "finished" for r in records)
    budget = l1_pages * PAGE
    for what, _rid, now_running, tokens in seen:
        assert 0 <= now_running <= running
        if what == "enter" and now_running > 1:
            assert tokens <= budget
    entered = [rid for what, rid, _, _ in seen if what == "enter"]
    reached = [rid for what, rid, _, _ in seen if what == "arrive"]
    assert entered == reached  # none overtakes a request that reached the door before it
    assert sorted(entered) == sorted(items)
    by_id = {r.id: r for r in records}
    for rid in entered:  # the record counts from the door: TTFT holds the wait there
        assert by_id[rid].ttft_s >= 0 and by_id[rid].e2e_s >= by_id[rid].ttft_s


@pytest.mark.parametrize("seed", range(3))
def test_a_door_that_never_binds_changes_nothing(seed: int) -> None:
    wide = scenario(1000, 1 << 20, 10.0, seed)
    none = scenario(0, 1 << 20, 10.0, seed)
    a, _ = run_watched(wide)
    b, _ = run_watched(none)
    assert a == b


def test_a_narrow_door_queues_requests_and_their_ttft_holds_the_wait() -> None:
    one, seen = run_watched(scenario(1, 64 * PAGE, 40.0, 1))
    assert max(n for what, _, n, _ in seen if what == "enter") == 1
    free, _ = run_watched(scenario(0, 64 * PAGE, 40.0, 1))
    assert sum(r.ttft_s for r in one) > sum(r.ttft_s for r in free)


def test_a_bad_door_is_named() -> None:
    with pytest.raises(ScenarioError, match="cluster.front_door_running"):
        scenario(-1, 64 * PAGE, 1.0, 0)
