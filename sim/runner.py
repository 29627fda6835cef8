"""Run a scenario's baselines side by side and write what a researcher keeps: `summary.json`,
`requests.csv` and the plots."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hicache.results import format_table, write_requests_csv, write_summary_json
from hicache.scenarios.build import build_workload
from hicache.scenarios.scenario import Scenario
from hicache.scenarios.workload import WorkItem
from hicache.sim import plots
from hicache.sim.cluster import Cluster, RunResult
from hicache.sim.setup import setups


def run_baselines(
    scenario: Scenario, items: Sequence[WorkItem] | None = None, *, progress: bool = False
) -> dict[str, RunResult]:
    """Every baseline of the scenario on the same workload, in the scenario's order."""
    items = build_workload(scenario) if items is None else items
    resolved = setups(scenario)
    keys = None
    if len(resolved) > 1:  # the baselines replay the same items: hash their pages once
        first = next(iter(resolved.values()))
        page, model = first.decode.page_size, first.model_name
        keys = {item.id: item.sequence_keys(page, model) for item in items}
    out = {}
    workload = scenario.workload
    clients = workload.clients if workload.closed else 0
    for label, setup in resolved.items():
        bar = tqdm(total=len(items), desc=f"{label:>15}", unit="req", disable=not progress, leave=True)
        update: Callable[[int], None] = bar.update
        try:
            cluster = Cluster(setup)
            out[label] = cluster.run(items, update, keys=keys, clients=clients, until=scenario.run.until)
        finally:
            bar.close()
    return out


class OutputError(ValueError):
    """A results folder that cannot be written, or a run not worth its results (a baseline
    that completed nothing); the message says which and why. A ValueError, so that the command
    line reports it as it does a bad scenario, with a non-zero exit."""


def check_out(out: Path) -> Path:
    """Make sure `out` is, or can become, a folder this process writes into; call it before
    simulating, so that a bad `--out` costs nothing."""
    try:
        if out.exists() and not out.is_dir():
            raise OutputError(f"--out {out}: exists and is not a folder")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".hicache-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    return out


def empty_baselines(results: dict[str, RunResult]) -> str | None:
    """Why a run is not worth its results, or None: a baseline that completed no request,
    with the commonest reasons its requests gave."""
    lines = []
    for label, r in results.items():
        if r.summary["completed"]:
            continue
        total = r.summary["requests"]
        if not total:
            lines.append(f"baseline {label} was sent no request")
            continue
        reasons = Counter(f"{x.outcome}: {x.reason}" if x.reason else x.outcome for x in r.records)
        top = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(3))
        lines.append(f"baseline {label} completed none of its {total:,} requests ({top})")
    return "\n".join(lines) or None


def write_outputs(out: Path, scenario: Scenario, results: dict[str, RunResult]) -> list[Path]:
    """summary.json, requests.csv and three PNGs under `out`; returns the paths written. Then,
    if a baseline completed nothing, raises `OutputError` saying why (the results stay written
    for a look), so that the command exits non-zero instead of reporting an empty comparison."""
    check_out(out)
    doc: dict[str, Any] = {
        "scenario": scenario.to_dict(),
        "runs": {k: {**r.summary, "channels": r.channels} for k, r in results.items()},
    }
    paths = [out / "summary.json", out / "requests.csv"]
    write_summary_json(paths[0], doc)
    write_requests_csv(paths[1], ((k, r.records) for k, r in results.items()))
    summaries = {k: r.summary for k, r in results.items()}
    title = scenario.name
    for name, draw in (
        ("ttft_cdf.png", lambda p: plots.ttft_cdf(p, {k: r.records for k, r in results.items()}, title)),
        ("cached_by_tier.png", lambda p: plots.cached_by_tier(p, summaries, title)),
        ("pd_transfer.png", lambda p: plots.pd_bytes(p, summaries, title)),
    ):
        draw(out / name)
        paths.append(out / name)
    empty = empty_baselines(results)
    if empty is not None:
        raise OutputError(f"{empty}\n(results written to {out})")
    return paths


def table(results: dict[str, RunResult]) -> str:
    """The summary table printed after a run."""
    return format_table({k: r.summary for k, r in results.items()})


def summary_doc(results: dict[str, RunResult]) -> str:
    return json.dumps({k: r.summary for k, r in results.items()}, indent=2)
