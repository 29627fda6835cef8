"""A sweep's plan: `--grid` specs parsed, the cartesian product of their values x seeds, each run
named by a stable hash of its overrides and seed, and the base scenario a resume must match."""

import hashlib
import itertools
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from hicache.scenarios.scenario import Scenario, ScenarioError, load_scenario
from hicache.sim.setup import setups

FORMAT = 1


class SweepError(ValueError):
    """Bad sweep input or state; the message names the flag or field and what was expected."""


# --- grids ----------------------------------------------------------------------------------


def toml_value(raw: str) -> Any:
    """`raw` as a TOML value, as `--set` reads it: text that is not valid TOML is a string."""
    try:
        parsed = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError:
        return raw.strip()
    return parsed["value"] if list(parsed) == ["value"] else raw.strip()


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets, braces and quotes, so array values survive."""
    parts, depth, quote, start, escaped = [], 0, "", 0, False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':  # basic strings have escapes, literal ones none
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


@attrs.frozen(slots=True)
class Grid:
    """One swept field and the values it takes, in the order given."""

    field: str
    values: tuple[Any, ...]

    def overrides(self) -> list[str]:
        return [f"{self.field}={to_toml(v)}" for v in self.values]


def parse_grid(spec: str, flag: str = "--grid") -> Grid:
    """`section.key=v1,v2,...` (each value TOML, like `--set`) as a `Grid`."""
    if "=" not in spec:
        raise SweepError(f"{flag}: {spec!r}: expected section.key=value1,value2,...")
    field, raw = (part.strip() for part in spec.split("=", 1))
    path = field.split(".")
    if not field or not all(part.strip() for part in path) or len(path) > 2:
        raise SweepError(f"{flag}: {spec!r}: expected section.key (or name) before '='")
    if field == "seed":
        raise SweepError(f"{flag}: seed: sweep seeds with --repeat N (seeds 0..N-1)")
    texts = _split_values(raw)
    if any(not t.strip() for t in texts):
        raise SweepError(f"{flag}: {field}: empty value in {raw!r}; expected value1,value2,...")
    values = tuple(toml_value(t) for t in texts)
    for i, v in enumerate(values):
        if any(type(w) is type(v) and w == v for w in values[:i]):
            raise SweepError(f"{flag}: {field}: value {to_toml(v)} is listed more than once")
    return Grid(field, values)


def to_toml(value: Any) -> str:
    """A value in TOML syntax (the inverse of `toml_value` for the types scenarios use)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float | str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(to_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {to_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def cell(value: Any) -> str:
    """A swept value as a CSV cell: strings as they are, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


# --- the plan -------------------------------------------------------------------------------


def run_id(overrides: Mapping[str, Any], seed: int) -> str:
    """A stable name for one run: a hash of its swept values and seed (not of the order the
    grids were given in)."""
    key = json.dumps({"overrides": sorted(overrides.items()), "seed": seed}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@attrs.frozen(slots=True)
class SweepRun:
    """One simulation of a sweep: the resolved scenario travels as plain data, so a worker
    on another machine needs neither the scenario file nor the overrides."""

    id: str
    seed: int
    overrides: tuple[tuple[str, Any], ...]
    scenario: dict[str, Any] = attrs.field(eq=False, repr=False)
    source: str = ""


@attrs.frozen(slots=True)
class SweepPlan:
    """Every run of a sweep, validated."""

    scenario_path: str
    sets: tuple[str, ...]
    grids: tuple[Grid, ...]
    seeds: tuple[int, ...]
    baselines: tuple[str, ...]
    base: dict[str, Any] = attrs.field(eq=False, repr=False)  # the scenario with --set, no seed
    runs: tuple[SweepRun, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(g.field for g in self.grids)

    def manifest(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "scenario_path": self.scenario_path,
            "sets": list(self.sets),
            "grid": [{"field": g.field, "values": list(g.values)} for g in self.grids],
            "seeds": list(self.seeds),
            "baselines": list(self.baselines),
            "runs": [r.id for r in self.runs],
            "base": self.base,
        }


def grid_error(
    exc: ScenarioError, grids: Sequence[Grid], combo: Mapping[str, Any], flag: str = "--grid"
) -> SweepError:
    """Attribute a scenario error to the grid field it concerns, else name the combination."""
    for g in grids:
        if exc.field is not None and (g.field == exc.field or g.field.startswith(exc.field + ".")):
            value = combo[g.field]
            shown = "" if repr(value) in exc.detail else f" (value {to_toml(value)})"
            return SweepError(f"{flag}: {g.field}: {exc.detail}{shown}")
    where = ", ".join(f"{k}={to_toml(v)}" for k, v in combo.items())
    return SweepError(f"{exc} (in the run with {where})" if where else str(exc))


def check_runnable(scenario: Scenario) -> None:
    """What the simulator resolves beyond the scenario file: presets, baselines, the trace."""
    setups(scenario)
    if scenario.workload.kind == "trace" and not Path(scenario.workload.path).exists():
        detail = f"no such file or directory: '{scenario.workload.path}'"
        raise ScenarioError(scenario.source, "workload.path", detail)


def plan_sweep(
    scenario_path: str | Path,
    grids: Sequence[Grid | str],
    sets: Sequence[str] = (),
    repeat: int | None = None,
) -> SweepPlan:
    """Every (combination, seed) of the sweep, each loaded and checked before anything runs, so
    a bad field or value fails first, by name. `repeat`: seeds 0..repeat-1 as the scenario's
    top-level `seed`; None: the scenario's own seed, once."""
    grids = tuple(parse_grid(g) if isinstance(g, str) else g for g in grids)
    fields = [g.field for g in grids]
    for i, f in enumerate(fields):
        if f in fields[:i]:
            raise SweepError(f"--grid: {f}: given more than once; list all its values in one --grid")
    try:
        base_scenario = load_scenario(scenario_path, sets)
        check_runnable(base_scenario)
    except ScenarioError as exc:
        raise SweepError(str(exc)) from None
    set_fields = {item.split("=", 1)[0].strip() for item in sets}
    for f in fields:
        if f in set_fields:
            raise SweepError(f"--grid: {f}: also given with --set; give it in one place")
    if repeat is not None:
        if repeat < 1:
            raise SweepError(f"--repeat: expected an integer >= 1, got {repeat}")
        if "seed" in set_fields:
            raise SweepError("--repeat: seeds come from --repeat (0..N-1); drop --set seed=...")
        if repeat > 1 and base_scenario.workload.kind == "trace":
            raise SweepError("--repeat: a trace workload does not depend on the seed; repeats would be equal")
        if repeat > 1 and base_scenario.workload.seed is not None:
            raise SweepError(
                "--repeat: workload.seed fixes the generator's seed, so repeats would be equal; "
                "remove workload.seed to vary the workload with the scenario's seed"
            )
    seeds = tuple(range(repeat)) if repeat is not None else (base_scenario.seed,)
    runs = []
    for values in itertools.product(*(g.values for g in grids)):
        combo = dict(zip(fields, values, strict=True))
        overrides = [f"{f}={to_toml(v)}" for f, v in combo.items()]
        for seed in seeds:
            try:
                scenario = load_scenario(scenario_path, [*sets, *overrides, f"seed={seed}"])
                check_runnable(scenario)
            except ScenarioError as exc:
                raise grid_error(exc, grids, combo) from None
            runs.append(
                SweepRun(run_id(combo, seed), seed, tuple(combo.items()), scenario.to_dict(), scenario.source)
            )
    base = base_scenario.to_dict()
    base.pop("seed")
    return SweepPlan(
        str(scenario_path), tuple(sets), grids, seeds, base_scenario.run.baselines, base, tuple(runs)
    )
