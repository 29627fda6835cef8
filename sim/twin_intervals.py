"""How far to trust a what-if's predicted change: an interval for each change, over the traffic
and over the node's timing.

The change a what-if predicts (hit rate in points, mean and p90 TTFT and mean TPOT relative) is
a statistic of one sample of traffic replayed with one set of service times. Two things move it:

- the traffic: drawing the sessions again with replacement, and taking the same change over the
  requests of the drawn sessions in both replays, gives its spread over traffic like the
  recorded one; sessions, not requests, are drawn, because one conversation's turns share their
  prefixes and so their hits;
- the timing: which request ends first decides, under cache pressure, what is evicted, so a
  replay whose times are a little off can keep pages the node lost. The recording is replayed
  again `REPLAYS` times (both the baseline and the what-if) with each request's prefill compute
  scaled by a factor drawn from the twin's own in-sample per-request error (`service_scales`:
  measured over predicted TTFT, centred on its median). A request gets the same factor in both
  replays of a pair, so the pair differs only by the what-if.

The bootstrap draws are spread over the plain pair and the jittered ones, and the interval is
the central `LEVEL` of all of them. It does not cover the cost model's bias, which the report
puts beside it (the in-sample error of the same metric).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from hicache.results import RequestRecord
from hicache.sim.twin_recording import Recording

DRAWS = 1000
LEVEL = 0.9
SEED = 0  # the draws are the same on every run of the same recording
REPLAYS = 8  # jittered replay pairs beside the plain one
SCALE_LIMITS = (0.1, 10.0)  # a jitter factor is clipped to these
METRICS = ("hit_rate", "ttft_mean_s", "ttft_p90_s", "tpot_mean_s")

Interval = tuple[float, float]


def _paired(
    rec: Recording, base: Mapping[str, RequestRecord], what: Mapping[str, RequestRecord]
) -> dict[str, list[tuple[RequestRecord, RequestRecord, int]]]:
    """Session -> (baseline, what-if, prompt tokens) of each request both replays finished."""
    out: dict[str, list[tuple[RequestRecord, RequestRecord, int]]] = {}
    for r in rec.requests:
        b, w = base.get(r.id), what.get(r.id)
        if r.answered and b is not None and w is not None and b.outcome == w.outcome == "finished":
            out.setdefault(r.session, []).append((b, w, r.input_length))
    return out


def _metrics(rows: list[tuple[RequestRecord, RequestRecord, int]], side: int) -> dict[str, float]:
    recs = [row[side] for row in rows]
    prompt = sum(row[2] for row in rows)
    cached = sum(x.cached_l1 + x.cached_l2 + x.cached_l3 for x in recs)
    ttft = np.array([x.ttft_s for x in recs if not math.isnan(x.ttft_s)], dtype=np.float64)
    tpot = np.array([x.tpot_s for x in recs if x.output_tokens > 1 and not math.isnan(x.tpot_s)])
    return {
        "hit_rate": cached / prompt if prompt else math.nan,
        "ttft_mean_s": float(ttft.mean()) if ttft.size else math.nan,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft.size else math.nan,
        "tpot_mean_s": float(tpot.mean()) if tpot.size else math.nan,
    }


def change(base: Mapping[str, float], what: Mapping[str, float], key: str) -> float:
    """The what-if's change of `key`: points of hit rate (x 100), or relative for times."""
    if key == "hit_rate":
        return 100.0 * (what[key] - base[key])
    return (what[key] - base[key]) / base[key] if base[key] else math.nan


Records = Mapping[str, RequestRecord]


def service_scales(rec: Recording, predicted: Records) -> np.ndarray:
    """The twin's per-request timing error as factors: each answered request's measured TTFT over
    the replay's, divided by their median (the bias is the in-sample error, reported apart) and
    clipped to `SCALE_LIMITS`. Empty when fewer than two requests compare."""
    ratios = []
    for r in rec.requests:
        p = predicted.get(r.id)
        if r.ttft_s is not None and p is not None and p.ttft_s > 0 and not math.isnan(p.ttft_s):
            ratios.append(r.ttft_s / p.ttft_s)
    if len(ratios) < 2 or not np.median(ratios) > 0:
        return np.empty(0)
    return np.clip(np.asarray(ratios) / np.median(ratios), *SCALE_LIMITS)


def jitters(
    rec: Recording, scales: np.ndarray, *, replays: int = REPLAYS, seed: int = SEED
) -> list[dict[str, float]]:
    """`replays` draws of a factor for every request (request id -> factor), from `scales` with
    replacement; none when there are no scales."""
    if not scales.size:
        return []
    rng = np.random.default_rng(seed)
    ids = [r.id for r in rec.requests]
    return [dict(zip(ids, rng.choice(scales, len(ids)).tolist(), strict=True)) for _ in range(replays)]


def change_intervals(
    rec: Recording,
    base: Records,
    what: Records,
    *,
    jittered: Sequence[tuple[Records, Records]] = (),
    draws: int = DRAWS,
    level: float = LEVEL,
    seed: int = SEED,
) -> dict[str, Interval | None]:
    """Each metric's change (as `change` gives it) over `draws` bootstrap draws of the sessions,
    spread evenly over the pair (`base`, `what`) and the `jittered` pairs (the same replays
    with jittered service times): the central `level` of the draws (None where no draw could
    compute it)."""
    pairs = [_paired(rec, b, w) for b, w in [(base, what), *jittered]]
    pairs = [list(p.values()) for p in pairs if p]
    if not pairs:
        return {key: None for key in METRICS}
    rng = np.random.default_rng(seed)
    got: dict[str, list[float]] = {key: [] for key in METRICS}
    for i in range(draws):
        sessions = pairs[i % len(pairs)]
        drawn = rng.integers(0, len(sessions), len(sessions))
        rows = [row for j in drawn for row in sessions[int(j)]]
        b, w = _metrics(rows, 0), _metrics(rows, 1)
        for key in METRICS:
            if not math.isnan(c := change(b, w, key)):
                got[key].append(c)
    tail = 100.0 * (1.0 - level) / 2.0
    return {
        key: (float(np.percentile(v, tail)), float(np.percentile(v, 100.0 - tail))) if v else None
        for key, v in got.items()
    }


def sessions_compared(
    rec: Recording, base: Mapping[str, RequestRecord], what: Mapping[str, RequestRecord]
) -> int:
    """How many sessions the intervals were drawn from."""
    return len(_paired(rec, base, what))
