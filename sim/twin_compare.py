"""The digital twin's comparison (`twin.py`): what the node measured against what the simulator
predicted, overall (TTFT, TPOT, end-to-end, tokens by tier) and per request."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from hicache.results import RequestRecord
from hicache.sim.twin_recording import TIERS, Recording


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "p90": None}
    return {"mean": float(arr.mean()), "p90": float(np.percentile(arr, 90))}


def overall(rec: Recording, predicted: Mapping[str, RequestRecord] | None) -> dict[str, Any]:
    """Hit rate, tiers, TTFT and TPOT over the requests answered (both measured and predicted
    where `predicted` is given; the measured figures alone otherwise)."""
    ids = [r for r in rec.requests if r.answered]
    if predicted is not None:
        ids = [r for r in ids if r.id in predicted and predicted[r.id].outcome == "finished"]
    prompt = sum(r.input_length for r in ids)
    if predicted is None:
        tiers = [sum(r.cached[i] for r in ids) for i in range(3)]
        ttft = [r.ttft_s for r in ids]
        tpot = [r.tpot_s for r in ids if r.output_length > 1]
    else:
        p = [predicted[r.id] for r in ids]
        tiers = [sum(x.cached_l1 for x in p), sum(x.cached_l2 for x in p), sum(x.cached_l3 for x in p)]
        ttft = [x.ttft_s for x in p]
        tpot = [x.tpot_s for x in p if x.output_tokens > 1]
    t, tp = _dist(ttft), _dist(tpot)  # type: ignore[arg-type]
    return {
        "requests": len(ids),
        "hit_rate": sum(tiers) / prompt if prompt else 0.0,
        "cached_tokens": dict(zip(TIERS, tiers, strict=True)),
        "ttft_mean_s": t["mean"],
        "ttft_p90_s": t["p90"],
        "tpot_mean_s": tp["mean"],
    }


def errors(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict[str, float | None]:
    """Prediction errors: the hit rate in percentage points, times relative to the measured."""

    def rel(key: str) -> float | None:
        m, p = measured.get(key), predicted.get(key)
        return None if m is None or p is None or m == 0 else (p - m) / m

    return {
        "hit_rate_pp": 100.0 * (predicted["hit_rate"] - measured["hit_rate"]),
        "ttft_mean": rel("ttft_mean_s"),
        "ttft_p90": rel("ttft_p90_s"),
        "tpot_mean": rel("tpot_mean_s"),
    }


def ttft_request_error(rec: Recording, predicted: Mapping[str, RequestRecord]) -> float | None:
    """The mean relative TTFT error per request: unlike the error of the mean, which a fitted
    constant makes small by construction, this says how far one prediction is to be trusted, and
    so how small a predicted change can be told from none."""
    errs = []
    for r in rec.requests:
        p = predicted.get(r.id)
        if r.answered and r.ttft_s and p is not None and p.outcome == "finished" and not math.isnan(p.ttft_s):
            errs.append(abs(p.ttft_s - r.ttft_s) / r.ttft_s)
    return float(np.mean(errs)) if errs else None


def tiers_equal(rec: Recording, predicted: Mapping[str, RequestRecord]) -> int:
    """Requests whose restored tokens per tier the replay predicted exactly."""
    n = 0
    for r in rec.requests:
        p = predicted.get(r.id)
        if p is not None and (p.cached_l1, p.cached_l2, p.cached_l3) == r.cached:
            n += 1
    return n


def request_rows(
    rec: Recording, base: Mapping[str, RequestRecord], what_if: Mapping[str, RequestRecord] | None
) -> Iterator[dict[str, Any]]:
    """requests.csv's rows: measured and predicted tiers and times of each request."""

    def num(x: float | None) -> float | str:
        return "" if x is None or math.isnan(x) else round(x, 6)

    for r in rec.requests:
        p = base.get(r.id)
        row: dict[str, Any] = {
            "id": r.id,
            "session": r.session,
            "arrival_s": round(r.arrival, 6),
            "input_length": r.input_length,
            "output_length": r.output_length,
            **{f"measured_{t}": r.cached[i] for i, t in enumerate(TIERS)},
            **{f"predicted_{t}": getattr(p, f"cached_{t}") if p else "" for t in TIERS},
            "measured_ttft_s": num(r.ttft_s),
            "predicted_ttft_s": num(p.ttft_s) if p else "",
            "measured_tpot_s": num(r.tpot_s),
            "predicted_tpot_s": num(p.tpot_s) if p else "",
            # P->D tokens: what a decode-side hit saves (the fit's transfer term)
            "measured_transferred": "" if r.transferred is None else r.transferred,
            "predicted_transferred": p.transferred_tokens if p else "",
        }
        if what_if is not None:
            w = what_if.get(r.id)
            row.update({f"what_if_{t}": getattr(w, f"cached_{t}") if w else "" for t in TIERS})
            row["what_if_ttft_s"] = num(w.ttft_s) if w else ""
            row["what_if_transferred"] = w.transferred_tokens if w else ""
        yield row
