"""A trace replayed as a stream (items read one at a time, records handed out as requests end)
must report what the in-memory replay reports, to the last bit."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from hicache.results import RequestsCsvStream, write_requests_csv
from hicache.scenarios.build import build_workload, stream_workload, why_not_streamed
from hicache.scenarios.scenario import ScenarioError, load_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.setup import setups

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "mooncake_conversation.toml"


def _trace(path: Path, n: int, seed: int = 7) -> Path:
    """A Mooncake trace with shared prefixes and tied timestamps (ids r9 / r10 tie-break)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1 << 30) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    t = 0
    with path.open("w") as f:
        for _ in range(n):
            t += rng.choice((0, 0, 50, 120, 400))
            n_in = rng.randint(200, 6000)
            blocks = -(-n_in // 512)
            head = rng.choice(prefixes)[:blocks]
            ids = head + [rng.randrange(1 << 30) for _ in range(blocks - len(head))]
            row = {
                "timestamp": t,
                "input_length": n_in,
                "output_length": rng.randint(1, 300),
                "hash_ids": ids,
            }
            f.write(json.dumps(row) + "\n")
    return path


def _scenario(trace: Path):
    return load_scenario(SCENARIO, [f'workload.path="{trace}"', 'run.baselines=["l1_l2_l3"]'])


def test_streamed_replay_matches_in_memory(tmp_path: Path) -> None:
    scenario = _scenario(_trace(tmp_path / "t.jsonl", 2000))
    assert why_not_streamed(scenario) is None
    setup = setups(scenario)["l1_l2_l3"]
    items = build_workload(scenario)
    assert list(stream_workload(scenario)) == items
    memory = Cluster(setup).run(items)

    streamed_csv = tmp_path / "streamed.csv"
    with RequestsCsvStream(streamed_csv) as out:
        streamed = Cluster(setup).run(stream_workload(scenario), on_record=lambda r: out.write("x", r))
    assert streamed.records == []
    drop = ("wall_s",)
    assert {k: v for k, v in streamed.summary.items() if k not in drop} == {
        k: v for k, v in memory.summary.items() if k not in drop
    }
    assert streamed.summary["completed"] > 1000 and streamed.summary["hit_rate"] > 0
    assert streamed.channels == memory.channels

    memory_csv = tmp_path / "memory.csv"
    write_requests_csv(memory_csv, [("x", memory.records)])
    with streamed_csv.open() as a, memory_csv.open() as b:
        rows_a, rows_b = list(csv.reader(a)), list(csv.reader(b))
    assert rows_a[0] == rows_b[0]
    assert sorted(rows_a[1:]) == sorted(rows_b[1:])  # same rows, in completion order


def test_stream_refuses_what_it_cannot_replay(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", 20)
    tenants = load_scenario(SCENARIO, [f'workload.path="{trace}"', "workload.tenants=2"])
    assert why_not_streamed(tenants) is not None
    with pytest.raises(ScenarioError, match="cannot stream"):
        next(stream_workload(tenants))
    lines = trace.read_text().splitlines()
    (tmp_path / "back.jsonl").write_text("\n".join([lines[5], *lines]) + "\n")
    backwards = _scenario(tmp_path / "back.jsonl")
    with pytest.raises(ScenarioError, match="not in arrival order"):
        list(stream_workload(backwards))
