"""Closed-loop sessions: a session's next request is sent `think` seconds after its previous
one is answered, never while it is in flight; a client cap bounds the sessions open at once;
runs are deterministic; study 2 of docs/validation.md runs from its scenario alone."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from builders import examples
from hypothesis import given, settings

from hicache.cli import main
from hicache.results import RequestRecord
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import ScenarioError, parse_scenario
from hicache.scenarios.workload import WorkItem
from hicache.sim.runner import run_baselines
from hicache.sim.sessions import ClosedLoop

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"system_prompt": 256, "user_tokens": [64, 512], "output_tokens": [16, 128]}


def closed(workload: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Any:
    doc: dict[str, Any] = {
        "workload": {
            "kind": "multiturn",
            "conversations": 8,
            "turns": 4,
            "rate": 4.0,
            "think_time": 0.5,
            "arrivals": "closed",
            **SMALL,
            **(workload or {}),
        },
        "cache": {"l1_tokens": 40_000, "hicache_ratio": 1.0},
        **sections,
    }
    return parse_scenario(doc, "closed.toml")


def by_session(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.arrival, r.turn)):
        out[r.session].append(r)
    return out


def check_chains(records: list[RequestRecord], items: list[WorkItem]) -> None:
    """No session has two requests in flight, and each follow-up arrives exactly its pause
    after the answer before it."""
    think = {i.id: i.think for i in items}
    for session, rs in by_session(records).items():
        assert [r.turn for r in rs] == sorted(r.turn for r in rs), session
        for before, after in zip(rs, rs[1:], strict=False):
            answered = before.arrival + before.e2e_s
            assert after.arrival >= answered - 1e-9, (session, before.id, after.id)
            assert think[after.id] is not None
            assert after.arrival == pytest.approx(answered + think[after.id], rel=1e-12, abs=1e-9)


def open_sessions(records: list[RequestRecord]) -> int:
    """The most sessions open at once: from a session's first arrival to its last answer."""
    edges = []
    for rs in by_session(records).values():
        edges.append((rs[0].arrival, 1))
        # arrival + e2e_s can exceed the answer's time by a rounding error: a session that starts
        # at that instant is not counted as overlapping it
        edges.append((max(r.arrival + r.e2e_s for r in rs) - 1e-9, -1))
    most = now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at a tie
        now += step
        most = max(most, now)
    return most


# --- the workload --------------------------------------------------------------------------


def test_closed_loop_items_carry_their_pause_and_keep_the_open_tokens() -> None:
    s = closed()
    items = build_workload(s)
    opened = build_workload(closed({"arrivals": "open"}))
    assert [(i.id, i.prompt_len, i.output_len) for i in items] == [
        (i.id, i.prompt_len, i.output_len) for i in opened
    ]
    for item in items:
        assert item.think == (None if item.turn == 0 else 0.5)
    assert all(i.think is None for i in opened)


def test_agentic_sessions_pause_for_the_tool_time() -> None:
    doc = {"workload": {"kind": "agentic", "sessions": 3, "steps": 3, "tool_time": 1.5, "arrivals": "closed"}}
    items = build_workload(parse_scenario(doc, "a.toml"))
    assert {i.think for i in items if i.turn} == {1.5} and {i.think for i in items if not i.turn} == {None}


def test_closed_loop_keys_are_checked() -> None:
    with pytest.raises(ScenarioError, match=r"workload\.clients: applies only to closed-loop"):
        parse_scenario({"workload": {"clients": 4}}, "x.toml")
    with pytest.raises(ScenarioError, match=r"workload\.arrivals: applies to kind"):
        parse_scenario({"workload": {"kind": "shared_prefix", "arrivals": "closed"}}, "x.toml")
    with pytest.raises(ScenarioError, match=r"workload\.arrivals: unknown arrival mode 'later'"):
        parse_scenario({"workload": {"arrivals": "later"}}, "x.toml")
    s = closed({"clients": 3})
    assert parse_scenario(s.to_dict(), "x.toml") == s
    assert "arrivals" not in closed({"arrivals": "open"}).to_dict()["workload"]


