"""Sweeps: every run equals a direct simulation of its configuration, sweep.csv holds one row per
run and baseline, an interrupted sweep resumes without redoing saved runs and ends byte-identical
to an uninterrupted one, and bad input fails before anything runs, naming the field."""

from __future__ import annotations

import csv
import json
import math
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from builders import examples
from helpers import free_port as _closed_port
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cli import main
from hicache.scenarios.scenario import load_scenario
from hicache.sim.runner import run_baselines
from hicache.sim.sweep import (
    SweepError,
    SweepPlan,
    cell,
    check_ray_address,
    local_executor,
    parse_grid,
    plan_sweep,
    ray_executor,
    read_sweep,
    run_path,
    run_sweep,
    to_toml,
    write_sweep_csv,
)

SCENARIO = """
name = "tiny"

[workload]
kind = "multiturn"
conversations = 6
turns = 3
system_prompt = 256
user_tokens = [200, 800]
output_tokens = [32, 128]
rate = 2.0
think_time = 3.0

[cache]
l1_tokens = 8000
hicache_ratio = 1.0

[run]
baselines = ["l1", "l1_l2_l3"]
"""
GRIDS = ["cache.prefetch_policy=best_effort,wait_complete", "cache.hicache_ratio=1,2"]
GRID_ARGS = [arg for g in GRIDS for arg in ("--grid", g)]


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "tiny.toml"
    path.write_text(SCENARIO, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory, scenario_file: Path) -> tuple[SweepPlan, Path, list[str]]:
    """An uninterrupted sweep of 2 x 2 values x 2 seeds through a pool of two processes."""
    plan = plan_sweep(scenario_file, GRIDS, repeat=2)
    out = tmp_path_factory.mktemp("sweeps") / "full"
    outcome = run_sweep(plan, out, executor=local_executor(2))
    return plan, out, list(outcome.ran)


