"""Capacity search: the highest request rate a configuration serves within its SLOs (Mooncake's
"effective request capacity"), found by bisection over a scale of the arrival rate.

Scaling by `s` multiplies every arrival time by 1/s and keeps everything else: a trace's
`time_scale` is divided by `s`; a generator's `rate` is multiplied by `s` and its gaps inside a
session (`think_time`, `tool_time`) divided by `s`. Generators draw the same random numbers at
every rate, so the scaled workload is the same requests, closer together. (`run.until`, when set,
still cuts arrivals at that many seconds, now of the scaled workload.)

The search runs on a geometric grid `lo * (1 + tol)^k` (ending at `hi`), so the answer is always
a scale that was simulated and passed: where the SLO verdict is not monotone in the load, the
result is still a passing scale, the highest the bisection saw pass.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import BASELINES, Scenario, ScenarioError, load_scenario
from hicache.scenarios.workload import WorkItem
from hicache.sim.runner import run_baselines
from hicache.sim.sweep import SweepError, cell, check_runnable, grid_error, parse_grid, to_toml

_METRIC = re.compile(r"^(ttft|tpot|e2e)(?:_s)?[._](mean|p50|p90|p99)$")
_LIMIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us)?\s*$")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1.0}
SESSION_GAPS = ("think_time", "tool_time")  # seconds inside a session: shrink as the rate grows


class CapacityError(SweepError):
    """Bad capacity-search input; the message names the flag and the value."""


# --- SLOs -----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Slo:
    """Upper limits (seconds) on summary metrics, by dotted key (`ttft_s.p90`). A run meets it
    when every request completed and every metric is at or below its limit."""

    limits: tuple[tuple[str, float], ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.limits)

    def met(self, summary: Mapping[str, Any]) -> bool:
        if summary["completed"] != summary["requests"]:
            return False
        for key, limit in self.limits:
            value = metric(summary, key)
            if value is None or value > limit:
                return False
        return True

    def describe(self) -> str:
        return ", ".join(f"{k} <= {_seconds(v)}" for k, v in self.limits)


def metric(summary: Mapping[str, Any], key: str) -> Any:
    """A summary value by dotted key (`ttft_s.p90`)."""
    value: Any = summary
    for part in key.split("."):
        value = value[part]
    return value


def _seconds(value: float) -> str:
    return f"{value * 1e3:g}ms" if value < 1 else f"{value:g}s"


def parse_slo(spec: str, flag: str = "--slo") -> Slo:
    """`ttft_p90=2s,tpot_p90=100ms` (metrics ttft, tpot, e2e with mean, p50, p90, p99; limits in
    s, ms or us, seconds when bare) as an `Slo`."""
    limits: dict[str, float] = {}
    for item in spec.split(","):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise CapacityError(f"{flag}: {item.strip()!r}: expected METRIC=LIMIT, e.g. ttft_p90=2s")
        found = _METRIC.match(name)
        if found is None:
            raise CapacityError(
                f"{flag}: {name}: unknown metric; expected ttft, tpot or e2e with mean, p50, p90 or "
                "p99, e.g. ttft_p90 or tpot_s.mean"
            )
        key = f"{found.group(1)}_s.{found.group(2)}"
        value = _LIMIT.match(raw)
        if value is None:
            raise CapacityError(f"{flag}: {name}: {raw.strip()!r}: expected a time such as 2s, 100ms or 0.5")
        seconds = float(value.group(1)) * _UNITS[value.group(2)]
        if not math.isfinite(seconds) or seconds <= 0:
            raise CapacityError(f"{flag}: {name}: expected a limit > 0, got {raw.strip()!r}")
        if key in limits:
            raise CapacityError(f"{flag}: {name}: given more than once")
        limits[key] = seconds
    return Slo(tuple(limits.items()))


# --- scaling the load -----------------------------------------------------------------------


def scale_workload(scenario: Scenario, scale: float) -> Scenario:
    """The scenario with every arrival time multiplied by 1/`scale`."""
    if not scale > 0 or not math.isfinite(scale):
        raise CapacityError(f"scale: expected a finite number > 0, got {scale!r}")
    w = scenario.workload
    if w.kind == "trace":
        return attrs.evolve(scenario, workload=attrs.evolve(w, time_scale=w.time_scale / scale))
    params = dict(w.params)
    params["rate"] = params["rate"] * scale
    for key in SESSION_GAPS:
        if key in params:
            params[key] = params[key] / scale
    return attrs.evolve(scenario, workload=attrs.evolve(w, params=tuple(params.items())))


def request_rate(items: Sequence[WorkItem]) -> float | None:
    """Requests per second over the span of arrivals (None with fewer than two distinct times)."""
    if len(items) < 2:
        return None
    span = max(i.arrival for i in items) - min(i.arrival for i in items)
    return len(items) / span if span > 0 else None


def simulator(scenario: Scenario, baseline: str) -> Callable[[float], dict[str, Any]]:
    """An evaluator for `find_capacity`: the summary of `baseline` at a scale, plus the
    workload's `request_rate`; each scale is simulated once."""
    runs = attrs.evolve(scenario, run=attrs.evolve(scenario.run, baselines=(baseline,)))
    seen: dict[float, dict[str, Any]] = {}

    def evaluate(scale: float) -> dict[str, Any]:
        if scale not in seen:
            scaled = scale_workload(runs, scale)
            items = build_workload(scaled)
            summary = run_baselines(scaled, items)[baseline].summary
            seen[scale] = {**summary, "request_rate": request_rate(items)}
        return seen[scale]

    return evaluate


