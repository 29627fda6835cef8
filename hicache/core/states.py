"""The request states of a decode node and every allowed transition, as data.

`TRANSITIONS[state][trigger]` is the next state. Triggers are the names of external events
(`KVArrived`, `Decoded`, ...) and of the core's own decisions (`admit`, `ready`, `retract`, ...).
Anything not in the table is an invalid event for that state and raises `TransitionError`.
`docs/architecture.md` shows this table as a diagram generated from it
(`python -m hicache.core.states`), so the picture cannot drift from the code.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    QUEUED = "queued"  # waiting in order for L1 budget; only the head holds its match
    QUERYING = "querying"  # admitted, L1 budget reserved, waiting for the (agreed) L3 hit length
    RESTORING = "restoring"  # restore track (prefetch, load-back) and transfer track in progress
    RUNNING = "running"  # handed to the decode batch
    RETRACTED = "retracted"  # out of the batch under memory pressure; its KV went into the tree
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({State.FINISHED, State.ABORTED, State.FAILED})

# Completions that can arrive after a request ended (I/O started before it did): absorbed.
_LATE = {"KVArrived": None, "KVFailed": None, "KVAbandoned": None, "AbortRequested": None, "Finished": None}

TRANSITIONS: dict[State, dict[str, State]] = {
    State.QUEUED: {
        "admit": State.QUERYING,  # L3 has candidates: ask it
        "admit_local": State.RESTORING,  # nothing to ask L3
        "AbortRequested": State.ABORTED,
        "reject": State.FAILED,  # can never fit L1
    },
    State.QUERYING: {
        "l3_known": State.RESTORING,
        # The L2 span's load-back starts at admission; if it fails, its fallback transfer can
        # complete or fail before L3 answers.
        "KVArrived": State.QUERYING,
        "KVFailed": State.QUERYING,
        "transfer_failed": State.FAILED,
        "AbortRequested": State.ABORTED,
    },
    State.RESTORING: {
        "KVArrived": State.RESTORING,
        "KVFailed": State.RESTORING,  # retried
        "transfer_failed": State.FAILED,  # retries exhausted
        "ready": State.RUNNING,
        "AbortRequested": State.ABORTED,
    },
    State.RUNNING: {
        "Decoded": State.RUNNING,
        "retract": State.RETRACTED,
        "Finished": State.FINISHED,
        "AbortRequested": State.ABORTED,
    },
    State.RETRACTED: {
        "resume": State.QUEUED,
        "AbortRequested": State.ABORTED,
    },
    State.FINISHED: {"AbortRequested": State.FINISHED},
    State.ABORTED: {k: State.ABORTED for k in _LATE},
    State.FAILED: {k: State.FAILED for k in _LATE},
}


def mermaid() -> str:
    """The transition table as a mermaid state diagram (self-loops of terminal states omitted)."""
    lines = ["stateDiagram-v2", "    [*] --> queued: RequestArrived"]
    for state, moves in TRANSITIONS.items():
        for trigger, nxt in moves.items():
            if state.terminal and nxt is state:
                continue
            lines.append(f"    {state.value} --> {nxt.value}: {trigger}")
    lines += [f"    {s.value} --> [*]" for s in State if s.terminal]
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
