"""Run a scenario's baselines side by side and write what a researcher keeps: `summary.json`,
`requests.csv` and the plots."""

from __future__ import annotations

import heapq
import json
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hicache.results import (
    RequestRecord,
    RequestsCsvStream,
    format_table,
    write_requests_csv,
    write_summary_json,
)
from hicache.scenarios.build import build_workload, stream_workload
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


class Outcomes:
    """What the outputs need of a run's records beyond its summary, heard one record at a time:
    the finished requests' TTFTs (8 bytes each, for the CDF plot) and why the others ended."""

    def __init__(self, records: Iterable[RequestRecord] = ()) -> None:
        self.ttft = array("d")
        self.reasons: Counter[str] = Counter()
        for r in records:
            self.add(r)

    def add(self, r: RequestRecord) -> None:
        if r.outcome == "finished":
            if not math.isnan(r.ttft_s):
                self.ttft.append(r.ttft_s)
        else:
            self.reasons[f"{r.outcome}: {r.reason}" if r.reason else r.outcome] += 1


class _InOrder:
    """Hands records on in `requests.csv`'s order, (arrival, id), as requests end in another:
    a record waits only for requests sent before it that are still running, so what is held
    is bounded by what is in flight. `sent` wraps the items to hear what was sent."""

    def __init__(self, write: Callable[[RequestRecord], None]) -> None:
        self._write = write
        self._pending: list[tuple[float, str]] = []  # heap of the sent, not yet written
        self._done: dict[str, RequestRecord] = {}
        self._horizon = -math.inf  # the arrival of the last item sent
        self._ended = False

    def sent(self, items: Iterable[WorkItem]) -> Iterator[WorkItem]:
        for item in items:
            self._horizon = item.arrival
            heapq.heappush(self._pending, (item.arrival, item.id))
            self._release()
            yield item
        self._ended = True
        self._release()

    def __call__(self, record: RequestRecord) -> None:
        self._done[record.id] = record
        self._release()

    def _release(self) -> None:
        # An item not yet sent arrives at or after the horizon, so a pending one before the
        # horizon is final in the order (at the horizon, a later item could tie and sort first).
        pending, done = self._pending, self._done
        while pending and pending[0][1] in done and (self._ended or pending[0][0] < self._horizon):
            self._write(done.pop(heapq.heappop(pending)[1]))

    def close(self) -> None:
        """Every record heard must have been written (each sent request ends in one)."""
        self._ended = True
        self._release()
        if self._pending or self._done:
            raise RuntimeError(f"{len(self._pending)} requests sent but never answered")


def count_workload(scenario: Scenario) -> tuple[int, int]:
    """Requests and prompt tokens of a streamed workload, read through once."""
    n = prompt = 0
    for item in stream_workload(scenario):
        n += 1
        prompt += item.prompt_len
    return n, prompt


def run_streamed(
    scenario: Scenario, requests_csv: Path, *, total: int | None = None, progress: bool = False
) -> tuple[dict[str, RunResult], dict[str, Outcomes]]:
    """Every baseline of a scenario that `why_not_streamed` allows, its trace read one request
    at a time (once per baseline) and `requests_csv` written as requests end, the rows in the
    order `write_requests_csv` gives them: the results keep no records (the summaries come from
    tallies), so memory holds what is in flight and the caches, not the trace. The file appears
    under its name only when every baseline has run."""
    resolved = setups(scenario)
    out: dict[str, RunResult] = {}
    outcomes: dict[str, Outcomes] = {}
    with RequestsCsvStream(requests_csv) as csv_out:
        for label, setup in resolved.items():
            seen = outcomes[label] = Outcomes()

            def write(r: RequestRecord, label: str = label, seen: Outcomes = seen) -> None:
                seen.add(r)
                csv_out.write(label, r)

            order = _InOrder(write)
            bar = tqdm(total=total, desc=f"{label:>15}", unit="req", disable=not progress, leave=True)
            try:
                items = order.sent(stream_workload(scenario))
                out[label] = Cluster(setup).run(items, bar.update, on_record=order, until=scenario.run.until)
                order.close()
            finally:
                bar.close()
    return out, outcomes


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


def empty_baselines(
    results: dict[str, RunResult], outcomes: Mapping[str, Outcomes] | None = None
) -> str | None:
    """Why a run is not worth its results, or None: a baseline that completed no request,
    with the commonest reasons its requests gave (from `outcomes` when the results kept no
    records)."""
    lines = []
    for label, r in results.items():
        if r.summary["completed"]:
            continue
        total = r.summary["requests"]
        if not total:
            lines.append(f"baseline {label} was sent no request")
            continue
        reasons = outcomes[label].reasons if outcomes is not None else Outcomes(r.records).reasons
        top = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(3))
        lines.append(f"baseline {label} completed none of its {total:,} requests ({top})")
    return "\n".join(lines) or None


def write_outputs(
    out: Path,
    scenario: Scenario,
    results: dict[str, RunResult],
    outcomes: Mapping[str, Outcomes] | None = None,
) -> list[Path]:
    """summary.json, requests.csv and three PNGs under `out`; returns the paths written. Then,
    if a baseline completed nothing, raises `OutputError` saying why (the results stay written
    for a look), so that the command exits non-zero instead of reporting an empty comparison.
    `outcomes` come with streamed results (`run_streamed`), whose requests.csv is already
    written and whose results keep no records."""
    check_out(out)
    doc: dict[str, Any] = {
        "scenario": scenario.to_dict(),
        "runs": {k: {**r.summary, "channels": r.channels} for k, r in results.items()},
    }
    paths = [out / "summary.json", out / "requests.csv"]
    write_summary_json(paths[0], doc)
    if outcomes is None:
        write_requests_csv(paths[1], ((k, r.records) for k, r in results.items()))
        outcomes = {k: Outcomes(r.records) for k, r in results.items()}
    summaries = {k: r.summary for k, r in results.items()}
    ttfts = {k: outcomes[k].ttft for k in results}
    title = scenario.name
    for name, draw in (
        ("ttft_cdf.png", lambda p: plots.ttft_cdf(p, ttfts, title)),
        ("cached_by_tier.png", lambda p: plots.cached_by_tier(p, summaries, title)),
        ("pd_transfer.png", lambda p: plots.pd_bytes(p, summaries, title)),
    ):
        draw(out / name)
        paths.append(out / name)
    empty = empty_baselines(results, outcomes)
    if empty is not None:
        raise OutputError(f"{empty}\n(results written to {out})")
    return paths


def table(results: dict[str, RunResult]) -> str:
    """The summary table printed after a run."""
    return format_table({k: r.summary for k, r in results.items()})


def summary_doc(results: dict[str, RunResult]) -> str:
    return json.dumps({k: r.summary for k, r in results.items()}, indent=2)
