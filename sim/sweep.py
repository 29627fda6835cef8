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

import csv
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import socket
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from hicache.scenarios.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from hicache.sim.runner import run_baselines
from hicache.sim.setup import setups

FORMAT = 1
EXECUTORS = ("local", "ray")
RAY_HINT = "pip install 'hicache[ray]'"
RAY_CONNECT_TIMEOUT_S = 10.0
# The summary's keys in the order sweep.csv lists them (hicache.results.summarize and the
# cluster's additions); keys not listed follow, alphabetically, so the columns never depend on
# which runs are present.
SUMMARY_ORDER = (
    "requests",
    "completed",
    "failed",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "prefill_cached_tokens",
    "pd_transfer_bytes",
    "fallback_tokens",
    "retractions",
    "events",
    "core_events",
    "simulated_s",
    "wall_s",
    "faults_injected",
    "channels",
)


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


# --- one run --------------------------------------------------------------------------------


def execute_run(run: SweepRun) -> dict[str, Any]:
    """Simulate one run (every baseline of its scenario); the document its file holds."""
    scenario = parse_scenario(run.scenario, run.source)
    start = time.perf_counter()
    results = run_baselines(scenario)
    wall = time.perf_counter() - start
    return {
        "format": FORMAT,
        "id": run.id,
        "seed": run.seed,
        "overrides": dict(run.overrides),
        "scenario": run.scenario,
        "baselines": {k: {"summary": r.summary, "channels": r.channels} for k, r in results.items()},
        "wall_s": wall,
    }


def run_path(out: Path, rid: str) -> Path:
    return out / "runs" / f"{rid}.json"


