"""What a run reports, in the simulator and the runtime alike: one record per request, and the
summary of a run.

The summary's keys are the contract with users' scripts (and with the runtime, which writes
the same schema with measured instead of modelled times): `requests`, `completed`, `failed`,
`ttft_s` and `tpot_s` (mean, p50, p90, p99), `prompt_tokens`, `cached_tokens` by tier,
`hit_rate`, `prefill_cached_tokens`, `pd_transfer_bytes`, `fallback_tokens`, `events`, `wall_s`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np


@attrs.define(slots=True)
class RequestRecord:
    id: str
    session: str
    turn: int
    arrival: float
    prefill_node: int
    decode_node: int
    prompt_tokens: int
    output_tokens: int
    outcome: str
    reason: str
    ttft_s: float  # NaN unless the request reached the decode batch
    tpot_s: float  # NaN for single-token outputs
    e2e_s: float
    cached_l1: int
    cached_l2: int
    cached_l3: int
    transferred_tokens: int
    promised_tokens: int
    fallback_tokens: int
    prefill_cached_tokens: int
    pd_transfer_bytes: float
    retractions: int

    @property
    def cached(self) -> int:
        return self.cached_l1 + self.cached_l2 + self.cached_l3


FIELDS = [f.name for f in attrs.fields(RequestRecord)]


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(
    records: Sequence[RequestRecord], *, events: int, wall_s: float, sim_s: float
) -> dict[str, Any]:
    done = [r for r in records if r.outcome == "finished"]
    prompt = sum(r.prompt_tokens for r in done)
    l1 = sum(r.cached_l1 for r in done)
    l2 = sum(r.cached_l2 for r in done)
    l3 = sum(r.cached_l3 for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": sum(r.outcome == "failed" for r in records),
        "ttft_s": _dist([r.ttft_s for r in done]),
        "tpot_s": _dist([r.tpot_s for r in done]),
        "e2e_s": _dist([r.e2e_s for r in done]),
        "prompt_tokens": prompt,
        "cached_tokens": {"l1": l1, "l2": l2, "l3": l3},
        "hit_rate": (l1 + l2 + l3) / prompt if prompt else 0.0,
        "prefill_cached_tokens": sum(r.prefill_cached_tokens for r in done),
        "pd_transfer_bytes": float(sum(r.pd_transfer_bytes for r in records)),
        "fallback_tokens": sum(r.fallback_tokens for r in records),
        "retractions": sum(r.retractions for r in records),
        "events": events,
        "wall_s": wall_s,
        "simulated_s": sim_s,
    }


class RunTally:
    """The summary of records heard one at a time, in any order, equal to `summarize` over
    all of them: a long replay then keeps a few numbers per request in numpy arrays (about 50
    bytes) instead of its `RequestRecord`s. Means and float sums depend on the order of their
    terms, so the values are kept and put in `summarize`'s order (arrival, id) at the end."""

    _CHUNK = 8192

    def __init__(self) -> None:
        self._rows: list[tuple[float, bytes, bool, bool, float, float, float, float]] = []
        self._chunks: list[tuple[np.ndarray, ...]] = []
        self.requests = 0
        self._totals = dict.fromkeys(
            ("prompt", "l1", "l2", "l3", "prefill_cached", "fallback", "retractions"), 0
        )

    def add(self, r: RequestRecord) -> None:
        self.requests += 1
        ok = r.outcome == "finished"
        t = self._totals
        if ok:
            t["prompt"] += r.prompt_tokens
            t["l1"] += r.cached_l1
            t["l2"] += r.cached_l2
            t["l3"] += r.cached_l3
            t["prefill_cached"] += r.prefill_cached_tokens
        t["fallback"] += r.fallback_tokens
        t["retractions"] += r.retractions
        self._rows.append(
            (
                r.arrival,
                r.id.encode(),
                ok,
                r.outcome == "failed",
                r.ttft_s,
                r.tpot_s,
                r.e2e_s,
                r.pd_transfer_bytes,
            )
        )
        if len(self._rows) >= self._CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        cols = list(zip(*self._rows, strict=True))
        self._rows = []
        self._chunks.append(
            (
                np.array(cols[0], dtype=np.float64),
                np.array(cols[1], dtype=np.bytes_),
                np.array(cols[2], dtype=bool),
                np.array(cols[3], dtype=bool),
                *(np.array(c, dtype=np.float64) for c in cols[4:]),
            )
        )

    def summary(self, *, events: int, wall_s: float, sim_s: float) -> dict[str, Any]:
        """What `summarize` returns for the records added so far."""
        self._flush()
        if self._chunks:
            arrival, ids, ok, failed, ttft, tpot, e2e, pd = (
                np.concatenate(col) for col in zip(*self._chunks, strict=True)
            )
            self._chunks = [(arrival, ids, ok, failed, ttft, tpot, e2e, pd)]
        else:
            arrival = ttft = tpot = e2e = pd = np.empty(0)
            ok = failed = np.empty(0, dtype=bool)
            ids = np.empty(0, dtype=np.bytes_)
        # UTF-8 bytes sort as their code points do: the order of `(r.arrival, r.id)`.
        order = np.lexsort((ids, arrival))
        done = ok[order]
        t = self._totals
        l1, l2, l3, prompt = t["l1"], t["l2"], t["l3"], t["prompt"]
        return {
            "requests": self.requests,
            "completed": int(done.sum()),
            "failed": int(failed.sum()),
            "ttft_s": _dist(ttft[order][done].tolist()),
            "tpot_s": _dist(tpot[order][done].tolist()),
            "e2e_s": _dist(e2e[order][done].tolist()),
            "prompt_tokens": prompt,
            "cached_tokens": {"l1": l1, "l2": l2, "l3": l3},
            "hit_rate": (l1 + l2 + l3) / prompt if prompt else 0.0,
            "prefill_cached_tokens": t["prefill_cached"],
            "pd_transfer_bytes": float(sum(pd[order].tolist())),
            "fallback_tokens": t["fallback"],
            "retractions": t["retractions"],
            "events": events,
            "wall_s": wall_s,
            "simulated_s": sim_s,
        }


