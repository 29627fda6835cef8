"""The request states of a decode node and every allowed transition, as data.

`TRANSITIONS[state][trigger]` is the next state. A trigger is either the class of an external
event (`ev.KVArrived`, `ev.Decoded`, ...) or one of the core's own decisions (`Decision`).
Anything not in the table is an invalid event for that state and raises `TransitionError`.
`docs/architecture.md` shows this table as a diagram generated from it
(`python -m hicache.core.states`), so the picture cannot drift from the code.
"""

from __future__ import annotations

import enum

from hicache.core import events as ev


class State(enum.Enum):
    QUEUED = "queued"  # waiting in order for L1 budget; only the head holds its match
    QUERYING = "querying"  # admitted, L1 budget reserved, waiting for the (agreed) L3 hit length
    RESTORING = "restoring"  # restore track (prefetch, load-back) and transfer track in progress
    READY = "ready"  # KV complete; waiting for room in the decode batch (`max_running`)
    RUNNING = "running"  # handed to the decode batch
    RETRACTED = "retracted"  # out of the batch under memory pressure; its KV went into the tree
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    __hash__ = object.__hash__  # members are singletons: identity hashing, at C speed

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class Decision(enum.Enum):
    """The core's own triggers (external ones are event classes)."""

    ADMIT = "admit"  # L3 has candidates: ask it
    ADMIT_LOCAL = "admit_local"  # nothing to ask L3
    REJECT = "reject"  # can never fit L1
    L3_KNOWN = "l3_known"  # the agreed L3 hit length is known: plan the restore
    READY = "ready"  # both tracks done
    START = "start"  # the decode batch has room
    RETRACT = "retract"  # memory pressure
    RESUME = "resume"  # back to the queue, to be matched again
    TRANSFER_FAILED = "transfer_failed"  # retries exhausted, or abandoned

    __hash__ = object.__hash__


Trigger = type | Decision

TERMINAL = frozenset({State.FINISHED, State.ABORTED, State.FAILED})

# Completions that can arrive after a request ended (I/O started before it did): absorbed.
_LATE: tuple[type, ...] = (ev.KVArrived, ev.KVFailed, ev.KVAbandoned, ev.AbortRequested, ev.Finished)

TRANSITIONS: dict[State, dict[Trigger, State]] = {
    State.QUEUED: {
        Decision.ADMIT: State.QUERYING,
        Decision.ADMIT_LOCAL: State.RESTORING,
        ev.AbortRequested: State.ABORTED,
        Decision.REJECT: State.FAILED,
    },
    State.QUERYING: {
        Decision.L3_KNOWN: State.RESTORING,
        # The L2 span's load-back starts at admission; if it fails, its fallback transfer can
        # complete or fail before L3 answers.
        ev.KVArrived: State.QUERYING,
        ev.KVFailed: State.QUERYING,
        Decision.TRANSFER_FAILED: State.FAILED,
        ev.AbortRequested: State.ABORTED,
    },
    State.RESTORING: {
        ev.KVArrived: State.RESTORING,
        ev.KVFailed: State.RESTORING,  # retried
        Decision.TRANSFER_FAILED: State.FAILED,  # retries exhausted
        Decision.READY: State.READY,
        ev.AbortRequested: State.ABORTED,
    },
    State.READY: {
        Decision.START: State.RUNNING,
        ev.AbortRequested: State.ABORTED,
    },
    State.RUNNING: {
        ev.Decoded: State.RUNNING,
        Decision.RETRACT: State.RETRACTED,
        ev.Finished: State.FINISHED,
        ev.AbortRequested: State.ABORTED,
    },
    State.RETRACTED: {
        Decision.RESUME: State.QUEUED,
        ev.AbortRequested: State.ABORTED,
    },
    State.FINISHED: {ev.AbortRequested: State.FINISHED},
    State.ABORTED: dict.fromkeys(_LATE, State.ABORTED),
    State.FAILED: dict.fromkeys(_LATE, State.FAILED),
}


def trigger_name(trigger: Trigger) -> str:
    """The name a trigger goes by in errors and diagrams."""
    return trigger.value if isinstance(trigger, Decision) else trigger.__name__


def mermaid() -> str:
    """The transition table as a mermaid state diagram (self-loops of terminal states omitted)."""
    lines = ["stateDiagram-v2", "    [*] --> queued: RequestArrived"]
    for state, moves in TRANSITIONS.items():
        for trigger, nxt in moves.items():
            if state.terminal and nxt is state:
                continue
            lines.append(f"    {state.value} --> {nxt.value}: {trigger_name(trigger)}")
    lines += [f"    {s.value} --> [*]" for s in State if s.terminal]
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
