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
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.backoff import retry_delay
from hicache.core.commands import AgreeKind, Outcome, TimerKind
from hicache.core.config import DecodeConfig, PromisePolicy, RetractPolicy
from hicache.core.errors import CoreError, TransitionError
from hicache.core.lifecycles import (
    LOAD,
    PREFETCH,
    TRANSFER,
    LoadPhase,
    PrefetchPhase,
    Step,
    TransferPhase,
    advance,
)
from hicache.core.node import TreeNode
from hicache.core.pool import Owner, SlotPool
from hicache.core.prefetch_rule import prefetch_should_stop
from hicache.core.promise import choose_parts
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.request import Request
from hicache.core.states import TRANSITIONS, Decision, State, Trigger, trigger_name
from hicache.core.tree import TREE, TieredRadixTree, failed_pages
from hicache.core.value import Value


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


@attrs.define(slots=True, eq=False)
class _Query:
    op: int
    reqs: list[str]
    local: dict[str, int] | None = None  # this rank's answer, once it came


@attrs.define(slots=True, eq=False)
class _Prefetch:
    op: int
    req: str  # "" once the request ended (the op still owns its claims)
    planned: int
    slots: list[int]
    phase: PrefetchPhase = PrefetchPhase.OPEN
    progress: int = 0  # rank-local
    timed_out: bool = False  # its timer fired: an input of the stop rule
    claims: list[int] = attrs.Factory(list)  # host slots the op owns until it ends

    def move(self, trigger: type | Step) -> None:
        self.phase = advance(PREFETCH, self.phase, trigger, self.req, f"prefetch #{self.op}")


@attrs.define(slots=True, eq=False)
class _LoadEntry:
    req: str
    from_l2: bool  # the L2 span (tree pages, pinned) or prefetched L3 pages (request-owned)
    first_page: int
    host_slots: list[int]
    device_slots: list[int]
    anchor: TreeNode | None = None  # L2 entries: the deepest node of the pinned span
    orphaned: bool = False  # the request ended; the batch claims what it still copies


@attrs.define(slots=True, eq=False)
class _Load:
    op: int
    entries: list[_LoadEntry]
    phase: LoadPhase = LoadPhase.IN_FLIGHT
    first_bad: dict[int, int] = attrs.Factory(dict)  # rank-local: entry -> its first bad page
    claims_device: list[int] = attrs.Factory(list)
    claims_host: list[int] = attrs.Factory(list)
    pins: list[HostPin] = attrs.Factory(list)

    def move(self, trigger: type | Step) -> None:
        self.phase = advance(LOAD, self.phase, trigger, "", f"load-back #{self.op}")


@attrs.define(slots=True, eq=False)
class _Transfer:
    tid: int
    req: str
    start: int
    end: int
    dst: list[int]
    attempt: int
    fallback: bool
    phase: TransferPhase = TransferPhase.ACTIVE
    claims: list[int] = attrs.Factory(list)  # orphaned or abandoned: slots it may still write

    def next_phase(self, trigger: type | Step) -> TransferPhase:
        return advance(TRANSFER, self.phase, trigger, self.req, f"transfer #{self.tid}")


