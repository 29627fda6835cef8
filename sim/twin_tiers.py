"""The digital twin's per-request check (`twin.py`): which requests the replay found in other
tiers than the node did, and why.

The cache's decisions are exact given the order of events, but a replay does not see every
event at the time the node did; each differing request gets the first reason that holds:

- `not replayed`: the replay did not finish it (cut at `run.until`, or refused);
- `abandoned`: the node did not finish it (the client left, or it failed): what it left in the
  cache depends on how far it got;
- `race`: a request sharing more of its prefix than it was found with was in flight when it
  arrived, on the node or in the replay: its pages enter the cache when it ends, so the order of
  two requests' ends and starts, inside one tick of the node, decides the hit;
- `after a differing turn`: its session's previous turn already differed, so the pages it
  extends were not those the node had;
- `tier placement`: the same tokens were found, in other tiers: a copy between L1 and L2 (a
  write-back, an eviction to L2) ended earlier or later than on the node;
- `evicted in the replay` / `evicted on the node`: fewer (more) tokens found than on the node,
  with nothing in flight: evictions timed by the node's real copies and load, which the replay's
  costs place at other times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import attrs

from hicache.results import RequestRecord
from hicache.sim.twin_recording import Recorded, Recording

FINISHED = ("stop", "length")
REASONS = (
    "not replayed",
    "abandoned",
    "race",
    "after a differing turn",
    "tier placement",
    "evicted in the replay",
    "evicted on the node",
)


@attrs.frozen(slots=True)
class TierDiff:
    """A request whose L1/L2/L3 tokens the replay did not predict, and why."""

    id: str
    session: str
    measured: tuple[int, int, int]
    predicted: tuple[int, int, int] | None
    reason: str
    detail: str

    def doc(self) -> dict[str, object]:
        return attrs.asdict(self)


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Leading ids two prompts share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _predicted(p: RequestRecord | None) -> tuple[int, int, int] | None:
    return None if p is None else (p.cached_l1, p.cached_l2, p.cached_l3)


def _end(r: Recorded) -> float:
    return r.arrival + (r.e2e_s or 0.0)


def _racer(
    r: Recorded, rec: Recording, predicted: Mapping[str, RequestRecord], found: int
) -> tuple[str, str] | None:
    """A request in flight when `r` arrived (node or replay) sharing more than `found` of its
    blocks; (its id, where)."""
    block = rec.block_size
    p_r = predicted.get(r.id)
    for o in rec.requests:
        if o.id == r.id or o.arrival > r.arrival:
            continue
        if _shared(o.block_ids, r.block_ids) * block <= found:
            continue
        if _end(o) > r.arrival:
            return o.id, "on the node"
        p_o = predicted.get(o.id)
        if p_r is not None and p_o is not None and p_o.arrival + p_o.e2e_s > p_r.arrival:
            return o.id, "in the replay"
    return None


def tier_differences(rec: Recording, predicted: Mapping[str, RequestRecord]) -> list[TierDiff]:
    """Every request whose restored tokens per tier the replay did not predict, with its reason
    (the module's docstring), in arrival order."""
    out: list[TierDiff] = []
    differing: set[str] = set()
    previous: dict[str, str] = {}
    for r in rec.requests:
        p = predicted.get(r.id)
        got = _predicted(p)
        before = previous.get(r.session) if r.session else None
        if r.session:
            previous[r.session] = r.id
        if got == r.cached:
            continue
        differing.add(r.id)
        m_total, p_total = sum(r.cached), sum(got) if got is not None else 0
        racer = _racer(r, rec, predicted, min(m_total, p_total))
        if p is None or p.outcome != "finished":
            reason, detail = "not replayed", "" if p is None else f"replay outcome {p.outcome}: {p.reason}"
        elif r.finish_reason not in FINISHED:
            reason, detail = "abandoned", f"finish reason {r.finish_reason}"
        elif racer is not None:
            reason, detail = "race", f"{racer[0]} was in flight {racer[1]}"
        elif before is not None and before in differing:
            reason, detail = "after a differing turn", f"{before} differed"
        elif m_total == p_total:
            reason, detail = "tier placement", f"{m_total} tokens found in both"
        elif p_total < m_total:
            reason, detail = "evicted in the replay", f"{m_total - p_total} tokens fewer than the node found"
        else:
            reason, detail = "evicted on the node", f"{p_total - m_total} tokens more than the node found"
        out.append(TierDiff(r.id, r.session, r.cached, got, reason, detail))
    return out


def reason_counts(diffs: list[TierDiff]) -> dict[str, int]:
    """How many differing requests each reason explains, in `REASONS`' order."""
    counts = Counter(d.reason for d in diffs)
    return {k: counts[k] for k in REASONS if counts[k]}
