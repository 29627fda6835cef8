"""Parameter sweeps: the cartesian product of `--grid` values x seeds, each a full simulation of
the scenario's baselines, run in parallel and saved one file per run so a sweep can resume.

Layout of a sweep folder:
- `sweep.json`: the plan (scenario file, `--set` overrides, grids, seeds, run ids, and the base
  scenario, which a resume must match);
- `runs/<id>.json`: one finished run (its overrides, seed, the scenario as run, and per baseline
  the summary and channels), written to a temporary name and renamed, so a file that exists is
  whole. The id is a hash of the run's grid overrides and seed, stable across processes;
- `sweep.csv`: rebuilt from the run files, one row per (run, baseline) in the plan's order (grid
  values as given, then seed, then the scenario's baselines): `run_id`, `seed`, the swept fields,
  `run` (the baseline, named as in `requests.csv`), then every scalar of the summary flattened
  (`ttft_s.p99`, `cached_tokens.l1`, ..., `wall_s`) and of the channels (`channels.<link>.bytes`,
  `.transfers`, `.utilization`), in a fixed column order; byte counts are integers. Only the
  `wall_s` cells (measured on the host) differ between two sweeps of the same configurations.

A run's results depend only on its scenario and seed; where and in which order runs execute
changes nothing. The local executor uses a process pool started by forkserver (or spawn): forking
a parent that has already run numba's or matplotlib's machinery is not safe, a fresh interpreter
per pool is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from hicache.sim.sweep_executors import (
    EXECUTORS,
    RAY_CONNECT_TIMEOUT_S,
    RAY_HINT,
    Executor,
    Finished,
    check_ray_address,
    execute_run,
    local_executor,
    make_executor,
    ray_endpoint,
    ray_executor,
    read_run,
    run_path,
    write_json,
)
from hicache.sim.sweep_plan import (
    FORMAT,
    Grid,
    SweepError,
    SweepPlan,
    SweepRun,
    cell,
    check_runnable,
    grid_error,
    parse_grid,
    plan_sweep,
    run_id,
    to_toml,
    toml_value,
)
from hicache.sim.sweep_table import (
    SUMMARY_ORDER,
    SweepData,
    flatten,
    read_sweep,
    sweep_rows,
    write_sweep_csv,
)

__all__ = [
    "EXECUTORS",
    "FORMAT",
    "RAY_CONNECT_TIMEOUT_S",
    "RAY_HINT",
    "SUMMARY_ORDER",
    "Executor",
    "Finished",
    "Grid",
    "SweepData",
    "SweepError",
    "SweepOutcome",
    "SweepPlan",
    "SweepRun",
    "cell",
    "check_ray_address",
    "check_runnable",
    "execute_run",
    "flatten",
    "grid_error",
    "local_executor",
    "make_executor",
    "parse_grid",
    "plan_sweep",
    "ray_endpoint",
    "ray_executor",
    "read_run",
    "read_sweep",
    "run_id",
    "run_path",
    "run_sweep",
    "sweep_rows",
    "to_toml",
    "toml_value",
    "write_json",
    "write_sweep_csv",
]


# --- the sweep ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class SweepOutcome:
    ran: tuple[str, ...]  # ids run now, in the order they finished
    skipped: tuple[str, ...]  # ids found complete (--resume)
    csv: Path


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    return f"{path or 'scenario'}: was {json.dumps(a, default=str)}, now {json.dumps(b, default=str)}"


def _show_values(values: Sequence[Any]) -> str:
    return "[" + ", ".join(to_toml(v) for v in values) + "]"


def _grid_difference(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two manifests' grids and seeds ("" when nothing): a resume that
    mixed them would leave runs of both sweeps in one folder and one sweep.csv. The order the
    grids are given in does not matter (run ids do not depend on it)."""
    now = json.loads(json.dumps(now, default=str))  # compared as sweep.json holds it
    was = {g["field"]: g["values"] for g in before.get("grid", [])}
    new = {g["field"]: g["values"] for g in now["grid"]}
    for field in [*was, *(f for f in new if f not in was)]:
        if field not in new:
            return f"--grid {field}: was {_show_values(was[field])}, now not swept"
        if field not in was:
            return f"--grid {field}: was not swept, now {_show_values(new[field])}"
        if was[field] != new[field]:
            return f"--grid {field}: was {_show_values(was[field])}, now {_show_values(new[field])}"
    if before.get("seeds") != now["seeds"]:
        return f"seeds: was {before.get('seeds')}, now {now['seeds']} (--repeat)"
    return ""


def _prepare(out: Path, plan: SweepPlan, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise SweepError(f"--out: {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise SweepError(
                f"--out: {out} exists and is not empty; use --resume to continue it or another --out"
            )
        try:
            before = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise SweepError(f"--resume: {out} holds no readable sweep.json; is it a sweep folder?") from None
        if before.get("base") != plan.base:
            detail = _first_difference(before.get("base"), plan.base)
            raise SweepError(f"--resume: {out} was swept over another scenario ({detail}); use another --out")
        detail = _grid_difference(before, plan.manifest())
        if detail:
            raise SweepError(f"--resume: {out} was swept over another grid ({detail}); use another --out")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    for stale in (out / "runs").glob("*.json.tmp"):  # a writer killed between write and rename
        stale.unlink()
    write_json(out / "sweep.json", plan.manifest())


def run_sweep(
    plan: SweepPlan,
    out: Path,
    *,
    executor: Executor | None = None,
    resume: bool = False,
    progress: bool = False,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> SweepOutcome:
    """Run every run of `plan` not yet saved under `out`, saving each as it finishes, then
    rebuild `sweep.csv`. `on_result` hears of each saved run (an exception from it stops the
    sweep; what was saved stays, for `resume`)."""
    execute = executor or local_executor()
    _prepare(out, plan, resume)
    todo, skipped = [], []
    for run in plan.runs:
        if resume and read_run(out, run) is not None:
            skipped.append(run.id)
        else:
            todo.append(run)
    ran: list[str] = []
    failures: list[Finished] = []
    bar = tqdm(total=len(plan.runs), initial=len(skipped), desc="runs", unit="run", disable=not progress)
    try:
        for finished in execute(todo):
            bar.update(1)
            if finished.doc is None:
                failures.append(finished)
                continue
            write_json(run_path(out, finished.id), finished.doc)
            ran.append(finished.id)
            if on_result is not None:
                on_result(finished.doc)
    finally:
        bar.close()
        csv_path = write_sweep_csv(out, plan)
    if failures:
        ids = ", ".join(f.id for f in failures)
        raise SweepError(
            f"{len(failures)} run(s) failed ({ids}); the first: {failures[0].error}; "
            "the others are saved: rerun with --resume"
        )
    return SweepOutcome(tuple(ran), tuple(skipped), csv_path)