class DecodeNodeCore:
    """One decode node's cache decisions. Feed events with `handle`; execute what it returns."""

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
        self._queries: dict[int, _Query] = {}
        self._prefetches: dict[int, _Prefetch] = {}
        self._load_queue: list[_LoadEntry] = []
        self._loads: dict[int, _Load] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._timers: dict[int, tuple[TimerKind, int]] = {}  # timer -> (kind, the op it times)
        self._agreements: dict[int, tuple[AgreeKind, Callable[[dict], None], frozenset]] = {}
        self._agreeing: set[AgreeKind] = set()
        self._ready: deque[str] = deque()  # READY requests waiting for room in the batch
        self._running: dict[str, None] = {}  # RUNNING requests, in the order they started
        self._forget: set[str] = set()  # ended requests to drop once their I/O ends
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

    # ------------------------------------------------------------------ arrival and admission

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        if e.req in self.requests:
            raise CoreError(f"RequestArrived: request {e.req!r} already exists")
        page = self.cfg.page_size
        if not isinstance(e.prompt_len, int) or e.prompt_len < 1 or len(e.keys) != e.prompt_len // page:
            raise CoreError(
                f"RequestArrived {e.req!r}: expected prompt_len >= 1 with prompt_len // {page} keys, "
                f"got prompt_len={e.prompt_len!r} and {len(e.keys)} keys"
            )
        r = Request(e.req, e.prompt_len, list(e.keys), e.at, e.priority)
        self.requests[e.req] = r
        self.stats.arrived += 1
        self.queue.append(r.id)

    def _on_tick(self, e: ev.Tick) -> None:
        for rid in self.retracted:
            r = self.requests[rid]
            r.prompt_len = r.seq_len
            r.decoded = 0
            r.reset_admission()
            self._move(r, Decision.RESUME)
            self.queue.append(rid)
        self.retracted = []
        self._admit()
        if self._to_query:
            op = next(self._ids)
            queries = tuple(
                (r.id, tuple(r.keys[r.device_pages + r.host_pages : r.prompt_len // self.cfg.page_size]))
                for r in self._to_query
            )
            self._queries[op] = _Query(op, [r.id for r in self._to_query])
            self._to_query = []
            self.stats.storage_queries += 1
            self._emit(cmd.QueryStorage(op, queries))
        if self._queries:
            self._agree(AgreeKind.L3_HITS, self._query_values(), self._on_l3_agreed)
        if self._prefetches:
            self._agree(AgreeKind.PREFETCH, self._prefetch_values(), self._on_prefetch_agreed)
        if self.cfg.tp_size > 1 and self._loads:
            self._agree(AgreeKind.LOAD, self._load_values(), self._on_load_agreed)
        self._issue_loads()
        if self._ready:
            self._start_ready()

    def _admit(self) -> None:
        cfg = self.cfg
        page = cfg.page_size
        while self.queue:
            r = self.requests[self.queue[0]]
            total = math.ceil(r.prompt_len / page)
            if total + cfg.decode_reserve_pages > cfg.l1_pages:
                self.queue.popleft()
                self._end(
                    r,
                    Decision.REJECT,
                    Outcome.FAILED,
                    f"needs {total + cfg.decode_reserve_pages} L1 pages, L1 holds {cfg.l1_pages}",
                )
                continue
            if not r.matched and not cfg.radix:
                r.matched = True  # no decode cache: everything comes from prefill
            if not r.matched:
                m = self.tree.match(r.keys, self.now)
                r.matched = True
                r.device_pages, r.host_pages = m.device_pages, m.host_pages
                r.slots = list(m.device_slots)
                r.host_slots_l2 = list(m.host_slots)
                r.lock = self.tree.lock(m.device_node)
                if m.host_pages:
                    r.pin = self.tree.pin_host(m.host_node)
            need = total - r.device_pages + cfg.decode_reserve_pages
            short = need - (self.device_pool.num_free - self.reserved)
            if short > 0:
                self.tree.evict_device(short)
                self._collect_tree()
                if need > self.device_pool.num_free - self.reserved:
                    return  # the head waits, keeping its match; nobody behind it holds anything
            self.queue.popleft()
            own = self.device_pool.alloc(total - r.device_pages, r.owner)
            assert own is not None
            r.slots += own
            r.shared = r.device_pages
            r.reserve = cfg.decode_reserve_pages
            self.reserved += r.reserve
            r.admitted_at = self.now
            r.account = r.account.add(l1=r.device_pages * page)  # fresh at each admission
            self.stats.admitted += 1
            self._plan_l2(r)
            candidates = r.prompt_len // page - r.device_pages - r.host_pages
            if (
                cfg.storage
                and r.l2_pages == r.host_pages
                and candidates >= max(1, cfg.prefetch_threshold_pages)
            ):
                self._move(r, Decision.ADMIT)
                self._to_query.append(r)
            else:
                self._move(r, Decision.ADMIT_LOCAL)
                self._plan_l3(r, 0)

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

    def _query_values(self) -> dict:
        out = {}
        for q in self._queries.values():
            for rid in q.reqs:
                out[("l3", q.op, rid)] = -1 if q.local is None else q.local.get(rid, 0)
        return out

    def _prefetch_values(self) -> dict:
        out = {}
        for p in self._prefetches.values():
            out[("progress", p.op)] = p.progress
            out[("final", p.op)] = int(p.phase.done)
        return out

    # ------------------------------------------------------------------ L3 query and the plan

    def _on_storage_queried(self, e: ev.StorageQueried) -> None:
        q = self._queries.get(e.op)
        if q is None:
            raise CoreError(f"StorageQueried: no query #{e.op} is in flight")
        if q.local is not None:
            raise CoreError(f"StorageQueried: query #{e.op} was answered already")
        try:
            hits = dict(e.hits)
        except (TypeError, ValueError):
            raise CoreError(f"StorageQueried #{e.op}: hits must be (request, pages) pairs") from None
        if (
            len(hits) != len(e.hits)
            or set(hits) - set(q.reqs)
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hits.values())
        ):
            raise CoreError(f"StorageQueried #{e.op}: bad answer {e.hits!r} for requests {q.reqs!r}")
        q.local = hits

    def _on_l3_agreed(self, values: dict) -> None:
        for q in list(self._queries.values()):
            agreed = {rid: values.get(("l3", q.op, rid), -1) for rid in q.reqs}
            if any(h < 0 for h in agreed.values()):
                continue  # some rank has no answer yet
            del self._queries[q.op]
            for rid, hits in agreed.items():
                r = self.requests[rid]
                if r.state is State.QUERYING:
                    self._move(r, Decision.L3_KNOWN)
                    self._plan_l3(r, hits)

    def _plan_l2(self, r: Request) -> None:
        """At admission: start loading the L2 span back at once (it overlaps the L3 query), or
        give it up when the promise policy says restoring it would delay the request."""
        l2, _ = choose_parts(
            self.cfg, r.host_pages, 0, prompt_tokens=r.prompt_len, device_pages=r.device_pages
        )
        if l2 < r.host_pages and r.pin is not None:
            self.tree.unpin_host(r.pin)
            r.pin = None
        r.l2_pages = l2
        if l2:
            self._queue_load(r, True, r.device_pages, r.host_slots_l2[:l2])

    def _plan_l3(self, r: Request, l3_hits: int) -> None:
        """Once the L3 hit is known: start the prefetch and promise the prefix to prefill."""
        cfg = self.cfg
        page = cfg.page_size
        l2 = r.l2_pages
        candidates = r.prompt_len // page - r.device_pages - r.host_pages
        l3 = min(l3_hits, candidates) if l2 == r.host_pages else 0  # the promise is a prefix
        if l3 < max(1, cfg.prefetch_threshold_pages):
            l3 = 0  # below the threshold L3 is neither fetched nor promised
        _, l3 = choose_parts(cfg, l2, l3, prompt_tokens=r.prompt_len, device_pages=r.device_pages)
        host: list[int] | None = None
        if l3:
            host = self.host_pool.alloc(l3, r.owner)
            if host is None:
                self.tree.evict_host(l3 - self.host_pool.num_free)
                host = self.host_pool.alloc(l3, r.owner)
            if host is None:
                l3 = 0
        r.l3_pages = l3
        start = r.device_pages
        if l3:
            assert host is not None
            op = next(self._ids)
            first = start + l2
            r.prefetch_op = op
            r.prefetch_slots = host
            r.prefetch_open = True
            self._prefetches[op] = _Prefetch(op, r.id, l3, list(host))
            self.stats.prefetches += 1
            self._emit(cmd.Prefetch(op, r.id, tuple(r.keys[first : first + l3]), tuple(host)))
            if cfg.prefetch_policy == "timeout":
                timer = next(self._ids)
                self._timers[timer] = (TimerKind.PREFETCH_TIMEOUT, op)
                at = self.now + cfg.prefetch_timeout(l3 * page)
                self._emit(cmd.SetTimer(timer, at, TimerKind.PREFETCH_TIMEOUT, op))
        if not (cfg.promise is PromisePolicy.CONFIRMED and l3):
            self._promise(r, start + l2 + l3)

    def _promise(self, r: Request, pages: int) -> None:
        r.promised_pages = pages
        self._request_kv(r, pages * self.cfg.page_size, r.prompt_len, fallback=False)

    def _request_kv(self, r: Request, start: int, end: int, *, fallback: bool, attempt: int = 0) -> None:
        t = self._new_transfer(r, start, end, fallback, attempt, TransferPhase.ACTIVE)
        if fallback and attempt == 0:
            r.account = r.account.add(fallback=end - start)
            self.stats.fallback_tokens += end - start
        self._send(r, t)

    def _new_transfer(
        self, r: Request, start: int, end: int, fallback: bool, attempt: int, phase: TransferPhase
    ) -> _Transfer:
        """A transfer of tokens [start, end) of `r` into its own slots, which it waits on."""
        page = self.cfg.page_size
        tid = next(self._ids)
        dst = r.slots[start // page : math.ceil(end / page)]
        t = _Transfer(tid, r.id, start, end, dst, attempt, fallback, phase)
        self._transfers[tid] = t
        r.transfers.add(tid)
        return t

    def _send(self, r: Request, t: _Transfer) -> None:
        self._emit(
            cmd.RequestKV(t.tid, r.id, t.start, t.end, tuple(t.dst), r.prompt_len, t.fallback, t.attempt)
        )

    # ------------------------------------------------------------------ restore track

    def _prefetch(self, e: ev.PrefetchProgress | ev.PrefetchDone) -> _Prefetch:
        p = self._prefetches.get(e.op)
        if p is None:
            raise CoreError(f"{type(e).__name__}: no prefetch #{e.op} is in flight")
        if not isinstance(e.pages, int) or isinstance(e.pages, bool) or e.pages < 0:
            raise CoreError(f"{type(e).__name__} #{e.op}: pages must be an integer >= 0, got {e.pages!r}")
        advance(PREFETCH, p.phase, type(e), p.req, f"prefetch #{p.op}")  # refuse before any change
        return p

    def _on_prefetch_progress(self, e: ev.PrefetchProgress) -> None:
        p = self._prefetch(e)
        p.move(ev.PrefetchProgress)
        p.progress = max(p.progress, min(e.pages, p.planned))

    def _on_prefetch_done(self, e: ev.PrefetchDone) -> None:
        p = self._prefetch(e)
        p.move(ev.PrefetchDone)
        p.progress = max(p.progress, min(e.pages, p.planned))

    def _on_timer(self, e: ev.TimerFired) -> None:
        entry = self._timers.get(e.timer)
        if entry is None:
            raise CoreError(f"TimerFired: no timer #{e.timer} is set")
        kind, op = entry
        if kind is TimerKind.TRANSFER_RETRY:
            t = self._transfers.get(op)
            if t is not None:  # else its request ended during the backoff: dropped unsent
                phase = t.next_phase(ev.TimerFired)
                del self._timers[e.timer]
                t.phase = phase
                self._send(self.requests[t.req], t)
                return
        else:
            p = self._prefetches.get(op)
            if p is not None:  # else the prefetch ended before its deadline
                p.move(ev.TimerFired)
                p.timed_out = True
        del self._timers[e.timer]

    def _on_prefetch_agreed(self, values: dict) -> None:
        for p in list(self._prefetches.values()):
            if ("progress", p.op) not in values:
                continue
            got = min(values[("progress", p.op)], p.planned)
            ended = bool(values[("final", p.op)])
            if p.phase in (PrefetchPhase.OPEN, PrefetchPhase.OPEN_DONE):
                r = self.requests[p.req]
                stop = prefetch_should_stop(
                    self.cfg.prefetch_policy,
                    progress=got,
                    planned=p.planned,
                    ended=ended,
                    timed_out=p.timed_out,
                    schedulable=r.promised_pages >= 0 and not r.transfers,
                )
                if stop:
                    if not ended and got < p.planned:
                        self._emit(cmd.CancelPrefetch(p.op))
                    self._settle(p, got)
            if ended:
                p.move(Step.END)
                if p.claims:
                    self.host_pool.free(p.claims, ("op", p.op))
                    p.claims = []
                del self._prefetches[p.op]

    def _settle(self, p: _Prefetch, fetched: int) -> None:
        """Fix how much of a prefetch the request uses; re-request the rest from prefill."""
        p.move(Step.SETTLE)
        r = self.requests[p.req]
        page = self.cfg.page_size
        r.prefetch_open = False
        rest = r.prefetch_slots[fetched:]
        if rest:
            self.host_pool.transfer(rest, r.owner, ("op", p.op))
            p.claims.extend(rest)
        r.prefetch_slots = r.prefetch_slots[:fetched]
        first = r.device_pages + r.l2_pages
        if fetched:
            self._queue_load(r, False, first, r.prefetch_slots)
        if r.promised_pages < 0:
            self._promise(r, first + fetched)  # confirmed: promise what is in L2 now
        elif fetched < p.planned:
            self._request_kv(r, (first + fetched) * page, (first + p.planned) * page, fallback=True)
        self._maybe_ready(r)

    def _queue_load(self, r: Request, from_l2: bool, first: int, host: list[int]) -> None:
        r.loads += 1
        device = r.slots[first : first + len(host)]
        anchor = r.pin.node if from_l2 and r.pin is not None else None
        self._load_queue.append(_LoadEntry(r.id, from_l2, first, list(host), device, anchor))

    def _issue_loads(self) -> None:
        """All restores ready this tick go into one merged LoadBack, up to K batches in flight."""
        if not self._load_queue or len(self._loads) >= self.cfg.load_batches_in_flight:
            return
        entries, self._load_queue = self._load_queue, []
        op = next(self._ids)
        self._loads[op] = _Load(op, entries)
        self.stats.load_batches += 1
        self.stats.max_loads_in_flight = max(self.stats.max_loads_in_flight, len(self._loads))
        out = tuple(cmd.LoadEntry(e.req, tuple(e.host_slots), tuple(e.device_slots)) for e in entries)
        self._emit(cmd.LoadBack(op, out))

    def _on_load_done(self, e: ev.LoadDone) -> None:
        load = self._loads.get(e.op)
        if load is None:
            raise CoreError(f"LoadDone: no load-back #{e.op} is in flight")
        advance(LOAD, load.phase, ev.LoadDone, "", f"load-back #{e.op}")
        total = sum(len(x.host_slots) for x in load.entries)
        bad = sorted(set(failed_pages(e.failed, total, f"LoadDone #{e.op}")))
        load.move(ev.LoadDone)
        start = 0
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            first = next((j - start for j in bad if start <= j < start + n), None)
            if first is not None:
                load.first_bad[i] = first
            start += n
        if self.cfg.tp_size == 1:
            self._finish_load(load, load.first_bad)
        # With several ranks a load's outcome may differ between them (one rank's copy fails):
        # the next tick agrees on it, and every rank falls back for the same pages.

    def _load_values(self) -> dict[tuple[object, ...], int]:
        out: dict[tuple[object, ...], int] = {}
        for load in self._loads.values():
            out[("done", load.op)] = int(load.phase is LoadPhase.COPIED)
            for i, entry in enumerate(load.entries):
                out[("ok", load.op, i)] = load.first_bad.get(i, len(entry.host_slots))
        return out

    def _on_load_agreed(self, values: dict) -> None:
        for load in list(self._loads.values()):
            if values.get(("done", load.op)) != 1:
                continue  # some rank's copy is still running
            first_bad = {
                i: k
                for i, entry in enumerate(load.entries)
                if (k := values.get(("ok", load.op, i), len(entry.host_slots))) < len(entry.host_slots)
            }
            self._finish_load(load, first_bad)

    def _finish_load(self, load: _Load, first_bad: dict[int, int]) -> None:
        """A load-back ended on every rank: account what arrived, fall back for the rest (from
        each entry's first bad page on), and drop bad L2 pages from the tree."""
        load.move(Step.END)
        del self._loads[load.op]
        page = self.cfg.page_size
        # Bad L2 pages leave the tree first, while every entry's pin still holds its span: two
        # entries may share an anchor, which the first drop cuts out of the tree.
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            good = min(first_bad.get(i, n), n)
            if good < n and entry.from_l2 and entry.anchor is not None:
                self.stats.bad_l2_pages += 1
                self.tree.drop_host(entry.anchor, entry.first_page + good, entry.host_slots[good])
        for i, entry in enumerate(load.entries):
            n = len(entry.host_slots)
            good = min(first_bad.get(i, n), n)
            if not entry.orphaned:
                r = self.requests[entry.req]
                if good < n:
                    start, end = (entry.first_page + good) * page, (entry.first_page + n) * page
                    self._request_kv(r, start, end, fallback=True)
                if entry.from_l2:
                    r.account = r.account.add(l2=good * page)
                    if r.pin is not None:
                        self.tree.unpin_host(r.pin)
                        r.pin = None
                else:
                    r.account = r.account.add(l3=good * page)
                    self.host_pool.free(entry.host_slots, r.owner)
                    r.prefetch_slots = []
                r.loads -= 1
                self._maybe_ready(r)
        if load.claims_device:
            self.device_pool.free(load.claims_device, ("op", load.op))
        if load.claims_host:
            self.host_pool.free(load.claims_host, ("op", load.op))
        for pin in load.pins:
            self.tree.unpin_host(pin)
        self._issue_loads()

    # ------------------------------------------------------------------ transfer track

    def _transfer(self, e: ev.KVArrived | ev.KVFailed | ev.KVAbandoned) -> _Transfer:
        t = self._transfers.get(e.transfer)
        if t is None or t.req != e.req:
            raise CoreError(
                f"{type(e).__name__}: no transfer #{e.transfer} for request {e.req!r} is in flight"
            )
        return t

    def _on_kv_arrived(self, e: ev.KVArrived) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVArrived)
        self._move(r, ev.KVArrived)
        was, t.phase = t.phase, phase
        del self._transfers[t.tid]
        if was is not TransferPhase.ACTIVE:  # orphaned or abandoned: the request ended already
            if t.claims:
                self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        r.transfers.discard(t.tid)
        r.account = r.account.add(transferred=t.end - t.start)
        self._maybe_ready(r)

    def _on_kv_failed(self, e: ev.KVFailed) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVFailed)
        if t.phase is not TransferPhase.ACTIVE:
            self._move(r, ev.KVFailed)  # late: the request ended already
            t.phase = phase
            del self._transfers[t.tid]
            if t.claims:
                self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        retry = t.attempt < self.cfg.transfer_retries
        self._next_state(r, ev.KVFailed if retry else Decision.TRANSFER_FAILED)
        t.phase = phase
        del self._transfers[t.tid]
        r.transfers.discard(t.tid)
        if retry:
            self._move(r, ev.KVFailed)  # QUERYING or RESTORING: retried
            self.stats.transfer_retries += 1
            attempt = t.attempt + 1
            cfg = self.cfg
            delay = retry_delay(cfg.transfer_backoff_s, cfg.transfer_backoff_max_s, r.id, attempt)
            if delay <= 0:
                self._request_kv(r, t.start, t.end, fallback=t.fallback, attempt=attempt)
                return
            # Back off: the retry waits, unsent, on the same slots until its timer fires.
            later = self._new_transfer(r, t.start, t.end, t.fallback, attempt, TransferPhase.WAITING)
            timer = next(self._ids)
            self._timers[timer] = (TimerKind.TRANSFER_RETRY, later.tid)
            self._emit(cmd.SetTimer(timer, self.now + delay, TimerKind.TRANSFER_RETRY, later.tid))
            return
        self._end(
            r,
            Decision.TRANSFER_FAILED,
            Outcome.FAILED,
            f"prefill transfer failed after {t.attempt + 1} attempts: {e.reason}",
        )

    def _on_kv_abandoned(self, e: ev.KVAbandoned) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        phase = t.next_phase(ev.KVAbandoned)
        if t.phase is TransferPhase.ORPHANED:  # the request ended already; the claims wait
            self._move(r, ev.KVAbandoned)
            t.phase = phase
            return
        self._next_state(r, Decision.TRANSFER_FAILED)
        t.phase = phase
        self.stats.transfers_abandoned += 1
        # No retry: a retry would write the same slots, which the abandoned transfer may still
        # overwrite. Ending the request leaves the transfer its slots until it ends.
        self._end(r, Decision.TRANSFER_FAILED, Outcome.FAILED, f"prefill transfer abandoned: {e.reason}")

    def _maybe_ready(self, r: Request) -> None:
        if (
            r.state is State.RESTORING
            and r.promised_pages >= 0
            and not r.prefetch_open
            and r.loads == 0
            and not r.transfers
        ):
            self._move(r, Decision.READY)
            r.ready_at = self.now
            a = r.account
            s = self.stats
            s.prompt_tokens += r.prompt_len
            s.l1_tokens += a.l1
            s.l2_tokens += a.l2
            s.l3_tokens += a.l3
            s.transferred_tokens += a.transferred
            self._ready.append(r.id)
            self._start_ready()

    def _start_ready(self) -> None:
        """Start READY requests, in order, while the decode batch has room."""
        limit = self.cfg.max_running
        while self._ready and (not limit or len(self._running) < limit):
            r = self.requests[self._ready.popleft()]
            self._move(r, Decision.START)
            self._running[r.id] = None
            page = self.cfg.page_size
            self._emit(
                cmd.StartDecode(
                    r.id,
                    tuple(r.slots),
                    r.prompt_len,
                    r.ready_at,
                    r.promised_pages * page,
                    r.account,
                )
            )

    # ------------------------------------------------------------------ decoding, retraction, finish

    def _on_decoded(self, e: ev.Decoded) -> None:
        r = self._req(e.req, e)
        self._next_state(r, ev.Decoded)
        if not isinstance(e.tokens, int) or isinstance(e.tokens, bool) or e.tokens < 0:
            raise CoreError(f"Decoded {e.req!r}: tokens must be an integer >= 0, got {e.tokens!r}")
        page = self.cfg.page_size
        seq = r.seq_len + e.tokens
        if len(r.keys) + len(e.new_keys) != seq // page:
            raise CoreError(
                f"Decoded {e.req!r}: {seq} tokens need {seq // page} page keys, the request has "
                f"{len(r.keys)} and the event brings {len(e.new_keys)}"
            )
        written = r.seq_len  # the KV of tokens before this step is in place
        r.decoded += e.tokens
        r.keys.extend(e.new_keys)
        had = len(r.slots)
        self._grow(r, written)
        if r.state is State.RUNNING and len(r.slots) > had:
            self._emit(cmd.ExtendKV(r.id, had, tuple(r.slots[had:])))

    def _grow(self, r: Request, written: int) -> None:
        """Give a running request the pages its tokens need: its reservation first, then free
        pages, then eviction, then retraction of running requests by policy. If `r` itself is
        retracted, only its first `written` tokens have KV (this step's never got room)."""
        need = math.ceil(r.seq_len / self.cfg.page_size)
        while len(r.slots) < need:
            if r.reserve > 0:
                r.reserve -= 1
                self.reserved -= 1
            elif self.device_pool.num_free - self.reserved < 1:
                self.tree.evict_device(1)
                self._collect_tree()
                if self.device_pool.num_free - self.reserved < 1:
                    victim = self._victim()
                    if victim is r:
                        self._retract(r, shed=0, written=written)
                        return
                    self._retract(victim, shed=need - len(r.slots), written=victim.seq_len)
                    continue
            slot = self.device_pool.alloc(1, r.owner)
            assert slot is not None
            r.slots += slot

    def _victim(self) -> Request:
        running = [self.requests[rid] for rid in self._running]
        policy = self.cfg.retract_policy
        if policy is RetractPolicy.NEWEST:
            return max(running, key=lambda x: (x.admitted_at, x.id))
        if policy is RetractPolicy.FEWEST_DECODED:
            return min(running, key=lambda x: (x.decoded, -x.admitted_at, x.id))
        return max(running, key=lambda x: (len(x.slots), x.id))

    def _store_in_tree(self, r: Request, shed: int = 0, written: int | None = None) -> None:
        """Hand a request's full pages whose KV is written (of its first `written` tokens, by
        default all) to the tree, prompt and output; free the rest. With `shed`, up to that many
        of its own last pages are freed at once instead: pages handed to the tree may not be
        evictable yet (a backup in flight), and a retraction needs room now."""
        keep = len(r.slots) - min(shed, len(r.slots) - r.shared)
        written = r.seq_len if written is None else written
        full = min(written // self.cfg.page_size, keep) if self.cfg.radix else 0
        if full:
            self.tree.insert(r.keys[:full], r.slots[:full], r.owner, self.now, priority=r.priority)
        tail = r.slots[max(full, r.shared) :]
        if tail:
            self.device_pool.free(tail, r.owner)
        r.slots = []
        if r.lock is not None:
            self.tree.unlock(r.lock)
            r.lock = None
        self.reserved -= r.reserve
        r.reserve = 0

    def _retract(self, r: Request, shed: int, written: int) -> None:
        self._move(r, Decision.RETRACT)
        del self._running[r.id]
        self._store_in_tree(r, shed, written)
        r.account = r.account.add(retractions=1)
        self.stats.retracted += 1
        self.retracted.append(r.id)
        self._emit(cmd.Retract(r.id))

    def _on_finished(self, e: ev.Finished) -> None:
        r = self._req(e.req, e)
        was = r.state
        self._move(r, ev.Finished)
        if was.terminal:
            return  # late, after an abort
        del self._running[r.id]
        self._store_in_tree(r)
        r.outcome = Outcome.FINISHED
        self.stats.finished += 1
        self._emit(cmd.Respond(r.id, Outcome.FINISHED, "", r.account))
        self._start_ready()

    # ------------------------------------------------------------------ abort and failure

    def _on_abort(self, e: ev.AbortRequested) -> None:
        r = self._req(e.req, e)
        if r.state.terminal:
            self._move(r, ev.AbortRequested)
            return
        self._end(r, ev.AbortRequested, Outcome.ABORTED, e.reason)

    def _end(self, r: Request, trigger: Trigger, outcome: Outcome, reason: str) -> None:
        was = r.state
        self._move(r, trigger)
        if was is State.RUNNING:
            del self._running[r.id]
        self._release(r)
        r.outcome, r.reason = outcome, reason
        if outcome is Outcome.ABORTED:
            self.stats.aborted += 1
        else:
            self.stats.failed += 1
        self._emit(cmd.Respond(r.id, outcome, reason, r.account))
        self._start_ready()

    def _claim(self, pool: SlotPool, slots: list[int], r: Request, owner: Owner) -> list[int]:
        mine = [s for s in slots if pool.owner_of(s) == r.owner]
        if mine:
            pool.transfer(mine, r.owner, owner)
        return mine

    def _release(self, r: Request) -> None:
        """Give back everything `r` holds; slots that in-flight I/O still writes or reads stay
        claimed by that operation until it completes."""
        if r.id in self.queue:
            self.queue.remove(r.id)
        if r.id in self.retracted:
            self.retracted.remove(r.id)
        if r.id in self._ready:
            self._ready.remove(r.id)
        if r in self._to_query:
            self._to_query.remove(r)
        for tid in sorted(r.transfers):
            t = self._transfers[tid]
            t.phase = t.next_phase(Step.ORPHAN)
            if t.phase is TransferPhase.ENDED:  # a retry still backing off: never sent, dropped
                del self._transfers[tid]
                continue
            t.claims = self._claim(self.device_pool, t.dst, r, ("xfer", tid))
        r.transfers = set()
        kept = []
        for entry in self._load_queue:
            if entry.req != r.id:
                kept.append(entry)
            elif not entry.from_l2:
                self.host_pool.free(entry.host_slots, r.owner)
        self._load_queue = kept
        for load in self._loads.values():
            for entry in load.entries:
                if entry.req != r.id or entry.orphaned:
                    continue
                entry.orphaned = True
                load.claims_device += self._claim(self.device_pool, entry.device_slots, r, ("op", load.op))
                if not entry.from_l2:
                    load.claims_host += self._claim(self.host_pool, entry.host_slots, r, ("op", load.op))
                elif r.pin is not None:
                    load.pins.append(r.pin)
                    r.pin = None
        p = self._prefetches.get(r.prefetch_op) if r.prefetch_op is not None else None
        if p is not None:
            if p.phase in (PrefetchPhase.OPEN, PrefetchPhase.OPEN_DONE):
                p.claims += self._claim(self.host_pool, p.slots, r, ("op", p.op))
                # Cancel even if this rank's copy ended: that is rank-local, and a driver
                # ignores a cancel that reaches a prefetch which has ended.
                self._emit(cmd.CancelPrefetch(p.op))
            p.move(Step.ORPHAN)
            p.req = ""
        own = [s for s in r.slots[r.shared :] if self.device_pool.owner_of(s) == r.owner]
        if own:
            self.device_pool.free(own, r.owner)
        host = [s for s in r.prefetch_slots if self.host_pool.owner_of(s) == r.owner]
        if host:
            self.host_pool.free(host, r.owner)
        r.slots, r.prefetch_slots = [], []
        r.prefetch_open = False
        r.loads = 0
        if r.lock is not None:
            self.tree.unlock(r.lock)
            r.lock = None
        if r.pin is not None:
            self.tree.unpin_host(r.pin)
            r.pin = None
        self.reserved -= r.reserve
        r.reserve = 0

    # ------------------------------------------------------------------ tree I/O completions

    def _on_backup_done(self, e: ev.BackupDone) -> None:
        self.tree.backup_done(e.op, e.failed)

    def _on_store_done(self, e: ev.StoreDone) -> None:
        self.tree.store_done(e.op, e.failed)

    # ------------------------------------------------------------------ operator and driver

    def _on_evict(self, e: ev.EvictRequested) -> None:
        for name, value in (("l1_pages", e.l1_pages), ("l2_pages", e.l2_pages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CoreError(f"EvictRequested: {name} must be an integer >= 0, got {value!r}")
        self.tree.evict_device(e.l1_pages)
        self.tree.evict_host(e.l2_pages)

    def _on_forget(self, e: ev.ForgetRequested) -> None:
        r = self._req(e.req, e)
        if not r.state.terminal:
            raise CoreError(f"ForgetRequested: request {e.req!r} has not ended ({r.state.value})")
        if e.req in self._forget:
            raise CoreError(f"ForgetRequested: request {e.req!r} is to be forgotten already")
        self._forget.add(e.req)

    def _busy(self, rid: str) -> bool:
        """Whether I/O in flight still refers to request `rid`."""
        return (
            any(rid in q.reqs for q in self._queries.values())
            or any(t.req == rid for t in self._transfers.values())
            or any(p.req == rid for p in self._prefetches.values())
            or any(e.req == rid for load in self._loads.values() for e in load.entries)
        )

    def _forget_idle(self) -> None:
        for rid in sorted(self._forget):
            if not self._busy(rid):
                self._forget.discard(rid)
                del self.requests[rid]

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
