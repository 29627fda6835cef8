"""The digital twin's clients (`twin.py`): how many the recorded traffic had and how long each
paused between turns, inferred from the arrival process the recording carries, so that the
replay drives the node as the clients did.

The model is that of the simulator's closed loop (`hicache.sim.sessions`): a client takes a
session, sends its turns one after the other, each `think` seconds after the previous one was
answered, and takes the next session once that one is over (ended or abandoned). So:

- a turn's think time is its arrival less the end of its session's previous turn (recorded as
  `previous_finished`; for a recording without it, the previous turn's measured end, TTFT plus
  TPOT per further token);
- the clients are the most sessions open at once, a session being open from its first arrival
  to its last turn's end, and never fewer than the most requests in flight at an arrival
  (`in_flight` + 1). A recording whose requests never overlapped is one client sending one
  request at a time, whatever its sessions (it is replayed one request at a time).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from hicache.sim.twin_recording import Recorded, Recording, TwinError


@attrs.frozen(slots=True)
class Clients:
    """What the twin infers of the recorded clients; `count` 0: one request at a time."""

    count: int
    peak_sessions: int  # the most sessions open at once
    peak_in_flight: int  # the most requests in flight at an arrival, that one included
    think_mean_s: float | None  # the mean pause between a turn's answer and the next turn
    think_max_s: float | None
    from_arrivals: bool  # inferred from recorded `previous_finished`/`in_flight` (else from TTFT, TPOT)

    def doc(self) -> dict[str, object]:
        return attrs.asdict(self)


def think_s(r: Recorded, before: Recorded) -> float:
    """`r`'s pause after its session's previous turn `before` was answered (>= 0)."""
    end = r.previous_finished
    if end is None:
        e2e = before.e2e_s
        end = before.arrival + e2e if e2e is not None else before.arrival
    return max(0.0, r.arrival - end)


def _peak(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals [start, end) holding one instant (an end before a start at a tie)."""
    events = sorted(ev for a, b in intervals for ev in ((a, 1), (max(a, b), -1)))
    now = best = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        best = max(best, now)
    return best


def infer_clients(rec: Recording) -> Clients:
    """The recorded clients (see the module's docstring)."""
    spans: dict[str, tuple[float, float]] = {}
    thinks: list[float] = []
    previous: dict[str, Recorded] = {}
    solo = 0
    for r in rec.requests:
        end = r.arrival + (r.e2e_s or 0.0)
        key = r.session or f"#{solo}"  # a request without a session is a session of its own
        if not r.session:
            solo += 1
        first, last = spans.get(key, (r.arrival, end))
        spans[key] = (first, max(last, end))
        before = previous.get(r.session) if r.session else None
        if before is not None:
            thinks.append(think_s(r, before))
        if r.session:
            previous[r.session] = r
    sessions = _peak(spans.values())
    recorded = [r.in_flight for r in rec.requests if r.in_flight is not None]
    in_flight = max(recorded, default=-1) + 1
    if not recorded:  # an older recording: overlap of the measured [arrival, end) of each request
        in_flight = _peak((r.arrival, r.arrival + (r.e2e_s or 0.0)) for r in rec.requests)
    count = 0 if rec.one_at_a_time and in_flight <= 1 else max(sessions, in_flight, 1)
    return Clients(
        count=count,
        peak_sessions=sessions,
        peak_in_flight=in_flight,
        think_mean_s=sum(thinks) / len(thinks) if thinks else None,
        think_max_s=max(thinks, default=None),
        from_arrivals=any(r.previous_finished is not None or r.in_flight is not None for r in rec.requests),
    )


def check_granularity(rec: Recording, page_size: int, *, approximate: bool) -> None:
    """A recording whose ids are coarser than the node's pages cannot show the hits inside a
    block (a short prompt's partial block is an id of its own): refused unless `approximate`."""
    if rec.block_size > page_size and not approximate:
        raise TwinError(
            f"{rec.path}: recorded at {rec.block_size} tokens per hash id, coarser than the node's page "
            f"size {page_size}: hits inside a block are invisible; record with --record-block-size "
            f"{page_size} (serve's default) or replay with --approximate"
        )