class RequestsCsvStream:
    """`requests.csv` written a row at a time, in the order the caller gives (`write_requests_csv`
    writes them sorted): nothing is held but the file. The file appears under its name only on
    `close()`; leaving its `with` block on an exception removes what was written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = path.with_suffix(".csv.tmp")
        self._file = self._tmp.open("w", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        self._writer.writerow(["run", *FIELDS])

    def write(self, label: str, r: RequestRecord) -> None:
        self._writer.writerow([label, *(_cell(getattr(r, name)) for name in FIELDS)])

    def close(self) -> None:
        self._file.close()
        self._tmp.replace(self.path)

    def __enter__(self) -> RequestsCsvStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()
            self._tmp.unlink(missing_ok=True)


def write_requests_csv(path: Path, runs: Iterable[tuple[str, Sequence[RequestRecord]]]) -> None:
    """One row per request and run; the `run` column names the baseline or policy."""
    with RequestsCsvStream(path) as out:
        for label, records in runs:
            for r in records:
                out.write(label, r)


def _cell(value: object) -> object:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return value


def write_summary_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """The summary table printed after a run."""
    head = (
        f"{'run':<16}{'done':>6}{'fail':>5}{'TTFT mean':>11}{'p90':>9}{'p99':>9}{'TPOT ms':>9}"
        f"{'hit':>7}{'L1':>7}{'L2':>7}{'L3':>7}{'P->D GB':>9}{'fallback':>10}{'events':>9}{'wall s':>8}"
    )
    lines = [head]
    for label, s in summaries.items():
        prompt = max(s["prompt_tokens"], 1)
        ttft, tpot = s["ttft_s"], s["tpot_s"]

        def f(x: float | None, scale: float = 1.0, fmt: str = ".3f") -> str:
            return "-" if x is None else format(x * scale, fmt)

        lines.append(
            f"{label:<16}{s['completed']:>6}{s['failed']:>5}{f(ttft['mean']):>11}{f(ttft['p90']):>9}"
            f"{f(ttft['p99']):>9}{f(tpot['mean'], 1e3, '.1f'):>9}{s['hit_rate']:>7.1%}"
            f"{s['cached_tokens']['l1'] / prompt:>7.1%}{s['cached_tokens']['l2'] / prompt:>7.1%}"
            f"{s['cached_tokens']['l3'] / prompt:>7.1%}{s['pd_transfer_bytes'] / 1e9:>9.1f}"
            f"{s['fallback_tokens']:>10}{s['events']:>9}{s['wall_s']:>8.2f}"
        )
    lines.append(
        "(TTFT in seconds; hit and L1/L2/L3 are shares of prompt tokens restored on the decode node)"
    )
    return "\n".join(lines)
