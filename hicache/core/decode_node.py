"""The decode node's restore state machine: events in, commands out, no I/O.

Theory of operation
-------------------
A driver feeds `DecodeNodeCore.handle` one event at a time (something happened, at time `at`)
and executes, in order, the commands it returns. Everything that affects a decision lives here;
a driver reads nothing else: every fact it needs travels on a command (`RequestKV` names the
prompt prefill computes, `LoadBack` its entries, `StartDecode` and `Respond` the request's
account) or leaves on an event.

Each request moves through `states.TRANSITIONS`:

    QUEUED -> (QUERYING) -> RESTORING -> READY -> RUNNING -> FINISHED
                                                    |  ^
                                              RETRACTED (back to QUEUED, matched again)

plus ABORTED and FAILED from anywhere with a reason. At the head of the admission queue a request
is matched once against the tiered tree; its L1 path is locked and its L2 path pinned; L1 is
reserved for the whole prompt plus a decode reserve. One `QueryStorage` per tick asks L3 about
every newly admitted request. Then two tracks run at once: *restore* (prefetch L3->L2, merged
load-backs L2->L1) and *transfer* (the increment from prefill, `RequestKV`). The promise policy
decides how much of the match to restore rather than receive. A restore that falls short (a
prefetch stopped by its policy, a failed page) is trimmed and the missing range asked of prefill
(`fallback`): no request fails because of a cache fault. Only a prefill transfer that fails
after its retries, or is abandoned, or an abort, ends a request unsuccessfully. A retry backs off
first (`transfer_backoff_s`, doubling per retry up to `transfer_backoff_max_s`, scaled by a jitter
hashed from request and attempt, `backoff`): it waits as a transfer not yet sent (phase WAITING,
its slots still the request's) until its `TRANSFER_RETRY` timer fires, and is dropped unsent if
the request ends first; so a restarting prefill is not hit by every retry at once, and TP ranks
fed the same events wait alike.

When both tracks are done the request is READY; it starts (`StartDecode`) once the decode batch
has room (`max_running`). While it runs, `Decoded` grows its pages (`ExtendKV`), evicting cache
pages and, under pressure, retracting running requests by policy. `Finished` hands its pages,
prompt and output, to the tree, which backs them up L1->L2->L3 by its write policy.

Operations have lifecycles of their own (`lifecycles`: prefetch, transfer, load-back) so that a
request may end while its I/O is in flight: the I/O's slots stay claimed by the operation until
its completion says no byte can still land. `ForgetRequested` drops an ended request as soon as
no I/O refers to it.

With several TP ranks (`tp_size`), every rank runs this core on the same shared events; the
rank-local facts (L3 hits, prefetch progress, load-back outcomes) are agreed with at most one
`Agree` per kind at a time, and decisions use only agreed values, so ranks stay in lockstep.

An event the core refuses raises `CoreError` and leaves the core exactly as it was.

The core in parts
-----------------
`DecodeNodeCore` is one class built in parts, a module each, by phase of a request's life. Each
part subclasses the one above it in this list and calls only what is above it: a chain, not
mixins or objects composed, so that the compiled build reads every field at a fixed offset and
calls most methods directly, as when the core was one module.

    DecodeNodeBase   decode_base.py        the node's state; outbox, transitions, agreements
    DecodeStoreBack  decode_store_back.py  a request's pages into the tree (-> L2 -> L3), and
                                           the ends of the tree's copies
    DecodeBatch      decode_batch.py       start, decode and extend, retract
    DecodeFinish     decode_finish.py      finish, abort, failure; release; forget
    DecodeTransfer   decode_transfer.py    KV from prefill: promise, request, retry
    DecodeRestore    decode_restore.py     prefetch L3 -> L2, load-back L2 -> L1, timers
    DecodeAdmission  decode_admission.py   arrival, the tick, matching and admission, the L3
                                           query and the restore plan
    DecodeNodeCore   decode_node.py        the dispatch table (event -> handler), `handle`,
                                           the checks

The operations in flight (query, prefetch, load-back, transfer) are records in `decode_ops`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.commands import TimerKind
from hicache.core.config import DecodeConfig
from hicache.core.decode_admission import DecodeAdmission
from hicache.core.errors import CoreError
from hicache.core.lifecycles import TransferPhase
from hicache.core.node import TreeNode
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.states import State
from hicache.core.tree_structure import TREE
from hicache.core.value import Value


class DecodeNodeCore(DecodeAdmission):
    """One decode node's cache decisions. Feed events with `handle`; execute what it returns."""

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config)
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.RequestArrived: self._on_arrived,
            ev.Tick: self._on_tick,
            ev.StorageQueried: self._on_storage_queried,
            ev.PrefetchProgress: self._on_prefetch_progress,
            ev.PrefetchDone: self._on_prefetch_done,
            ev.LoadDone: self._on_load_done,
            ev.BackupDone: self._on_backup_done,
            ev.StoreDone: self._on_store_done,
            ev.KVArrived: self._on_kv_arrived,
            ev.KVFailed: self._on_kv_failed,
            ev.KVAbandoned: self._on_kv_abandoned,
            ev.TimerFired: self._on_timer,
            ev.Decoded: self._on_decoded,
            ev.Finished: self._on_finished,
            ev.AbortRequested: self._on_abort,
            ev.Agreed: self._on_agreed,
            ev.EvictRequested: self._on_evict,
            ev.ForgetRequested: self._on_forget,
        }

    # ------------------------------------------------------------------ driving

    def handle(self, event: ev.Event) -> list[cmd.Command]:
        """Apply one event; return the commands to execute, in order. A refused event raises
        `CoreError` and changes nothing."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise CoreError(f"unknown event {event!r}")
        for name, kind in ev.FIELD_TYPES[type(event)]:
            value: object = getattr(event, name)
            if not (
                isinstance(value, str)
                if kind == ev.STR
                else isinstance(value, int) and not isinstance(value, bool)
            ):
                what = "a string" if kind == ev.STR else "an integer"
                raise CoreError(f"{type(event).__name__}: {name} must be {what}, got {value!r}")
        at = event.at
        if (
            at.__class__ is not float
            and (not isinstance(at, int | float) or isinstance(at, bool))
            or at != at
        ):
            raise CoreError(f"{type(event).__name__}: time must be a number, got {at!r}")
        before = self.now
        self.now = max(self.now, at)
        try:
            handler(event)
        except Exception:  # a CoreError changed nothing; anything else is a bug, but keep the clock
            self.now = before
            raise
        self._collect_tree()
        if self._forget:
            self._forget_idle()
        out, self._outbox = self._outbox, []
        return out

    @property
    def idle(self) -> bool:
        """No request in flight and no I/O outstanding."""
        return (
            all(r.state.terminal for r in self.requests.values())
            and not (self._queries or self._prefetches or self._loads or self._transfers or self._agreements)
            and not self._load_queue
            and not self.tree.ops_in_flight
        )

    @property
    def wants_tick(self) -> bool:
        """Whether a `Tick` now would change anything: a retracted request to requeue, a request
        to admit, an L3 query to send or to settle, a prefetch to watch, a load-back to issue,
        a READY request to start (with several ranks, a load-back to agree on). When False, a
        Tick changes nothing but `now`, so a driver may skip it."""
        return bool(
            self.retracted
            or self.queue
            or self._to_query
            or self._queries
            or self._prefetches
            or self._load_queue
            or self._ready
            or (self.cfg.tp_size > 1 and self._loads)
        )

    def cached_pages(self, keys: Sequence[int]) -> int:
        """How many leading pages of `keys` L1 or L2 hold, changing nothing: what a
        cache-aware router asks every node before choosing one."""
        return self.tree.peek(keys)

    # ------------------------------------------------------------------ operator

    def _on_evict(self, e: ev.EvictRequested) -> None:
        for name, value in (("l1_pages", e.l1_pages), ("l2_pages", e.l2_pages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"EvictRequested: {name} must be an integer >= 0, got {value!r}")
        self.tree.evict_device(e.l1_pages)
        self.tree.evict_host(e.l2_pages)

    # ------------------------------------------------------------------ checks

    def audit(self) -> dict[str, int]:
        """What the node holds: slots by owner (`*_leaked` are slots owned by anything but the
        tree), locks and pins, requests not ended, reserved pages. A node at rest that lost
        nothing has zero in every `leaked`, `locks`, `pins` and `live` entry."""
        out: dict[str, int] = {}
        for tier, pool in (("l1", self.device_pool), ("l2", self.host_pool)):
            owners = [pool.owner_of(s) for s in range(pool.capacity)]
            out[f"{tier}_free"] = sum(o is None for o in owners)
            out[f"{tier}_tree"] = sum(o == TREE for o in owners)
            out[f"{tier}_leaked"] = sum(o is not None and o != TREE for o in owners)
        out["locks"] = len(self.tree.live_locks)
        out["pins"] = len(self.tree.live_pins)
        out["live"] = sum(not r.state.terminal for r in self.requests.values())
        out["reserved"] = self.reserved
        return out

    def snapshot(self) -> tuple:
        """Everything the core's decisions depend on, as immutable comparable data: equal
        snapshots mean equal futures. Tests use it to show that a refused event changed nothing."""
        pools = tuple(
            tuple(pool.owner_of(s) for s in range(pool.capacity))
            for pool in (self.device_pool, self.host_pool)
        )
        tree = tuple(
            (n.id, n.keys, n.device, n.host, n.host_pending, n.in_l3, n.lock_ref, n.host_ref, n.hit_count)
            for n in sorted(self.tree.nodes(), key=lambda n: n.id)
        )
        snap = _plain(
            (
                self.now,
                repr(self._ids),
                self.requests,
                self.queue,
                self.retracted,
                self.reserved,
                self.stats,
                pools,
                tree,
                self.tree.stats,
                self._queries,
                self._prefetches,
                self._load_queue,
                self._loads,
                self._transfers,
                self._timers,
                {aid: (a[0], a[2]) for aid, a in self._agreements.items()},
                self._ready,
                self._running,
                self._forget,
                self.tree.ops_in_flight,
            )
        )
        assert isinstance(snap, tuple)
        return snap

    def check(self) -> None:
        """Verify the node's invariants (tree, pools, per-request holdings)."""
        self.tree.check()
        if self.reserved != sum(r.reserve for r in self.requests.values()):
            raise CoreError("reserved pages do not add up to the requests' reservations")
        if self.device_pool.num_free < self.reserved:
            raise CoreError(
                f"{self.reserved} decode pages reserved but only {self.device_pool.num_free} free"
            )
        limit = self.cfg.max_running
        if limit and len(self._running) > limit:
            raise CoreError(f"{len(self._running)} requests running, the batch holds {limit}")
        self._check_transfers()
        head = self.queue[0] if self.queue else None
        for r in self.requests.values():
            if (r.state is State.RUNNING) != (r.id in self._running):
                raise CoreError(f"request {r.id!r} is {r.state.value} but the running set says otherwise")
            if r.state is State.QUEUED and r.id != head and (r.matched or r.lock or r.pin or r.slots):
                raise CoreError(f"request {r.id!r} waits behind the head but holds a match")
            if r.state.terminal or r.state is State.RETRACTED:
                held = (r.lock, r.pin, r.slots, r.prefetch_slots, r.transfers, r.reserve, r.loads)
                if any(held):
                    raise CoreError(f"request {r.id!r} is {r.state.value} but still holds {held!r}")

    def _check_transfers(self) -> None:
        """A live request waits on each of its transfers (sent, or a retry backing off); a
        retry backing off has its timer set and its slots still the request's own."""
        waiting_on = {op for kind, op in self._timers.values() if kind is TimerKind.TRANSFER_RETRY}
        for r in self.requests.values():
            for tid in r.transfers:
                t = self._transfers.get(tid)
                if t is None or t.req != r.id or t.phase not in (TransferPhase.ACTIVE, TransferPhase.WAITING):
                    raise CoreError(f"request {r.id!r} waits on transfer #{tid}, which is not its own")
        for t in self._transfers.values():
            if t.phase is not TransferPhase.WAITING:
                continue
            waiter = self.requests.get(t.req)
            if waiter is None or t.tid not in waiter.transfers:
                raise CoreError(f"transfer #{t.tid} backs off for {t.req!r}, which does not wait on it")
            if t.tid not in waiting_on:
                raise CoreError(f"transfer #{t.tid} of {t.req!r} backs off with no timer set")
            if t.claims or any(self.device_pool.owner_of(s) != waiter.owner for s in t.dst):
                raise CoreError(f"transfer #{t.tid} of {t.req!r} backs off but its slots left the request")


def _plain(x: object) -> object:
    """`x` as nested tuples of plain values (receipts and tree nodes by their ids)."""
    if isinstance(x, HostPin | LockReceipt):
        return (type(x).__name__, x.serial)
    if isinstance(x, TreeNode):
        return ("node", x.id)
    if isinstance(x, Value):
        return (type(x).__name__, *[_plain(v) for _, v in x.fields()])
    cls: Any = type(x)
    if attrs.has(cls):
        return (cls.__name__, *[_plain(getattr(x, f.name)) for f in attrs.fields(cls)])
    if isinstance(x, dict):
        return tuple((_plain(k), _plain(v)) for k, v in x.items())
    if isinstance(x, set | frozenset):
        return tuple(sorted((_plain(v) for v in x), key=repr))
    if isinstance(x, list | tuple | deque):
        return tuple(_plain(v) for v in x)
    return x
