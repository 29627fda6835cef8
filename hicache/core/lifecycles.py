"""The lifecycles of the core's operations, as data beside the request states.

A prefetch, a transfer and a load-back batch each move through phases; `PREFETCH`, `TRANSFER`
and `LOAD` say which trigger (an event class, or one of the core's `Step`s) moves which phase
where. `advance` is the one place an operation changes phase: anything not in its table raises
the same `TransitionError` as a request would, naming the operation, its phase and the trigger.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from hicache.core import events as ev
from hicache.core.errors import TransitionError


class Step(enum.Enum):
    """The core's own triggers of operation phases."""

    SETTLE = "settle"  # the request's usable length of a prefetch is decided (agreed)
    ORPHAN = "orphan"  # the request ended while the operation was in flight
    END = "end"  # every rank's part ended: the operation is dropped


class PrefetchPhase(enum.Enum):
    """OPEN: the request waits on it. SETTLED: its usable length is fixed, the op may still
    write. ORPHANED: its request ended first; the op's slots stay claimed. `*_DONE`: this rank's
    driver reported `PrefetchDone` (no byte can land any more); the op ends once all ranks agree."""

    OPEN = "open"
    OPEN_DONE = "open_done"
    SETTLED = "settled"
    SETTLED_DONE = "settled_done"
    ORPHANED = "orphaned"
    ORPHANED_DONE = "orphaned_done"
    ENDED = "ended"

    @property
    def done(self) -> bool:
        """This rank's copy ended."""
        return self in _PREFETCH_DONE


_PREFETCH_DONE = frozenset({PrefetchPhase.OPEN_DONE, PrefetchPhase.SETTLED_DONE, PrefetchPhase.ORPHANED_DONE})

P = PrefetchPhase
PREFETCH: dict[PrefetchPhase, dict[type | Step, PrefetchPhase]] = {
    P.OPEN: {
        ev.PrefetchProgress: P.OPEN,
        ev.PrefetchDone: P.OPEN_DONE,
        ev.TimerFired: P.OPEN,
        Step.SETTLE: P.SETTLED,
        Step.ORPHAN: P.ORPHANED,
    },
    P.OPEN_DONE: {ev.TimerFired: P.OPEN_DONE, Step.SETTLE: P.SETTLED_DONE, Step.ORPHAN: P.ORPHANED_DONE},
    P.SETTLED: {
        ev.PrefetchProgress: P.SETTLED,
        ev.PrefetchDone: P.SETTLED_DONE,
        ev.TimerFired: P.SETTLED,
        Step.ORPHAN: P.SETTLED,  # nothing to claim: the request gave back its slots when settling
    },
    P.SETTLED_DONE: {ev.TimerFired: P.SETTLED_DONE, Step.ORPHAN: P.SETTLED_DONE, Step.END: P.ENDED},
    P.ORPHANED: {
        ev.PrefetchProgress: P.ORPHANED,
        ev.PrefetchDone: P.ORPHANED_DONE,
        ev.TimerFired: P.ORPHANED,
    },
    P.ORPHANED_DONE: {ev.TimerFired: P.ORPHANED_DONE, Step.END: P.ENDED},
    P.ENDED: {},
}


class TransferPhase(enum.Enum):
    """WAITING: a retry of a failed transfer, backing off; not sent yet, so nothing can write
    its slots (they stay the request's), and its timer's `TimerFired` sends it. ACTIVE: sent;
    the request waits on it. ORPHANED: the request ended; the transfer keeps its destination
    slots claimed until its outcome. ABANDONED: the driver gave up without being able to stop
    it; likewise until its real outcome. ENDED: its outcome is in, or it was dropped unsent."""

    WAITING = "waiting"
    ACTIVE = "active"
    ORPHANED = "orphaned"
    ABANDONED = "abandoned"
    ENDED = "ended"


T = TransferPhase
TRANSFER: dict[TransferPhase, dict[type | Step, TransferPhase]] = {
    T.WAITING: {
        ev.TimerFired: T.ACTIVE,  # its backoff is over: the retry is sent
        Step.ORPHAN: T.ENDED,  # the request ended first: dropped unsent, nothing to claim
    },
    T.ACTIVE: {
        ev.KVArrived: T.ENDED,
        ev.KVFailed: T.ENDED,
        ev.KVAbandoned: T.ABANDONED,
        Step.ORPHAN: T.ORPHANED,
    },
    T.ORPHANED: {ev.KVArrived: T.ENDED, ev.KVFailed: T.ENDED, ev.KVAbandoned: T.ABANDONED},
    T.ABANDONED: {ev.KVArrived: T.ENDED, ev.KVFailed: T.ENDED, Step.ORPHAN: T.ABANDONED},
    T.ENDED: {},
}


class LoadPhase(enum.Enum):
    """IN_FLIGHT: copying. COPIED: this rank's copy ended; with several ranks the outcome is
    agreed first. ENDED: accounted."""

    IN_FLIGHT = "in_flight"
    COPIED = "copied"
    ENDED = "ended"


L = LoadPhase
LOAD: dict[LoadPhase, dict[type | Step, LoadPhase]] = {
    L.IN_FLIGHT: {ev.LoadDone: L.COPIED},
    L.COPIED: {Step.END: L.ENDED},
    L.ENDED: {},
}


PhaseT = TypeVar("PhaseT", bound=enum.Enum)


def advance(
    table: Mapping[PhaseT, Mapping[type | Step, PhaseT]],
    phase: PhaseT,
    trigger: type | Step,
    req: str,
    subject: str,
) -> PhaseT:
    """The next phase of operation `subject` (e.g. "prefetch #5") of request `req` ("" once it
    ended), or `TransitionError`."""
    nxt = table[phase].get(trigger)
    if nxt is None:
        name = trigger.value if isinstance(trigger, Step) else trigger.__name__
        who = f"{subject} of request {req!r}" if req else subject
        raise TransitionError(req, phase.value, name, subject=who)
    return nxt
