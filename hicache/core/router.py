"""Routers: which prefill and which decode node serve a request (the simulator's cluster and the
runtime's front door both ask these).

- `round_robin`: in turn, ignoring content;
- `session_affinity`: every request of a session to the same node (a stable hash of the
  session), so a conversation's next turn finds its history where it left it; requests
  without a session go round-robin;
- `cache_aware`: the node whose cache holds the longest prefix of the prompt, unless that
  would unbalance the load (then the least loaded node) — the rule of SGLang's cache-aware
  router (balance thresholds: absolute 32 requests and relative 1.5x; ties to the least
  loaded, then the lowest index).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

ROUTERS = ("round_robin", "session_affinity", "cache_aware")


class Router:
    def __init__(self, policy: str, nodes: int, *, balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; expected one of: {', '.join(ROUTERS)}")
        self.policy = policy
        self.nodes = nodes
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._next = 0

    def _round_robin(self) -> int:
        i = self._next
        self._next = (i + 1) % self.nodes
        return i

    def choose(self, session: str, loads: Sequence[int], matched: Callable[[int], int]) -> int:
        """`loads[i]`: requests outstanding on node i; `matched(i)`: cached prefix pages there."""
        if self.nodes == 1:
            return 0
        if self.policy == "round_robin" or (self.policy == "session_affinity" and not session):
            return self._round_robin()
        if self.policy == "session_affinity":
            return zlib.crc32(session.encode()) % self.nodes
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return min(range(self.nodes), key=lambda i: (loads[i], i))
        # The longest match; among equals the least loaded, then the lowest index.
        best, best_match, best_load = 0, matched(0), loads[0]
        for i in range(1, self.nodes):
            m = matched(i)
            if m > best_match or (m == best_match and loads[i] < best_load):
                best, best_match, best_load = i, m, loads[i]
        return best
