"""Closed-loop clients: a session's next request is sent when its previous one is answered.

Benchmark clients (SGLang's `bench_multiturn`, LMCache's multi-round QA) wait for an answer,
pause, then send the next turn; arrivals fixed in advance would send a turn before the answer
it extends exists and pile requests up. A *chain* is a session's requests from its first (which
arrives at its fixed time) on; each later one carries its pause (`WorkItem.think`). With
`clients` > 0 at most that many chains are open at once (a chain is open from its first
request's arrival to its last answer): a chain whose first request comes while every client is
busy waits, in arrival order, for one to finish its chain. Nothing is sent at or after `until`
(0: no end); a chain cut there ends, freeing its client.

This is bookkeeping only: the cluster asks it what to send and when, and sends it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from hicache.scenarios.workload import WorkItem


class ClosedLoop:
    """Which request follows which, and which chains hold a client."""

    def __init__(self, items: Sequence[WorkItem], clients: int = 0, until: float = 0.0) -> None:
        if clients < 0:
            raise ValueError(f"clients must be >= 0, got {clients}")
        self.clients = clients
        self.until = until if until > 0 else math.inf
        self.firsts: list[WorkItem] = []  # the requests that arrive at fixed times, in order
        self._following: dict[str, WorkItem] = {}  # request id -> the next of its chain
        self._waiting: deque[WorkItem] = deque()  # chains' first requests waiting for a client
        self.open = 0  # chains holding a client
        self.peak = 0  # the most chains open at once
        last: dict[str, WorkItem] = {}
        for item in items:
            before = last.get(item.session) if item.session else None
            if item.think is None or before is None:
                self.firsts.append(item)
            else:
                self._following[before.id] = item
            if item.session:
                last[item.session] = item

    def arrived(self, item: WorkItem, now: float) -> bool:
        """A chain's first request is due: True to send it now; False if it waits for a client
        or comes at or after `until` (then its chain is dropped)."""
        if now >= self.until:
            self._drop(item.id)
            return False
        if self.clients and self.open >= self.clients:
            self._waiting.append(item)
            return False
        self._take()
        return True

    def answered(self, rid: str) -> list[tuple[float, WorkItem]]:
        """Request `rid` is answered: (delay, request) to schedule: the chain's next after its
        pause, or, when the chain is over, a first request that waited for this client."""
        after = self._following.pop(rid, None)
        if after is not None:
            assert after.think is not None
            return [(after.think, after)]
        return self._release()

    def due(self, item: WorkItem, now: float) -> list[tuple[float, WorkItem]] | None:
        """A scheduled request's time has come. None: send it. Otherwise it falls at or after
        `until`: its chain ends, and the list holds a waiting first request to start."""
        if now < self.until:
            return None
        self._drop(item.id)
        return self._release()

    def _drop(self, rid: str) -> None:
        """Forget the requests that follow `rid` in its chain."""
        while rid in self._following:
            rid = self._following.pop(rid).id

    def _take(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)

    def _release(self) -> list[tuple[float, WorkItem]]:
        """A chain ended: its client takes the longest-waiting first request, if any. The
        client is held from here so that two releases at one instant cannot both give it away."""
        self.open -= 1
        if not self._waiting:
            return []
        self._take()
        return [(0.0, self._waiting.popleft())]
