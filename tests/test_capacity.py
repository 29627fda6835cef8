"""Capacity search: the answer is a scale that passed, bisection stops one grid step below a
failure, a looser SLO never lowers the capacity, and scaling the load only moves arrivals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.cli import main
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario, parse_scenario
from hicache.sim.capacity import (
    CapacityError,
    Slo,
    find_capacity,
    parse_slo,
    request_rate,
    scale_grid,
    scale_workload,
    simulator,
)

# TTFT grows with load here: long prompts on a one-GPU prefill node queue up as the rate rises.
LOADED: dict[str, Any] = {
    "name": "loaded",
    "workload": {
        "kind": "multiturn",
        "conversations": 20,
        "turns": 2,
        "system_prompt": 512,
        "user_tokens": [2000, 4000],
        "output_tokens": [32, 64],
        "rate": 1.0,
        "think_time": 4.0,
    },
    "model": {"preset": "llama-3-8b"},
    "hardware": {"gpus_per_node": 1},
    "cache": {"l1_tokens": 200_000, "hicache_ratio": 1.0},
    "run": {"baselines": ["l1_l2_l3"]},
}
TOL = 0.05


def _summary(**metrics: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": 1, "completed": 1}
    for key, value in metrics.items():
        name, stat = key.rsplit("_", 1)
        out.setdefault(f"{name}_s", {})[stat] = value
    return out


# --- the search on synthetic loads ----------------------------------------------------------


@given(
    knee=st.floats(0.05, 20.0),
    steep=st.floats(0.5, 4.0),
    limits=st.lists(st.floats(0.01, 100.0), min_size=2, max_size=5),
    tol=st.sampled_from([0.02, 0.05, 0.2]),
)
@settings(max_examples=examples(150), deadline=None)
def test_capacity_on_a_monotone_load_is_the_last_grid_step_that_passes(
    knee: float, steep: float, limits: list[float], tol: float
) -> None:
    def evaluate(scale: float) -> dict[str, Any]:
        return _summary(ttft_p90=(scale / knee) ** steep)

    grid = scale_grid(0.1, 10.0, tol)
    found = []
    for limit in sorted(limits):
        slo = Slo((("ttft_s.p90", limit),))
        cap = find_capacity(evaluate, slo, 0.1, 10.0, tol)
        passing = [s for s in grid if slo.met(evaluate(s))]
        assert cap.scale == (max(passing) if passing else None)
        if cap.scale is not None:
            assert cap.at is not None and cap.at.passed and cap.scale in grid
            assert cap.hit_hi == (cap.scale == 10.0)
            if not cap.hit_hi:
                assert not slo.met(evaluate(cap.scale * (1 + tol)))
        assert len(cap.probes) <= 2 + math.ceil(math.log2(len(grid)))
        found.append(cap.scale or 0.0)
    assert found == sorted(found)  # a looser SLO never gives a lower capacity


@given(verdicts=st.lists(st.booleans(), min_size=2, max_size=200))
@settings(max_examples=examples(150), deadline=None)
def test_capacity_is_a_scale_that_passed_even_when_the_load_is_not_monotone(verdicts: list[bool]) -> None:
    grid = scale_grid(0.1, 10.0, TOL)
    by_scale = {s: verdicts[i % len(verdicts)] for i, s in enumerate(grid)}

    def evaluate(scale: float) -> dict[str, Any]:
        return _summary(ttft_p90=0.5 if by_scale[scale] else 2.0)

    cap = find_capacity(evaluate, parse_slo("ttft_p90=1s"), 0.1, 10.0, TOL)
    passed = [p.scale for p in cap.probes if p.passed]
    if cap.scale is None:
        assert not by_scale[grid[0]] and passed == []
    else:
        assert by_scale[cap.scale] and cap.scale == max(passed)
        assert len({p.scale for p in cap.probes}) == len(cap.probes)  # no scale simulated twice


def test_a_run_with_unfinished_requests_or_no_metric_misses_the_slo() -> None:
    slo = parse_slo("ttft_p90=1s")
    assert slo.met(_summary(ttft_p90=0.5))
    assert not slo.met({**_summary(ttft_p90=0.5), "completed": 0})
    assert not slo.met(_summary(ttft_p90=None))
    assert not slo.met(_summary(ttft_p90=1.5))


@pytest.mark.parametrize(
    ("spec", "limits"),
    [
        ("ttft_p90=2s,tpot_p90=100ms", {"ttft_s.p90": 2.0, "tpot_s.p90": 0.1}),
        ("ttft_s.mean=0.5", {"ttft_s.mean": 0.5}),
        ("e2e_p99 = 1500 ms", {"e2e_s.p99": 1.5}),
        ("tpot_p50=250us", {"tpot_s.p50": 250e-6}),
    ],
)
def test_slo_parsing(spec: str, limits: dict[str, float]) -> None:
    assert dict(parse_slo(spec).limits) == pytest.approx(limits)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("ttft_p95=2s", "ttft_p95: unknown metric"),
        ("hit_rate=0.5", "hit_rate: unknown metric"),
        ("ttft_p90=2h", "ttft_p90: '2h'"),
        ("ttft_p90=0ms", "ttft_p90: expected a limit > 0"),
        ("ttft_p90", "'ttft_p90': expected METRIC=LIMIT"),
        ("ttft_p90=1,ttft_p90=2", "ttft_p90: given more than once"),
    ],
)
def test_bad_slos_name_the_metric(spec: str, needle: str) -> None:
    with pytest.raises(CapacityError, match="--slo: " + needle.replace("(", r"\(")):
        parse_slo(spec)


def test_bad_bounds_name_the_flag() -> None:
    with pytest.raises(CapacityError, match="--hi: expected a scale above --lo"):
        scale_grid(2.0, 1.0, 0.05)
    with pytest.raises(CapacityError, match="--tol: expected a finite number > 0"):
        scale_grid(0.1, 10.0, 0.0)
    grid = scale_grid(0.1, 10.0, 0.05)
    assert grid[0] == 0.1 and grid[-1] == 10.0
    assert all(1 < b / a <= 1.05 + 1e-12 for a, b in zip(grid, grid[1:], strict=False))


# --- scaling the load -----------------------------------------------------------------------


def _scenario(workload: dict[str, Any]) -> Scenario:
    return parse_scenario({"workload": workload, "cache": {"l1_tokens": 20_000}}, "scale.toml")


@pytest.mark.parametrize(
    "workload",
    [
        {"kind": "multiturn", "conversations": 6, "turns": 3, "rate": 2.0, "think_time": 5.0},
        {"kind": "agentic", "sessions": 4, "steps": 3, "rate": 1.0, "tool_time": 2.0},
        {"kind": "shared_prefix", "groups": 2, "prompts_per_group": 5, "rate": 3.0},
    ],
)
@given(scale=st.floats(0.05, 50.0))
@settings(max_examples=examples(10), deadline=None)
def test_scaling_moves_arrivals_and_nothing_else(workload: dict[str, Any], scale: float) -> None:
    base = build_workload(_scenario(workload))
    scaled = build_workload(scale_workload(_scenario(workload), scale))
    assert [(i.id, i.prompt_len, i.output_len, i.session) for i in scaled] == [
        (i.id, i.prompt_len, i.output_len, i.session) for i in base
    ]
    for a, b in zip(base, scaled, strict=True):
        assert np.array_equal(a.prompt, b.prompt)
        assert b.arrival == pytest.approx(a.arrival / scale, rel=1e-9, abs=1e-12)
    assert request_rate(scaled) == pytest.approx(request_rate(base) * scale, rel=1e-9)


def test_a_trace_scales_by_its_time_scale() -> None:
    doc = {"workload": {"kind": "trace", "path": "t.jsonl", "time_scale": 2.0}}
    trace = parse_scenario(doc, "/nowhere/x.toml")
    assert scale_workload(trace, 4.0).workload.time_scale == 0.5
    with pytest.raises(CapacityError, match="scale"):
        scale_workload(trace, 0.0)


# --- the search on the simulator ------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded() -> Any:
    """One evaluator for the module: each scale is simulated once whatever the SLO."""
    return simulator(parse_scenario(LOADED, "loaded.toml"), "l1_l2_l3")


def test_simulated_capacity_meets_the_slo_and_grows_with_it(loaded: Any) -> None:
    capacities = []
    for limit in (0.15, 0.3, 0.6, 1.2, 2.5):
        slo = Slo((("ttft_s.p90", limit), ("tpot_s.p90", 0.1)))
        cap = find_capacity(loaded, slo, 0.1, 10.0, TOL)
        assert cap.scale is not None, limit
        assert slo.met(loaded(cap.scale))
        if not cap.hit_hi:
            assert not slo.met(loaded(cap.scale * (1 + 2 * TOL))), limit
        capacities.append(cap.scale)
    assert capacities == sorted(capacities)
    assert capacities[0] < capacities[-1]  # the load matters here, so the SLO does
    rate = loaded(1.0)["request_rate"]
    assert loaded(2.0)["request_rate"] == pytest.approx(2 * rate, rel=1e-9)


def test_capacity_command_compares_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "loaded.toml"
    doc = {k: v for k, v in LOADED.items() if k != "run"}
    scenario.write_text(_toml(doc), encoding="utf-8")
    out = tmp_path / "cap"
    args = ["sim", "capacity", str(scenario), "--slo", "ttft_p90=500ms,tpot_p90=100ms", "--tol", "0.1"]
    assert main([*args, "--policies", "cache.promise=eager,adaptive", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "cache.promise=eager" in printed and "cache.promise=adaptive" in printed and "req/s" in printed
    saved = json.loads((out / "capacity.json").read_text(encoding="utf-8"))
    assert saved["baseline"] == "l1_l2_l3" and saved["slo"] == {"ttft_s.p90": 0.5, "tpot_s.p90": 0.1}
    assert [v["label"] for v in saved["variants"]] == ["cache.promise=eager", "cache.promise=adaptive"]
    slo = parse_slo("ttft_p90=500ms,tpot_p90=100ms")
    for variant in saved["variants"]:
        assert variant["scale"] is not None and not variant["hit_hi"]
        assert slo.met(variant["summary"])
        assert variant["request_rate"] == variant["summary"]["request_rate"] > 0
        verdicts = {p["scale"]: p["passed"] for p in variant["probes"]}
        assert verdicts[variant["scale"]] and max(s for s, ok in verdicts.items() if ok) == variant["scale"]
    eager = parse_scenario({**doc, "cache": {**doc["cache"], "promise": "eager"}}, str(scenario))
    direct = find_capacity(simulator(eager, "l1_l2_l3"), slo, 0.1, 10.0, 0.1)
    assert saved["variants"][0]["scale"] == direct.scale


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--slo", "ttft_p99=fast"], "--slo: ttft_p99"),
        (["--slo", "ttft_p90=1s", "--policies", "cache.promise=eager,hopeful"], "--policies: cache.promise"),
        (["--slo", "ttft_p90=1s", "--baseline", "l4"], "--baseline: unknown baseline 'l4'"),
        (["--slo", "ttft_p90=1s", "--lo", "3", "--hi", "2"], "--hi"),
    ],
)
def test_capacity_command_rejects_bad_input(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "loaded.toml"
    scenario.write_text(_toml(LOADED), encoding="utf-8")
    assert main(["sim", "capacity", str(scenario), *extra, "--out", str(tmp_path / "cap")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "cap").exists()


def _toml(doc: dict[str, Any]) -> str:
    """A scenario document as TOML (tables of scalars and arrays)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def test_scaled_scenarios_stay_valid() -> None:
    s = parse_scenario(LOADED, "loaded.toml")
    scaled = scale_workload(s, 3.0)
    params = scaled.workload.generator_params()
    assert params["rate"] == 3.0 and params["think_time"] == pytest.approx(4.0 / 3.0)
    assert parse_scenario(scaled.to_dict(), "loaded.toml") == scaled
    assert attrs.evolve(scaled, workload=s.workload) == s