@pytest.fixture(scope="module")
def finished(
    tmp_path_factory: pytest.TempPathFactory, scenario_file: Path
) -> tuple[SweepPlan, Path, list[str]]:
    """The same sweep as `full`, run in this process: a finished sweep folder for the tests of
    what `--resume` and `--out` refuse, without starting a process pool."""
    plan = plan_sweep(scenario_file, GRIDS, repeat=2)
    out = tmp_path_factory.mktemp("sweeps") / "finished"
    outcome = run_sweep(plan, out, executor=local_executor(1))
    return plan, out, list(outcome.ran)


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary as its JSON file holds it, without the one field measured on the host."""
    out = json.loads(json.dumps(summary))
    out.pop("wall_s")
    return out


@pytest.mark.slow
def test_every_run_equals_its_configuration_simulated_alone(
    full: tuple[SweepPlan, Path, list[str]], scenario_file: Path
) -> None:
    plan, out, ran = full
    assert len(plan.runs) == 8 and len({r.id for r in plan.runs}) == 8
    assert sorted(ran) == sorted(r.id for r in plan.runs)
    ttft_by_seed: dict[int, set[float]] = {}
    for run in plan.runs:
        doc = json.loads(run_path(out, run.id).read_text(encoding="utf-8"))
        assert doc["seed"] == run.seed and doc["overrides"] == dict(run.overrides)
        overrides = [f"{field}={json.dumps(value)}" for field, value in run.overrides]
        direct = run_baselines(load_scenario(scenario_file, [*overrides, f"seed={run.seed}"]))
        assert list(doc["baselines"]) == list(direct) == ["l1", "l1_l2_l3"]
        for label, result in direct.items():
            saved = doc["baselines"][label]
            assert _comparable(saved["summary"]) == _comparable(result.summary), (run, label)
            assert saved["channels"] == json.loads(json.dumps(result.channels))
        assert doc["wall_s"] > 0
        ttft_by_seed.setdefault(run.seed, set()).add(doc["baselines"]["l1"]["summary"]["ttft_s"]["mean"])
    # The seeds reach the workload: the two seeds' runs differ.
    assert ttft_by_seed[0].isdisjoint(ttft_by_seed[1])


def _csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        return header, [dict(zip(header, row, strict=True)) for row in reader]


def _without_wall(path: Path) -> list[list[str]]:
    """sweep.csv less its wall_s cells, the one figure measured on the host."""
    header, rows = _csv(path)
    keep = [h for h in header if h != "wall_s"]
    return [keep, *([row[h] for h in keep] for row in rows)]


@pytest.mark.process
def test_sweep_csv_has_a_row_per_run_and_baseline(full: tuple[SweepPlan, Path, list[str]]) -> None:
    plan, out, _ = full
    header, rows = _csv(out / "sweep.csv")
    # The baseline column is named as in requests.csv.
    assert header[:5] == ["run_id", "seed", "cache.prefetch_policy", "cache.hicache_ratio", "run"]
    for column in ("ttft_s.mean", "ttft_s.p99", "tpot_s.p90", "cached_tokens.l1", "cached_tokens.l3"):
        assert column in header
    for column in ("hit_rate", "pd_transfer_bytes", "fallback_tokens", "events", "completed", "wall_s"):
        assert column in header
    assert len(rows) == 16
    # Rows in the plan's order (grid values as given, then seed), baselines in the scenario's.
    assert [(r["run_id"], r["run"]) for r in rows] == [(p.id, b) for p in plan.runs for b in plan.baselines]
    runs = {r.id: r for r in plan.runs}
    for row in rows:
        run = runs[row["run_id"]]
        assert row["seed"] == str(run.seed)
        assert [row[f] for f in plan.fields] == [cell(v) for _, v in run.overrides]
        doc = json.loads(run_path(out, run.id).read_text(encoding="utf-8"))
        saved = doc["baselines"][row["run"]]
        summary = saved["summary"]
        assert float(row["ttft_s.p99"]) == summary["ttft_s"]["p99"]
        assert int(row["cached_tokens.l2"]) == summary["cached_tokens"]["l2"]
        assert float(row["wall_s"]) == summary["wall_s"] > 0
        # Byte counts are integers; every link's utilisation is there.
        assert row["pd_transfer_bytes"] == str(round(summary["pd_transfer_bytes"]))
        for link, figures in saved["channels"].items():
            assert row[f"channels.{link}.bytes"] == str(round(figures["bytes"]))
            assert float(row[f"channels.{link}.utilization"]) == figures["utilization"]
    assert any(h.endswith(".utilization") for h in header)
    assert {(r["cache.prefetch_policy"], r["cache.hicache_ratio"], r["seed"]) for r in rows} == {
        (p, h, s) for p in ("best_effort", "wait_complete") for h in ("1", "2") for s in ("0", "1")
    }


@pytest.mark.slow
def test_sweep_csv_columns_do_not_depend_on_the_runs_present(
    full: tuple[SweepPlan, Path, list[str]], tmp_path: Path
) -> None:
    plan, out, _ = full
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    for run in plan.runs[:5]:
        run_path(partial, run.id).unlink()
    write_sweep_csv(partial, plan)
    header, rows = _csv(partial / "sweep.csv")
    assert header == _csv(out / "sweep.csv")[0]
    assert [r["run_id"] for r in rows] == [r.id for r in plan.runs[5:] for _ in plan.baselines]


class Stop(Exception):
    pass


@pytest.mark.process
def test_an_interrupted_sweep_resumes_where_it_stopped(
    full: tuple[SweepPlan, Path, list[str]],
    scenario_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = plan_sweep(scenario_file, GRIDS, repeat=2)
    out = tmp_path / "sweep"
    seen: list[str] = []

    def stop_after_three(doc: dict[str, Any]) -> None:
        seen.append(doc["id"])
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):
        run_sweep(plan, out, executor=local_executor(2), on_result=stop_after_three)
    saved = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "runs").glob("*.json")}
    assert sorted(saved) == sorted(f"{rid}.json" for rid in seen)
    # What a writer killed mid-file leaves: a truncated result and a temporary file.
    todo = [r.id for r in plan.runs if r.id not in seen]
    (out / "runs" / f"{todo[0]}.json").write_text('{"format": 1, "id"', encoding="utf-8")
    (out / "runs" / f"{todo[1]}.json.tmp").write_text("{", encoding="utf-8")
    capsys.readouterr()

    args = ["sim", "sweep", str(scenario_file), *GRID_ARGS, "--repeat", "2", "--out", str(out)]
    assert main([*args, "--resume", "--workers", "2", "--quiet"]) == 0
    assert "ran 5, kept 3 saved" in capsys.readouterr().out
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "runs").glob("*.json")}
    assert sorted(after) == sorted(f"{r.id}.json" for r in plan.runs)
    assert {name: after[name] for name in saved} == saved
    assert not list((out / "runs").glob("*.tmp"))
    assert _without_wall(out / "sweep.csv") == _without_wall(full[1] / "sweep.csv")

    # A second resume has nothing left to do.
    assert main([*args, "--resume", "--quiet"]) == 0
    assert "ran 0, kept 8 saved" in capsys.readouterr().out
    # Resuming with another scenario would mix results.
    assert main([*args, "--resume", "--set", "cache.promise=adaptive"]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "cache.promise" in err and "adaptive" in err


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--grid", GRIDS[0], "--grid", "cache.hicache_ratio=1,3", "--repeat", "2"],
            ["cache.hicache_ratio", "3"],
        ),
        (["--grid", GRIDS[0], "--repeat", "2"], ["cache.hicache_ratio", "not swept"]),
        (
            [*GRID_ARGS, "--grid", "cache.promise=eager,adaptive", "--repeat", "2"],
            ["cache.promise", "not swept"],
        ),
        ([*GRID_ARGS, "--repeat", "3"], ["seeds", "[0, 1, 2]"]),
    ],
)
def test_resume_refuses_another_grid(
    finished: tuple[SweepPlan, Path, list[str]],
    scenario_file: Path,
    tmp_path: Path,
    args: list[str],
    needles: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "sweep"
    shutil.copytree(finished[1], out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["sim", "sweep", str(scenario_file), *args, "--out", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    line = err.strip()
    assert "\n" not in line and "--resume:" in line, err
    for needle in needles:
        assert needle in line, (needle, err)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing run or rewritten
    # The same grid given in another order is the same sweep.
    same = ["--grid", GRIDS[1], "--grid", GRIDS[0], "--repeat", "2"]
    assert main(["sim", "sweep", str(scenario_file), *same, "--out", str(out), "--resume", "--quiet"]) == 0


def test_an_unreachable_ray_address_fails_within_the_timeout() -> None:
    """Checked without Ray: the probe runs before ray.init, which would retry for minutes."""
    port = _closed_port()
    with pytest.raises(SweepError, match=rf"--ray-address: cannot reach the Ray cluster at 127.0.0.1:{port}"):
        check_ray_address(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(SweepError, match="--ray-address: cannot reach"):
        check_ray_address(f"ray://127.0.0.1:{port}", timeout_s=2)
    # A host that never answers (TEST-NET-1, RFC 5737): bounded by the timeout.
    start = time.monotonic()
    with pytest.raises(SweepError, match="--ray-address: cannot reach the Ray cluster at 192.0.2.1:6379"):
        check_ray_address("192.0.2.1:6379", timeout_s=0.5)
    assert time.monotonic() - start < 3
    with pytest.raises(SweepError, match="--ray-address: 'nonsense': expected HOST:PORT"):
        check_ray_address("nonsense")
    check_ray_address(None)
    check_ray_address("auto")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        check_ray_address(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=2)


def test_ray_executor_checks_its_address_first(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'hicache[ray]'")
    start = time.monotonic()
    with pytest.raises(SweepError, match="--ray-address: cannot reach"):
        ray_executor(f"127.0.0.1:{_closed_port()}", timeout_s=2)
    assert time.monotonic() - start < 5


def test_an_existing_folder_needs_resume(
    finished: tuple[SweepPlan, Path, list[str]], scenario_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = finished[1]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert main(["sim", "sweep", str(scenario_file), *GRID_ARGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--resume" in err and str(out) in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


@pytest.mark.parametrize(
    ("grid", "needles"),
    [
        ("cache.prefetch_policy=best_effort,nope", ["--grid", "cache.prefetch_policy", "'nope'"]),
        ("cache.hicache_ratio=2,-1", ["--grid", "cache.hicache_ratio", "-1"]),
        ("cache.no_such_knob=1,2", ["--grid", "cache.no_such_knob", "unknown key"]),
        ("cach.hicache_ratio=1", ["--grid", "cach.hicache_ratio", "unknown section"]),
        ("model.preset=llama-3-8b,gpt-9", ["--grid", "model.preset", "gpt-9"]),
        ("cache.hicache_ratio", ["--grid", "expected section.key=value1,value2"]),
        ("cache.hicache_ratio=1,,2", ["--grid", "cache.hicache_ratio", "empty value"]),
        ("cache.hicache_ratio=2,2", ["--grid", "cache.hicache_ratio", "more than once"]),
        ("seed=1,2", ["--grid", "seed", "--repeat"]),
    ],
)
def test_bad_grids_fail_first_naming_field_and_value(
    grid: str, needles: list[str], scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never"
    args = ["sim", "sweep", str(scenario_file), "--grid", "cache.promise=eager,adaptive", "--grid", grid]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()


def test_plan_rejects_conflicting_flags(scenario_file: Path, tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="--grid: cache.promise: given more than once"):
        plan_sweep(scenario_file, ["cache.promise=eager", "cache.promise=adaptive"])
    with pytest.raises(SweepError, match="--grid: cache.promise: also given with --set"):
        plan_sweep(scenario_file, ["cache.promise=eager,adaptive"], sets=["cache.promise=eager"])
    with pytest.raises(SweepError, match="--repeat: expected an integer >= 1, got 0"):
        plan_sweep(scenario_file, [], repeat=0)
    with pytest.raises(SweepError, match="--repeat: workload.seed"):
        plan_sweep(scenario_file, [], sets=["workload.seed=3"], repeat=2)
    with pytest.raises(SweepError, match="--executor: unknown executor 'slurm'"):
        from hicache.sim.sweep import make_executor

        make_executor("slurm")
    with pytest.raises(SweepError, match="--workers: expected an integer >= 1, got 0"):
        local_executor(0)


def test_run_ids_name_the_configuration_not_the_order(scenario_file: Path) -> None:
    a = plan_sweep(scenario_file, GRIDS, repeat=2)
    b = plan_sweep(scenario_file, list(reversed(GRIDS)), repeat=2)
    assert sorted(r.id for r in a.runs) == sorted(r.id for r in b.runs)
    by_id = {r.id: dict(r.overrides) for r in b.runs}
    assert all(by_id[r.id] == dict(r.overrides) for r in a.runs)
    assert plan_sweep(scenario_file, [], repeat=1).runs[0].seed == 0
    assert plan_sweep(scenario_file, [], sets=["seed=7"]).runs[0].seed == 7


@pytest.mark.process  # compares with `full`, run by a pool of two processes
def test_one_worker_runs_in_this_process_with_the_same_results(
    full: tuple[SweepPlan, Path, list[str]], scenario_file: Path, tmp_path: Path
) -> None:
    plan = plan_sweep(scenario_file, [GRIDS[0]], repeat=2)
    run_sweep(plan, tmp_path / "serial", executor=local_executor(1))
    for run in plan.runs:
        # The same configuration in the 2 x 2 sweep ran in the pool under another id.
        twin = next(
            r
            for r in full[0].runs
            if r.seed == run.seed and dict(r.overrides) == {**dict(run.overrides), "cache.hicache_ratio": 1}
        )
        mine = json.loads(run_path(tmp_path / "serial", run.id).read_text(encoding="utf-8"))
        pooled = json.loads(run_path(full[1], twin.id).read_text(encoding="utf-8"))
        for label in mine["baselines"]:
            assert _comparable(mine["baselines"][label]["summary"]) == _comparable(
                pooled["baselines"][label]["summary"]
            )
    data = read_sweep(tmp_path / "serial")
    assert data.fields == ("cache.prefetch_policy",) and len(data.runs) == 4


_WORD = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8)
_VALUE = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    _WORD,
    st.lists(_WORD, max_size=3),
    st.lists(st.integers(0, 10**6), max_size=3),
)


@given(
    st.lists(
        _VALUE,
        min_size=1,
        max_size=5,
        unique_by=lambda v: (type(v).__name__, json.dumps(v) if isinstance(v, list) else v),
    )
)
@settings(max_examples=examples(200), deadline=None)
def test_grid_values_round_trip_through_the_command_line(values: list[Any]) -> None:
    """Whatever values a grid holds, written as TOML and split back they are the same values,
    commas and quotes inside strings and arrays included."""
    grid = parse_grid("cache.knob=" + ",".join(to_toml(v) for v in values))
    assert grid.field == "cache.knob"
    assert len(grid.values) == len(values)
    for got, want in zip(grid.values, values, strict=True):
        assert type(got) is type(want)
        if isinstance(want, float) and math.isinf(want):
            assert got == want
        else:
            assert json.dumps(got) == json.dumps(want)


def test_ray_executor_without_ray_says_how_to_install() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(SweepError, match=r"pip install 'hicache\[ray\]'"):
            ray_executor()
    else:
        pytest.skip("Ray is installed; the message for a missing Ray cannot be shown")


@pytest.mark.process
def test_ray_sweep_equals_the_local_one(
    full: tuple[SweepPlan, Path, list[str]], scenario_file: Path, tmp_path: Path
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'hicache[ray]'")
    out = tmp_path / "ray"
    shutil.copytree(full[1], out)
    for path in (out / "runs").glob("*.json"):
        path.unlink()
    run_sweep(full[0], out, executor=ray_executor(), resume=True)
    assert _without_wall(out / "sweep.csv") == _without_wall(full[1] / "sweep.csv")
