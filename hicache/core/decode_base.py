"""The decode node's state, and the plumbing every part of it shares: the outbox, the request
lookup, state transitions by `states.TRANSITIONS`, and agreement across TP ranks.

The parts of `DecodeNodeCore` stack on this class in the order they call one another
(`decode_node` lists them)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.commands import AgreeKind, TimerKind
from hicache.core.config import DecodeConfig
from hicache.core.decode_ops import LoadOp, LoadOpEntry, PrefetchOp, QueryOp, TransferOp
from hicache.core.errors import CoreError, TransitionError
from hicache.core.pool import SlotPool
from hicache.core.request import Request
from hicache.core.states import TRANSITIONS, State, Trigger, trigger_name
from hicache.core.tree import TieredRadixTree


@attrs.define(slots=True)
class NodeStats:
    """Counters for the whole node, in tokens unless named otherwise."""

    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    retracted: int = 0
    prompt_tokens: int = 0  # of requests that reached the decode batch
    l1_tokens: int = 0
    l2_tokens: int = 0
    l3_tokens: int = 0
    transferred_tokens: int = 0
    fallback_tokens: int = 0
    storage_queries: int = 0
    prefetches: int = 0
    load_batches: int = 0
    max_loads_in_flight: int = 0
    transfer_retries: int = 0  # retries decided (one still backing off when its request ends counts)
    transfers_abandoned: int = 0
    bad_l2_pages: int = 0  # L2 pages a load-back found bad (dropped from the tree with those below)


class DecodeNodeBase:
    """What one decode node knows: its pools and tree, its requests, its operations in flight."""

    def __init__(self, config: DecodeConfig) -> None:
        self.cfg = config
        self._ids = itertools.count(1)  # every command id: ops, transfers, timers, agreements
        self.device_pool = SlotPool("L1", config.l1_pages)
        self.host_pool = SlotPool("L2", config.l2_pages)
        self.tree = TieredRadixTree(
            self.device_pool,
            self.host_pool,
            eviction=config.eviction,
            write_policy=config.write_policy,
            store_to_l3=config.storage,
            store_backlog_pages=int(config.store_backlog * config.l2_pages),
            ids=self._ids,
        )
        self.requests: dict[str, Request] = {}
        self.queue: deque[str] = deque()
        self.retracted: list[str] = []
        self.reserved = 0  # decode pages promised to admitted requests, still free in the pool
        self.stats = NodeStats()
        self.now = 0.0
        self._outbox: list[cmd.Command] = []
        self._to_query: list[Request] = []
        self._queries: dict[int, QueryOp] = {}
        self._prefetches: dict[int, PrefetchOp] = {}
        self._load_queue: list[LoadOpEntry] = []
        self._loads: dict[int, LoadOp] = {}
        self._transfers: dict[int, TransferOp] = {}
        self._timers: dict[int, tuple[TimerKind, int]] = {}  # timer -> (kind, the op it times)
        self._agreements: dict[int, tuple[AgreeKind, Callable[[dict], None], frozenset]] = {}
        self._agreeing: set[AgreeKind] = set()
        self._ready: deque[str] = deque()  # READY requests waiting for room in the batch
        self._running: dict[str, None] = {}  # RUNNING requests, in the order they started
        self._forget: set[str] = set()  # ended requests to drop once their I/O ends

    # ------------------------------------------------------------------ plumbing

    def _emit(self, c: cmd.Command) -> None:
        self._outbox.append(c)

    def _collect_tree(self) -> None:
        if self.tree.outbox:
            self._outbox.extend(self.tree.drain())

    def _req(self, rid: str, event: object) -> Request:
        r = self.requests.get(rid)
        if r is None:
            raise CoreError(f"{type(event).__name__}: unknown request {rid!r}")
        return r

    def _next_state(self, r: Request, trigger: Trigger) -> State:
        nxt = TRANSITIONS[r.state].get(trigger)
        if nxt is None:
            raise TransitionError(r.id, r.state.value, trigger_name(trigger))
        return nxt

    def _move(self, r: Request, trigger: Trigger) -> None:
        r.state = self._next_state(r, trigger)

    # ------------------------------------------------------------------ agreement across ranks

    def _agree(self, kind: AgreeKind, values: dict, apply: Callable[[dict], None]) -> None:
        """One collective per kind at a time; with one rank the answer is the local value."""
        if self.cfg.tp_size == 1:
            apply(values)
            return
        if kind in self._agreeing:
            return
        aid = next(self._ids)
        self._agreeing.add(kind)
        self._agreements[aid] = (kind, apply, frozenset(values))
        self._emit(cmd.Agree(aid, kind, tuple(values.items())))

    def _on_agreed(self, e: ev.Agreed) -> None:
        entry = self._agreements.get(e.agreement)
        if entry is None:
            raise CoreError(f"Agreed: no agreement #{e.agreement} is open")
        kind, apply, keys = entry
        try:
            # Typed as plain objects until checked: the event comes from outside (another rank).
            values: dict[object, object] = dict(e.values)
        except (TypeError, ValueError):
            raise CoreError(f"Agreed #{e.agreement}: values must be (key, value) pairs") from None
        if len(values) != len(e.values) or set(values) != keys:
            raise CoreError(f"Agreed #{e.agreement} ({kind}): keys differ from the agreement's")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
            raise CoreError(f"Agreed #{e.agreement} ({kind}): every value must be an integer")
        del self._agreements[e.agreement]
        self._agreeing.discard(kind)
        apply(values)
