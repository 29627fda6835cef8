"""A trace replayed as a stream (items read one at a time, records handed out as requests end)
must report what the in-memory replay reports, to the last bit."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.results import RequestsCsvStream, write_requests_csv
from hicache.scenarios import build
from hicache.scenarios.build import build_workload, stream_workload, why_not_streamed
from hicache.scenarios.scenario import ScenarioError, load_scenario
from hicache.sim.cluster import Cluster
from hicache.sim.runner import run_baselines, run_streamed, table, write_outputs
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


@pytest.mark.slow
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


def _cli_sets(trace: Path) -> list[str]:
    return [f'workload.path="{trace}"', 'run.baselines=["l1", "l1_l2_l3"]']


def _without_wall(doc: dict) -> dict:
    return {**doc, "runs": {k: {**v, "wall_s": None} for k, v in doc["runs"].items()}}


def _table_rows(text: str) -> list[str]:
    """The printed table's rows, less the wall-time column (the last)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    return [line.rsplit(maxsplit=1)[0] for line in lines[start : start + 3]]


@pytest.mark.slow
def test_sim_run_streams_a_trace_and_writes_what_the_in_memory_path_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _trace(tmp_path / "t.jsonl", 700)
    sets = _cli_sets(trace)
    scenario = load_scenario(SCENARIO, sets)
    memory_out = tmp_path / "memory"
    memory = run_baselines(scenario)
    write_outputs(memory_out, scenario, memory)
    print(table(memory))
    memory_printed = capsys.readouterr().out

    # The command must not build the workload in memory: it streams it.
    def no_build(_: object) -> None:
        raise AssertionError("build_workload called for a streamable scenario")

    monkeypatch.setattr(build, "build_workload", no_build)
    streamed_out = tmp_path / "streamed"
    args = ["sim", "run", str(SCENARIO), "--out", str(streamed_out), "--quiet"]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 0
    printed = capsys.readouterr().out
    assert "700 requests" in printed
    assert _table_rows(printed) == _table_rows(memory_printed)

    names = sorted(p.name for p in memory_out.iterdir())
    assert sorted(p.name for p in streamed_out.iterdir()) == names  # no temporary left
    assert (streamed_out / "requests.csv").read_bytes() == (memory_out / "requests.csv").read_bytes()
    docs = [json.loads((d / "summary.json").read_text()) for d in (streamed_out, memory_out)]
    assert _without_wall(docs[0]) == _without_wall(docs[1])
    for png in ("ttft_cdf.png", "cached_by_tier.png", "pd_transfer.png"):
        assert (streamed_out / png).read_bytes() == (memory_out / png).read_bytes(), png


def test_a_streamed_run_that_fails_leaves_no_requests_csv(tmp_path: Path) -> None:
    lines = _trace(tmp_path / "t.jsonl", 300).read_text().splitlines()
    # Step back in time late in the trace: found only once the replay reaches it.
    (tmp_path / "late.jsonl").write_text("\n".join([*lines, lines[5]]) + "\n")
    scenario = load_scenario(SCENARIO, _cli_sets(tmp_path / "late.jsonl"))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ScenarioError, match="not in arrival order"):
        run_streamed(scenario, out / "requests.csv")
    assert list(out.iterdir()) == []
    assert (
        main(
            [
                "sim",
                "run",
                str(SCENARIO),
                "--out",
                str(out),
                "--quiet",
                "--set",
                _cli_sets(tmp_path / "late.jsonl")[0],
            ]
        )
        == 2
    )
    assert list(out.iterdir()) == []


def test_records_come_out_in_arrival_then_id_order(tmp_path: Path) -> None:
    """Rows wait only for requests sent before them: ties at one arrival sort by id."""
    scenario = _scenario(_trace(tmp_path / "t.jsonl", 400, seed=11))
    results, outcomes = run_streamed(scenario, tmp_path / "requests.csv")
    assert results["l1_l2_l3"].records == []
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = [(float(r["arrival"]), r["id"]) for r in rows]
    assert keys == sorted(keys) and len(keys) == 400
    assert len(outcomes["l1_l2_l3"].ttft) == results["l1_l2_l3"].summary["completed"]