def sessions_trace(tmp_path: Path) -> Path:
    folder = tmp_path / "sessions"
    folder.mkdir()
    for name, start in (("a", 0.0), ("b", 1.0)):
        reqs = [
            {"t": start + 10 * k, "in": 256 + 64 * k, "out": 8, "hash_ids": list(range(4 + k))}
            for k in range(3)
        ]
        (folder / f"{name}.json").write_text(json.dumps({"id": name, "block_size": 64, "requests": reqs}))
    return folder


def test_a_trace_without_sessions_cannot_be_replayed_closed_loop(tmp_path: Path) -> None:
    lines = [
        json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, 1 + i]})
        for i in range(3)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    doc = {"workload": {"kind": "trace", "path": "t.jsonl", "arrivals": "closed"}}
    with pytest.raises(ScenarioError, match=r"workload\.arrivals: closed-loop sessions need session ids"):
        build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))


def test_a_trace_session_pauses_for_its_own_gaps_or_a_fixed_think_time(tmp_path: Path) -> None:
    sessions_trace(tmp_path)
    doc: dict[str, Any] = {"workload": {"kind": "trace", "path": "sessions", "arrivals": "closed"}}
    items = build_workload(parse_scenario(doc, str(tmp_path / "s.toml")))
    assert [(i.session, i.turn, i.think) for i in items if i.session == "a"] == [
        ("a", 0, None),
        ("a", 1, 10.0),
        ("a", 2, 10.0),
    ]
    doc["workload"]["think_time"] = 0.25
    s = parse_scenario(doc, str(tmp_path / "s.toml"))
    items = build_workload(s)
    assert {i.think for i in items if i.turn} == {0.25}
    records = run_baselines(s)["l1"].records
    assert len(records) == 6
    check_chains(records, items)
    with pytest.raises(ScenarioError, match=r"workload\.think_time: applies only to closed-loop"):
        parse_scenario({"workload": {"kind": "trace", "path": "t", "think_time": 1.0}}, "x.toml")


# --- the replay ----------------------------------------------------------------------------


def test_a_session_never_has_two_requests_in_flight_and_waits_exactly_its_think_time() -> None:
    s = closed()
    items = build_workload(s)
    results = run_baselines(s)
    for label, result in results.items():
        assert len(result.records) == len(items), label
        check_chains(result.records, items)


def test_open_arrivals_of_the_same_workload_overlap_within_a_session() -> None:
    """The check above can fail: replayed open-loop, turns are sent before their answer."""
    s = closed({"arrivals": "open", "think_time": 0.05, "rate": 50.0})
    records = run_baselines(s)["no_decode_cache"].records
    overlapped = any(
        after.arrival < before.arrival + before.e2e_s
        for rs in by_session(records).values()
        for before, after in zip(rs, rs[1:], strict=False)
    )
    assert overlapped


@pytest.mark.parametrize("clients", [1, 2, 3])
def test_the_client_cap_holds_and_binds(clients: int) -> None:
    s = closed({"clients": clients, "rate": 50.0})
    items = build_workload(s)
    for label, result in run_baselines(s).items():
        assert len(result.records) == len(items), label
        assert open_sessions(result.records) == clients, label
        check_chains(result.records, items)
    uncapped = run_baselines(closed({"rate": 50.0}))["l1"].records
    assert open_sessions(uncapped) > 3


def test_a_waiting_session_starts_when_a_client_frees_in_arrival_order() -> None:
    s = closed({"clients": 1, "rate": 50.0})
    records = run_baselines(s)["l1"].records
    sessions = by_session(records)
    order = sorted(sessions, key=lambda k: sessions[k][0].arrival)
    assert order == sorted(sessions, key=lambda k: int(k[1:]))  # c0, c1, ... as they arrived
    for a, b in zip(order, order[1:], strict=False):
        last = sessions[a][-1]
        assert sessions[b][0].arrival == pytest.approx(last.arrival + last.e2e_s, abs=1e-9)


def test_nothing_is_sent_at_or_after_until() -> None:
    s = closed({"think_time": 2.0}, run={"until": 3.0})
    full = build_workload(closed({"think_time": 2.0}))
    records = run_baselines(s)["l1"].records
    assert records and all(r.arrival < 3.0 for r in records)
    assert len(records) < len(full)
    assert len(build_workload(s)) > len(records)  # the cut falls in the replay, not before it


