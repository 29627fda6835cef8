"""The front door's admission as plain state: who runs at the decode nodes and who waits. The
decisions `hicache serve` makes (`hicache.runtime.serving.admission` drives them from trio tasks)
and the simulator's front door replays (`cluster.front_door_running`)."""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Literal

import attrs

Decision = Literal["run", "queued", "refused"]


@attrs.define
class Slots:
    """Who runs and who waits. A request needs a slot (`max_running`) and its tokens of the
    decode nodes' L1 (`max_tokens`, 0: not counted; a request alone always fits, as the limits
    checked before let only what a node can hold through). Invariants: `running <=
    max_running`, `tokens <= max_tokens` unless one request runs alone, `len(queue) <=
    max_queued`, and the queue's head waits only while it does not fit: requests start in
    arrival order, none overtakes another."""

    max_running: int
    max_queued: int
    max_tokens: int = 0
    running: int = 0
    tokens: int = 0
    queue: collections.deque[tuple[Hashable, int]] = attrs.field(factory=collections.deque)
    held: dict[Hashable, int] = attrs.field(factory=dict)  # running ticket -> its tokens

    def __attrs_post_init__(self) -> None:
        if self.max_running < 1 or self.max_queued < 0 or self.max_tokens < 0:
            raise ValueError(
                f"admission: expected max_running >= 1, max_queued >= 0 and max_tokens >= 0, "
                f"got {self.max_running}, {self.max_queued} and {self.max_tokens}"
            )

    def fits(self, need: int) -> bool:
        if self.running >= self.max_running:
            return False
        return not self.max_tokens or not self.running or self.tokens + need <= self.max_tokens

    def arrive(self, ticket: Hashable, need: int = 0) -> Decision:
        if not self.queue and self.fits(need):
            self._start(ticket, need)
            return "run"
        if len(self.queue) >= self.max_queued:
            return "refused"
        self.queue.append((ticket, need))
        return "queued"

    def leave(self, ticket: Hashable) -> list[Hashable]:
        """A running request ended: the queued requests that fit now start (returned, in order)."""
        if ticket not in self.held:
            raise ValueError(f"admission: request {ticket} left but was not running")
        self.tokens -= self.held.pop(ticket)
        self.running -= 1
        return self._start_heads()

    def withdraw(self, ticket: Hashable) -> list[Hashable] | None:
        """A queued request gave up (its client left): None if it was not queued, else the
        requests behind it that start now that it no longer holds them up."""
        for i, (queued, _) in enumerate(self.queue):
            if queued == ticket:
                del self.queue[i]
                return self._start_heads() if i == 0 else []
        return None

    def _start(self, ticket: Hashable, need: int) -> None:
        self.running += 1
        self.tokens += need
        self.held[ticket] = need

    def _start_heads(self) -> list[Hashable]:
        started = []
        while self.queue and self.fits(self.queue[0][1]):
            ticket, need = self.queue.popleft()
            self._start(ticket, need)
            started.append(ticket)
        return started
