"""Run a scenario's baselines side by side and write what a researcher keeps: `summary.json`,
`requests.csv` and the plots."""

from __future__ import annotations

import json
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
    for label, setup in resolved.items():
        bar = tqdm(total=len(items), desc=f"{label:>15}", unit="req", disable=not progress, leave=True)
        update: Callable[[int], None] = bar.update
        try:
            out[label] = Cluster(setup).run(items, update, keys=keys)
        finally:
            bar.close()
    return out


def write_outputs(out: Path, scenario: Scenario, results: dict[str, RunResult]) -> list[Path]:
    """summary.json, requests.csv and three PNGs under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
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
    return paths


def table(results: dict[str, RunResult]) -> str:
    """The summary table printed after a run."""
    return format_table({k: r.summary for k, r in results.items()})


def summary_doc(results: dict[str, RunResult]) -> str:
    return json.dumps({k: r.summary for k, r in results.items()}, indent=2)
