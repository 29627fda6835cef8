"""The simulated cluster: every request ends, nothing leaks, runs are deterministic, decoding is
fast-forwarded exactly, hit ratios meet the trace's ideal, and the promise policies behave."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.cli import main
from hicache.core.states import State
from hicache.core.tree import TREE
from hicache.results import FIELDS, write_requests_csv
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, parse_scenario
from hicache.scenarios.trace_stats import trace_stats
from hicache.scenarios.traces import read_trace
from hicache.sim.cluster import Cluster
from hicache.sim.runner import run_baselines
from hicache.sim.setup import setups

ROOT = Path(__file__).resolve().parent.parent
CONVERSATION = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


def scenario(**sections: dict[str, Any]) -> Scenario:
    doc: dict[str, Any] = {
        "workload": {"kind": "multiturn", "conversations": 30, "turns": 4, "rate": 2.0, "think_time": 5.0},
        "cache": {"l1_tokens": 60_000, "hicache_ratio": 1.0},
    }
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return parse_scenario(doc, "test.toml")


def test_every_request_ends_once_and_nothing_leaks() -> None:
    s = scenario(cluster={"decode_nodes": 2, "prefill_nodes": 2, "router": "session_affinity"})
    items = build_workload(s)
    for label, setup in setups(s).items():
        cluster = Cluster(setup)
        result = cluster.run(items)
        assert sorted(r.id for r in result.records) == sorted(i.id for i in items), label
        assert all(r.outcome == "finished" for r in result.records), label
        for d in cluster.decode:
            assert not d.core.requests and not d.live  # all answered and forgotten
            for pool in (d.core.device_pool, d.core.host_pool):
                owners = {pool.owner_of(x) for x in range(pool.capacity)}
                assert owners <= {None, TREE}, (label, owners)
            assert d.core.tree.live_locks == [] and d.core.tree.live_pins == []
        for r in result.records:
            assert r.cached + r.transferred_tokens >= r.prompt_tokens - r.prompt_tokens % 64
            assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s


def test_same_scenario_same_bytes(tmp_path: Path) -> None:
    s = scenario(cluster={"decode_nodes": 2, "router": "cache_aware"})
    paths = []
    for n in range(2):
        results = run_baselines(s)
        path = tmp_path / f"run{n}.csv"
        write_requests_csv(path, ((k, r.records) for k, r in results.items()))
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_no_decode_cache_ships_every_prompt_whole() -> None:
    s = scenario(run={"baselines": ["no_decode_cache"]})
    kvb = 2 * 64 * 8 * 128 * 2  # qwen2.5-32b
    result = run_baselines(s)["no_decode_cache"]
    for r in result.records:
        assert r.cached == 0 and r.pd_transfer_bytes == r.prompt_tokens * kvb


def test_decode_fast_forward_matches_a_step_by_step_batch() -> None:
    """Finish times from the closed-form batch equal a naive loop over every decode step, fed
    the same join times."""
    s = scenario(
        workload={"conversations": 25, "turns": 1, "rate": 20.0, "output_tokens": [1, 700]},
        cache={"l1_tokens": 2_000_000},
        run={"baselines": ["no_decode_cache"]},
    )
    setup = setups(s)["no_decode_cache"]
    records = run_baselines(s)["no_decode_cache"].records
    costs = setup.costs
    b = costs.step_per_context_token
    starts = sorted((r.arrival + r.ttft_s, r.id, r.prompt_tokens, r.output_tokens) for r in records)
    finish: dict[str, float] = {}
    running: dict[str, list[int]] = {}  # id -> [prompt, made, output]
    t = 0.0
    i = 0

    def join(until: float) -> None:
        nonlocal i
        while i < len(starts) and starts[i][0] <= until:
            _, rid, prompt, out = starts[i]
            i += 1
            if out <= 1:
                finish[rid] = max(until, starts[i - 1][0]) if running else starts[i - 1][0]
            else:
                running[rid] = [prompt, 1, out]

    while i < len(starts) or running:
        if not running:
            t = max(t, starts[i][0])
            join(t)
            continue
        batch = len(running)
        dt = costs.step_constant(batch) + b * sum(p + m for p, m, _ in running.values())
        t += dt
        for rid, st in list(running.items()):
            st[1] += 1
            if st[1] == st[2]:
                finish[rid] = t
                del running[rid]
        join(t)
    for r in records:
        assert r.arrival + r.e2e_s == pytest.approx(finish[r.id], rel=1e-9), r.id


@pytest.mark.parametrize(
    ("k", "cache"),
    [(2, {}), (4, {"l1_tokens": 20_000, "decode_reserve_tokens": 64})],
    ids=["batch-bound", "batch-bound-and-retracting"],
)
@pytest.mark.plain_python  # wraps each driver's _on_epoch
def test_max_running_caps_the_batch_in_the_driver_and_the_core(k: int, cache: dict[str, Any]) -> None:
    """The batch limit is the core's (`DecodeConfig.max_running`): at every step boundary the
    driver's batch and the core's RUNNING requests are the same, at most k, and the core's
    invariants hold; requests beyond the cap wait READY, and the cap is reached."""
    s = scenario(cluster={"max_running": k}, cache=cache, run={"baselines": ["l1"]})
    setup = setups(s)["l1"]
    assert setup.decode.max_running == k
    cluster = Cluster(setup)
    batches: list[int] = []
    waited = 0
    for d in cluster.decode:

        def epoch(d: Any = d, run: Any = d._on_epoch) -> None:
            nonlocal waited
            run()
            d.core.check()
            states = [r.state for r in d.core.requests.values()]
            assert d.running == states.count(State.RUNNING) <= k
            waited += State.READY in states
            batches.append(d.running)

        d._on_epoch = epoch  # the loop and the driver look it up on the instance
    result = cluster.run(build_workload(s))
    assert all(r.outcome == "finished" for r in result.records)
    assert max(batches) == k and waited  # the cap was reached, and requests waited for it
    if cache:
        assert sum(r.retractions for r in result.records) > 0


@pytest.mark.slow
@pytest.mark.skipif(not CONVERSATION.exists(), reason="needs ../shared/traces/conversation_trace.jsonl")
def test_mooncake_hit_rate_meets_the_ideal_with_unbounded_tiers() -> None:
    ideal = trace_stats(read_trace(CONVERSATION)).ideal_hit_ratio
    assert ideal is not None
    s = parse_scenario(
        {
            "workload": {"kind": "trace", "path": str(CONVERSATION)},
            "cache": {"l1_tokens": 100_000_000, "hicache_ratio": 0.0},
            "cluster": {"max_running": 100_000},
            "run": {"baselines": ["no_decode_cache", "l1_l2_l3"]},
        },
        "test.toml",
    )
    results = run_baselines(s)
    cached, none = results["l1_l2_l3"].summary, results["no_decode_cache"].summary
    assert cached["completed"] == none["completed"] == 12_031
    assert cached["hit_rate"] <= ideal
    assert cached["hit_rate"] >= ideal - 0.03
    # what was restored locally was not sent: the P->D bytes shrink by the hit fraction
    shrink = 1 - cached["pd_transfer_bytes"] / none["pd_transfer_bytes"]
    assert shrink == pytest.approx(cached["hit_rate"], abs=0.005)


def _mean_ttft(results: dict, label: str) -> float:
    return results[label].summary["ttft_s"]["mean"]


def test_restoring_beats_a_slow_prefill_to_decode_link() -> None:
    s = scenario(hardware={"network_bandwidth": 1e9}, storage={"bandwidth": 20e9})
    results = run_baselines(s)
    assert _mean_ttft(results, "l1_l2_l3") < _mean_ttft(results, "no_decode_cache")
    assert results["l1_l2_l3"].summary["hit_rate"] > results["l1"].summary["hit_rate"]


@pytest.mark.parametrize(
    ("network", "storage"),
    [(1e9, 20e9), (2.5e9, 10e9), (400e9, 0.2e9), (50e9, 0.05e9)],
    ids=["slow-link", "balanced", "fast-link-slow-l3", "fast-link-very-slow-l3"],
)
def test_adaptive_promise_is_never_worse_than_no_decode_cache(network: float, storage: float) -> None:
    s = scenario(
        hardware={"network_bandwidth": network},
        storage={"bandwidth": storage},
        cache={"promise": "adaptive"},
        run={"baselines": ["no_decode_cache", "l1_l2_l3"]},
    )
    results = run_baselines(s)
    assert _mean_ttft(results, "l1_l2_l3") <= 1.01 * _mean_ttft(results, "no_decode_cache")


def test_session_affinity_keeps_a_conversation_on_one_node() -> None:
    s = scenario(cluster={"decode_nodes": 3, "prefill_nodes": 2, "router": "session_affinity"})
    records = run_baselines(s)["l1"].records
    nodes: dict[str, set[tuple[int, int]]] = {}
    for r in records:
        nodes.setdefault(r.session, set()).add((r.prefill_node, r.decode_node))
    assert all(len(v) == 1 for v in nodes.values())
    assert len({d for v in nodes.values() for _, d in v}) == 3


def test_cache_aware_routing_finds_more_prefix_than_round_robin() -> None:
    hits = {}
    for router in ("round_robin", "cache_aware"):
        s = scenario(cluster={"decode_nodes": 4, "router": router}, run={"baselines": ["l1"]})
        hits[router] = run_baselines(s)["l1"].summary["hit_rate"]
    assert hits["cache_aware"] > hits["round_robin"] + 0.1


def test_sim_run_writes_summary_requests_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(
        '[workload]\nkind = "multiturn"\nconversations = 6\nturns = 2\n[cache]\nl1_tokens = 50000\n',
        encoding="utf-8",
    )
    out = tmp_path / "out"
    rc = main(
        ["sim", "run", str(path), "--quiet", "--out", str(out), "--set", 'run.baselines=["l1","l1_l2"]']
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "l1_l2" in printed and "TTFT" in printed
    doc = json.loads((out / "summary.json").read_text())
    assert list(doc["runs"]) == ["l1", "l1_l2"]
    run = doc["runs"]["l1"]
    for key in ("requests", "completed", "failed", "prompt_tokens", "hit_rate", "prefill_cached_tokens"):
        assert key in run
    for key in ("pd_transfer_bytes", "fallback_tokens", "events", "wall_s"):
        assert key in run
    assert set(run["ttft_s"]) == set(run["tpot_s"]) == {"mean", "p50", "p90", "p99"}
    assert set(run["cached_tokens"]) == {"l1", "l2", "l3"}
    assert doc["scenario"]["cache"]["l1_tokens"] == 50000
    lines = (out / "requests.csv").read_text().splitlines()
    assert lines[0].split(",") == ["run", *FIELDS]
    assert len(lines) == 1 + 2 * run["requests"]
    for png in ("ttft_cdf.png", "cached_by_tier.png", "pd_transfer.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_run_reports_bad_scenarios(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[cache]\npromise = "eagre"\n', encoding="utf-8")
    assert main(["sim", "run", str(path), "--quiet", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "cache.promise" in err and "eagre" in err
    assert not (tmp_path / "o").exists()
    path.write_text('[model]\npreset = "gpt-9"\n', encoding="utf-8")
    assert main(["sim", "run", str(path), "--quiet"]) == 2
    assert "model.preset" in capsys.readouterr().err
