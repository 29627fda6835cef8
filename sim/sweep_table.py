"""`sweep.csv`: one row per (run, baseline) in the plan's order, every scalar of the summary and the
channels flattened in a fixed column order; and a sweep folder read back for reports."""

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from hicache.sim.sweep_executors import read_run
from hicache.sim.sweep_plan import FORMAT, SweepError, SweepPlan, SweepRun, cell

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