def test_the_same_seed_gives_the_same_replay_and_another_seed_another() -> None:
    def rows(seed: int) -> list[tuple]:
        s = parse_scenario({**closed({"clients": 3}).to_dict(), "seed": seed}, "closed.toml")
        return [
            (label, r.id, r.arrival, r.ttft_s, r.e2e_s, r.cached)
            for label, res in run_baselines(s).items()
            for r in res.records
        ]

    assert rows(1) == rows(1)
    assert rows(1) != rows(2)


@settings(max_examples=examples(25), deadline=None)
@given(
    conversations=st.integers(1, 6),
    turns=st.integers(1, 4),
    think=st.sampled_from([0.0, 0.01, 0.3, 2.0]),
    clients=st.integers(0, 4),
    nodes=st.integers(1, 2),
    router=st.sampled_from(["round_robin", "session_affinity", "cache_aware"]),
    rate=st.sampled_from([0.5, 5.0, 100.0]),
    seed=st.integers(0, 3),
)
def test_closed_loop_holds_on_random_small_workloads(
    conversations: int,
    turns: int,
    think: float,
    clients: int,
    nodes: int,
    router: str,
    rate: float,
    seed: int,
) -> None:
    s = parse_scenario(
        {
            "seed": seed,
            "workload": {
                "kind": "multiturn",
                "conversations": conversations,
                "turns": turns,
                "rate": rate,
                "think_time": think,
                "arrivals": "closed",
                "clients": clients,
                "system_prompt": 64,
                "user_tokens": [8, 200],
                "output_tokens": [1, 40],
            },
            "cache": {"l1_tokens": 20_000, "hicache_ratio": 1.0},
            "cluster": {"decode_nodes": nodes, "prefill_nodes": nodes, "router": router},
        },
        "prop.toml",
    )
    items = build_workload(s)
    for label, result in run_baselines(s).items():
        assert sorted(r.id for r in result.records) == sorted(i.id for i in items), label
        assert all(r.outcome == "finished" for r in result.records), label
        check_chains(result.records, items)
        if clients:
            assert open_sessions(result.records) <= clients, label


# --- the bookkeeping on its own ----------------------------------------------------------------


def item(rid: str, session: str, think: float | None = None, arrival: float = 0.0) -> WorkItem:
    return WorkItem(rid, arrival, 64, 4, session=session, think=think)


def test_closed_loop_chains_frees_clients_and_cuts_at_until() -> None:
    a0, a1, a2 = item("a0", "a"), item("a1", "a", 1.0), item("a2", "a", 2.0)
    b0, c0 = item("b0", "b", arrival=0.5), item("c0", "c", arrival=0.6)
    loop = ClosedLoop([a0, b0, c0, a1, a2], clients=1, until=10.0)
    assert loop.firsts == [a0, b0, c0]
    assert loop.arrived(a0, 0.0) and not loop.arrived(b0, 0.5) and not loop.arrived(c0, 0.6)
    assert loop.answered("a0") == [(1.0, a1)]
    assert loop.due(a1, 5.0) is None  # before until: send it
    assert loop.answered("a1") == [(2.0, a2)]
    assert loop.due(a2, 10.0) == [(0.0, b0)]  # cut at until: the chain ends, b gets the client
    assert loop.open == 1 and loop.peak == 1
    assert loop.answered("b0") == [(0.0, c0)]
    assert loop.answered("c0") == [] and loop.open == 0
    with pytest.raises(ValueError, match="clients"):
        ClosedLoop([], clients=-1)
    late = ClosedLoop([a0, a1], until=1.0)
    assert not late.arrived(a0, 1.0) and late.open == 0  # at `until`: neither sent nor holding
    assert late.firsts == [a0]


# --- study 2 from its scenario alone -----------------------------------------------------------


def test_study_2_runs_from_its_scenario_through_sim_run(tmp_path: Path) -> None:
    rc = main(
        [
            "sim",
            "run",
            str(ROOT / "scenarios" / "validation_pr_multiturn.toml"),
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert runs["l1_l2_l3"]["hit_rate"] == pytest.approx(0.88, abs=0.01)
    assert runs["no_decode_cache"]["completed"] == runs["l1_l2_l3"]["completed"] == 192
    assert runs["l1_l2_l3"]["ttft_s"]["mean"] < 0.5 * runs["no_decode_cache"]["ttft_s"]["mean"] < 5.0
