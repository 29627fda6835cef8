"""Statistics of a trace, including the ideal prefix-hit ratio with an infinite cache."""

from __future__ import annotations

import attrs
import numpy as np

from hicache.scenarios.traces import TraceRequest


@attrs.frozen(slots=True)
class TraceStats:
    requests: int
    duration_s: float
    input_percentiles: dict[str, float]
    output_percentiles: dict[str, float]
    input_tokens: int
    blocks_total: int | None
    blocks_distinct: int | None
    ideal_hit_tokens: int | None  # prompt tokens an infinite cache would hold

    @property
    def ideal_hit_ratio(self) -> float | None:
        if self.ideal_hit_tokens is None:
            return None
        return self.ideal_hit_tokens / self.input_tokens if self.input_tokens else 0.0


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean())}
    for p in (50, 90, 99):
        out[f"p{p}"] = float(np.percentile(arr, p, method="inverted_cdf"))
    out["max"] = float(arr.max())
    return out


def trace_stats(requests: list[TraceRequest]) -> TraceStats:
    """Counts, length percentiles, and the ideal hit: in arrival order, a block hits if an
    earlier request carried the same chained id and every earlier block of this request hit;
    hit tokens are capped at the input length (the last block may be partial)."""
    arrivals = [r.arrival for r in requests]
    duration = max(arrivals) - min(arrivals) if arrivals else 0.0
    inputs = [r.input_length for r in requests]
    has_blocks = bool(requests) and all(r.block_ids is not None for r in requests)
    total = distinct = hit_tokens = None
    if has_blocks:
        seen: set[int] = set()
        total = hit_tokens = 0
        for r in sorted(requests, key=lambda r: r.arrival):  # stable: file order on ties
            ids = r.block_ids
            assert ids is not None and r.block_size is not None
            hits = 0
            while hits < len(ids) and ids[hits] in seen:
                hits += 1
            hit_tokens += min(hits * r.block_size, r.input_length)
            total += len(ids)
            seen.update(ids)
        distinct = len(seen)
    return TraceStats(
        requests=len(requests),
        duration_s=duration,
        input_percentiles=_percentiles(inputs),
        output_percentiles=_percentiles([r.output_length for r in requests]),
        input_tokens=sum(inputs),
        blocks_total=total,
        blocks_distinct=distinct,
        ideal_hit_tokens=hit_tokens,
    )