def write_json(path: Path, doc: Any) -> None:
    """Write to a temporary name, then rename: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_run(out: Path, run: SweepRun) -> dict[str, Any] | None:
    """The saved result of `run`, or None when there is none or it is not whole (every baseline
    of its scenario with a summary)."""
    baselines = run.scenario["run"]["baselines"]
    try:
        doc = json.loads(run_path(out, run.id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("id") != run.id or doc.get("format") != FORMAT:
        return None
    saved = doc.get("baselines")
    if not isinstance(saved, dict) or any(
        not isinstance(saved.get(b), dict) or "summary" not in saved[b] for b in baselines
    ):
        return None
    return doc


# --- executors ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Finished:
    """What an executor reports for one run: its document, or the error that ended it."""

    id: str
    doc: dict[str, Any] | None = attrs.field(repr=False)
    error: str | None = None


Executor = Callable[[Sequence[SweepRun]], Iterator[Finished]]


def _attempt(run: SweepRun) -> Finished:
    try:
        return Finished(run.id, execute_run(run))
    except Exception as exc:  # a failing run stops no other run
        return Finished(run.id, None, repr(exc))


def _pool_context() -> multiprocessing.context.BaseContext:
    if sys.platform != "win32" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # The server imports the simulator once; each worker forks from that clean interpreter
        # (which has run no numba kernel and started no thread) instead of importing it again.
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def local_executor(workers: int | None = None) -> Executor:
    """Runs in a process pool of `workers` (default: every CPU); one worker runs in this process."""
    count = workers if workers is not None else (os.cpu_count() or 1)
    if count < 1:
        raise SweepError(f"--workers: expected an integer >= 1, got {count}")

    def execute(runs: Sequence[SweepRun]) -> Iterator[Finished]:
        n = min(count, len(runs))
        if n <= 1:
            for run in runs:
                yield _attempt(run)
            return
        with ProcessPoolExecutor(max_workers=n, mp_context=_pool_context()) as pool:
            pending = {pool.submit(execute_run, r): r.id for r in runs}
            try:
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in sorted(done, key=pending.__getitem__):
                        rid = pending.pop(fut)
                        error = fut.exception()
                        yield Finished(rid, None, repr(error)) if error else Finished(rid, fut.result())
            finally:
                for fut in pending:
                    fut.cancel()

    return execute


def ray_executor(address: str | None = None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> Executor:
    """One Ray task per run, on the cluster at `address` (else `RAY_ADDRESS`, else a local
    instance). Every node needs hicache installed, and a trace workload's file at its path.
    The address is checked here, before anything runs: `ray.init` retries an unreachable head
    for minutes."""
    try:
        import ray  # optional: imported only when asked for
    except ImportError:
        raise SweepError(f"--executor ray: Ray is not installed; {RAY_HINT}") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    check_ray_address(address, timeout_s)

    def execute(runs: Sequence[SweepRun]) -> Iterator[Finished]:
        started = not ray.is_initialized()
        if started:
            ray.init(address=address)
        task = ray.remote(execute_run)
        pending = {task.remote(r): r.id for r in runs}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    rid = pending.pop(ref)
                    try:
                        yield Finished(rid, ray.get(ref))
                    except Exception as exc:
                        yield Finished(rid, None, repr(exc))
        finally:
            for ref in pending:
                ray.cancel(ref)
            if started:
                ray.shutdown()

    return execute


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port that `address` (`HOST:PORT` or `ray://HOST:PORT`) names; None for
    the addresses Ray resolves itself (`auto`, `local`)."""
    text = address.strip()
    if text in ("auto", "local"):
        return None
    rest = text.split("://", 1)[1] if "://" in text else text
    host, sep, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SweepError(f"--ray-address: {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    return host, int(port)


def check_ray_address(address: str | None, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Fail within `timeout_s` when nothing accepts connections at `address` (None: Ray starts
    a local instance, nothing to reach)."""
    if address is None:
        return
    endpoint = ray_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise SweepError(
            f"--ray-address: cannot reach the Ray cluster at {address} within {timeout_s:g} s "
            f"({reason}); is its head node running (ray start --head) and the port open?"
        ) from None


def make_executor(name: str, workers: int | None = None, ray_address: str | None = None) -> Executor:
    if name == "local":
        return local_executor(workers)
    if name == "ray":
        return ray_executor(ray_address)
    raise SweepError(f"--executor: unknown executor {name!r}; expected one of: {', '.join(EXECUTORS)}")


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


# --- sweep.csv ------------------------------------------------------------------------------


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalars of a nested summary under dotted names."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif value is None or isinstance(value, int | float | str):
            out[name] = value
    return out


def _column_key(name: str) -> tuple[int, str]:
    """Columns by their summary key's place in SUMMARY_ORDER, then by name: fixed whatever
    runs are present."""
    top, _, rest = name.partition(".")
    rank = SUMMARY_ORDER.index(top) if top in SUMMARY_ORDER else len(SUMMARY_ORDER)
    return (rank, name if rank == len(SUMMARY_ORDER) else rest)


def _is_bytes(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last == "bytes" or last.endswith("_bytes")


def _metric_cell(name: str, value: Any) -> Any:
    """A metric as a CSV cell: byte counts as integers, floats exactly (repr), None empty."""
    if value is None:
        return ""
    if _is_bytes(name) and isinstance(value, float) and math.isfinite(value):
        return str(round(value))
    if isinstance(value, float):
        return repr(value)
    return value


def sweep_rows(plan: SweepPlan, out: Path) -> tuple[list[str], list[list[Any]]]:
    """The header and rows of sweep.csv from the run files present, in the plan's order of runs
    and the scenario's order of baselines."""
    rows: list[tuple[SweepRun, str, dict[str, Any]]] = []
    for run in plan.runs:
        doc = read_run(out, run)
        if doc is None:
            continue
        saved = doc["baselines"]
        order = [b for b in run.scenario["run"]["baselines"] if b in saved]
        for baseline in [*order, *sorted(set(saved) - set(order))]:
            metrics = dict(saved[baseline]["summary"])
            if isinstance(saved[baseline].get("channels"), Mapping):
                metrics["channels"] = saved[baseline]["channels"]
            rows.append((run, baseline, flatten(metrics)))
    metrics_names = sorted({k for _, _, m in rows for k in m}, key=_column_key)
    header = ["run_id", "seed", *plan.fields, "run", *metrics_names]
    body = [
        [
            run.id,
            run.seed,
            *(cell(v) for _, v in run.overrides),
            baseline,
            *(_metric_cell(k, m.get(k)) for k in metrics_names),
        ]
        for run, baseline, m in rows
    ]
    return header, body


def write_sweep_csv(out: Path, plan: SweepPlan) -> Path:
    header, body = sweep_rows(plan, out)
    path = out / "sweep.csv"
    tmp = path.with_name("sweep.csv.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(body)
    os.replace(tmp, path)
    return path


# --- reading a sweep back -------------------------------------------------------------------


@attrs.frozen(slots=True)
class SweepData:
    """A finished (or partial) sweep as saved: its plan's manifest and the run documents present,
    in the plan's order."""

    manifest: dict[str, Any] = attrs.field(repr=False)
    runs: tuple[dict[str, Any], ...] = attrs.field(repr=False)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(g["field"] for g in self.manifest["grid"])

    @property
    def baselines(self) -> tuple[str, ...]:
        return tuple(self.manifest["baselines"])


def read_sweep(out: Path) -> SweepData:
    """The manifest and run files of the sweep folder `out`."""
    try:
        manifest = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"{out}: no sweep.json; expected the --out folder of `hicache sim sweep`") from None
    except (OSError, ValueError) as exc:
        raise SweepError(f"{out / 'sweep.json'}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SweepError(f"{out / 'sweep.json'}: format: expected {FORMAT}")
    docs = []
    for rid in manifest["runs"]:
        try:
            doc = json.loads((out / "runs" / f"{rid}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("id") == rid:
            docs.append(doc)
    return SweepData(manifest, tuple(docs))
