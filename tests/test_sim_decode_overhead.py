"""The per-step cost of a hierarchical decode cache (`cluster.hicache_step_overhead`): every
decode step of a node with L2 or L3 takes that much longer, so TPOT rises by exactly that
amount; nodes without those tiers do not pay it."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.scenarios.scenario import parse_scenario
from hicache.sim.runner import run_baselines

OVERHEAD = 0.75e-3  # s per step: e.g. ~5 all-reduces of 150 us (sgl-project/sglang#30511)


def run(overhead: float, **workload: Any) -> dict[str, Any]:
    doc = {
        "workload": {
            "kind": "multiturn",
            "conversations": 1,
            "turns": 1,
            "system_prompt": 512,
            "user_tokens": [256, 256],
            "output_tokens": [200, 200],
            **workload,
        },
        "cache": {"l1_tokens": 50_000},
        "cluster": {"hicache_step_overhead": overhead},
    }
    return run_baselines(parse_scenario(doc, "overhead.toml"))


def test_a_lone_request_pays_the_overhead_on_every_step() -> None:
    base, more = run(0.0), run(OVERHEAD)
    for label in ("l1_l2", "l1_l2_l3"):
        (a,), (b,) = base[label].records, more[label].records
        assert b.tpot_s - a.tpot_s == pytest.approx(OVERHEAD, rel=1e-9)
        assert b.ttft_s == a.ttft_s  # prefill and the transfer do not step the decode batch
        steps = b.output_tokens - 1  # the first token comes from prefill
        assert b.e2e_s - a.e2e_s == pytest.approx(steps * OVERHEAD, rel=1e-9)
    for label in ("no_decode_cache", "l1"):  # no host or storage tier: nothing to poll
        assert base[label].records == more[label].records


def test_a_busy_node_pays_it_too() -> None:
    busy = {"conversations": 20, "turns": 2, "rate": 20.0, "think_time": 0.2}
    base, more = run(0.0, **busy), run(OVERHEAD, **busy)
    a = base["l1_l2_l3"].summary["tpot_s"]["mean"]
    b = more["l1_l2_l3"].summary["tpot_s"]["mean"]
    assert b - a == pytest.approx(OVERHEAD, rel=0.1)
    assert base["l1"].records == more["l1"].records