# --- the search -----------------------------------------------------------------------------


def scale_grid(lo: float, hi: float, tol: float) -> tuple[float, ...]:
    """`lo * (1 + tol)^k` below `hi`, then `hi`: neighbours differ by at most a factor 1 + tol."""
    for flag, value in (("--lo", lo), ("--hi", hi), ("--tol", tol)):
        if not (math.isfinite(value) and value > 0):
            raise CapacityError(f"{flag}: expected a finite number > 0, got {value!r}")
    if hi <= lo:
        raise CapacityError(f"--hi: expected a scale above --lo ({lo:g}), got {hi:g}")
    steps = math.ceil(math.log(hi / lo) / math.log1p(tol) - 1e-9)
    return (*(lo * (1 + tol) ** k for k in range(steps)), hi)


@attrs.frozen(slots=True)
class Probe:
    scale: float
    passed: bool
    summary: dict[str, Any] = attrs.field(repr=False, eq=False)


@attrs.frozen(slots=True)
class Capacity:
    """The result of one search: `scale` is the highest scale that passed (None: not even `lo`);
    `hit_hi`: `hi` itself passed, so the capacity may be higher."""

    scale: float | None
    hit_hi: bool
    probes: tuple[Probe, ...]  # in the order simulated

    @property
    def at(self) -> Probe | None:
        return next((p for p in self.probes if p.passed and p.scale == self.scale), None)


def find_capacity(
    evaluate: Callable[[float], Mapping[str, Any]],
    slo: Slo,
    lo: float = 0.1,
    hi: float = 10.0,
    tol: float = 0.05,
    on_probe: Callable[[Probe], None] | None = None,
) -> Capacity:
    """Bisection over `scale_grid(lo, hi, tol)`: `lo` and `hi` first, then the middle index of
    the bracket until the passing and failing scales are neighbours on the grid."""
    grid = scale_grid(lo, hi, tol)
    probes: dict[int, Probe] = {}

    def passes(i: int) -> bool:
        if i not in probes:
            summary = dict(evaluate(grid[i]))
            probes[i] = Probe(grid[i], slo.met(summary), summary)
            if on_probe is not None:
                on_probe(probes[i])
        return probes[i].passed

    last = len(grid) - 1
    if not passes(0):
        return Capacity(None, False, tuple(probes.values()))
    if passes(last):
        return Capacity(grid[last], True, tuple(probes.values()))
    good, bad = 0, last
    while bad - good > 1:
        mid = (good + bad) // 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    best = max(p.scale for p in probes.values() if p.passed)
    return Capacity(best, False, tuple(probes.values()))


# --- policy variants ------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Variant:
    """One configuration to search: the policy overrides and the scenario they give."""

    label: str
    overrides: tuple[tuple[str, Any], ...]
    scenario: Scenario = attrs.field(eq=False, repr=False)


def plan_variants(
    scenario_path: str | Path,
    policies: Sequence[str] = (),
    sets: Sequence[str] = (),
    baseline: str = "l1_l2_l3",
) -> list[Variant]:
    """Every combination of `--policies` values (one variant when none), each loaded and
    checked before anything runs."""
    if baseline not in BASELINES:
        raise CapacityError(
            f"--baseline: unknown baseline {baseline!r}; expected one of: {', '.join(BASELINES)}"
        )
    grids = [parse_grid(p, "--policies") for p in policies]
    fields = [g.field for g in grids]
    for i, f in enumerate(fields):
        if f in fields[:i]:
            raise CapacityError(
                f"--policies: {f}: given more than once; list all its values in one --policies"
            )
    only = f'run.baselines=["{baseline}"]'
    out = []
    for values in itertools.product(*(g.values for g in grids)):
        combo = dict(zip(fields, values, strict=True))
        overrides = [f"{f}={to_toml(v)}" for f, v in combo.items()]
        try:
            scenario = load_scenario(scenario_path, [*sets, *overrides, only])
            check_runnable(scenario)
        except ScenarioError as exc:
            raise grid_error(exc, grids, combo, "--policies") from None
        label = ", ".join(f"{f}={cell(v)}" for f, v in combo.items()) or scenario.name
        out.append(Variant(label, tuple(combo.items()), scenario))
    return out


def search_capacity(
    variant: Variant,
    slo: Slo,
    *,
    baseline: str = "l1_l2_l3",
    lo: float = 0.1,
    hi: float = 10.0,
    tol: float = 0.05,
    on_probe: Callable[[Probe], None] | None = None,
) -> Capacity:
    return find_capacity(simulator(variant.scenario, baseline), slo, lo, hi, tol, on_probe)


# --- output ---------------------------------------------------------------------------------


def format_capacity(results: Sequence[tuple[Variant, Capacity]], slo: Slo, lo: float) -> str:
    """The table printed after a search: capacity in requests/s and scale, and the SLO's
    metrics at that scale."""
    width = max([len("policy"), *(len(v.label) for v, _ in results)]) + 2
    head = f"{'policy':<{width}}{'req/s':>10}{'scale':>9}" + "".join(f"{k:>13}" for k in slo.keys)
    lines = [head + f"{'probes':>8}"]
    for variant, cap in results:
        at = cap.at
        if cap.scale is None or at is None:
            row = f"{variant.label:<{width}}{'-':>10}{'< ' + format(lo, 'g'):>9}" + "".join(
                f"{'-':>13}" for _ in slo.keys
            )
        else:
            rate = at.summary.get("request_rate")
            shown = "-" if rate is None else f"{rate:.3f}"
            scale = (">=" if cap.hit_hi else "") + f"{cap.scale:.4g}"
            row = f"{variant.label:<{width}}{shown:>10}{scale:>9}" + "".join(
                f"{metric(at.summary, k):>13.4f}" for k in slo.keys
            )
        lines.append(row + f"{len(cap.probes):>8}")
    lines.append(f"(SLO: {slo.describe()}; every request completed; metrics in seconds)")
    return "\n".join(lines)


def capacity_doc(
    results: Sequence[tuple[Variant, Capacity]],
    slo: Slo,
    *,
    scenario_path: str,
    sets: Sequence[str],
    baseline: str,
    lo: float,
    hi: float,
    tol: float,
) -> dict[str, Any]:
    """What `capacity.json` holds: the search's inputs and, per variant, the capacity, the
    summary at capacity and every probe."""
    variants = []
    for variant, cap in results:
        at = cap.at
        variants.append(
            {
                "label": variant.label,
                "overrides": dict(variant.overrides),
                "scale": cap.scale,
                "request_rate": None if at is None else at.summary.get("request_rate"),
                "hit_hi": cap.hit_hi,
                "summary": None if at is None else at.summary,
                "probes": [
                    {
                        "scale": p.scale,
                        "passed": p.passed,
                        "request_rate": p.summary.get("request_rate"),
                        **{k: metric(p.summary, k) for k in slo.keys},
                    }
                    for p in sorted(cap.probes, key=lambda p: p.scale)
                ],
            }
        )
    return {
        "scenario_path": scenario_path,
        "sets": list(sets),
        "baseline": baseline,
        "slo": dict(slo.limits),
        "lo": lo,
        "hi": hi,
        "tol": tol,
        "variants": variants,
    }
