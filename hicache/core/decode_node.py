"""The decode node's restore state machine: events in, commands out, no I/O.

For each request: match once (at the head of the admission queue), lock the L1 path and pin the
L2 path found, reserve L1 for the whole request, ask L3 (one query per tick for all admitted
requests), promise a prefix to prefill by policy, and run two tracks — restore (prefetch
L3->L2, merged load-backs L2->L1) and transfer (the increment from prefill). A restore that falls
short is trimmed and the missing range re-requested from prefill: no request fails because of a
cache fault. Only a prefill transfer failure (after retries) or an abort ends a request
unsuccessfully, with a reason.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable

import attrs

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.errors import CoreError, TransitionError
from hicache.core.pool import Owner, SlotPool
from hicache.core.promise import choose_parts
from hicache.core.request import Request
from hicache.core.states import TRANSITIONS, State
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
    transfer_retries: int = 0
    transfers_abandoned: int = 0


@attrs.define(slots=True, eq=False)
class _Query:
    op: int
    reqs: list[str]
    local: dict[str, int] | None = None


@attrs.define(slots=True, eq=False)
class _Prefetch:
    op: int
    req: str | None  # None once the request ended (the op still owns its claims)
    planned: int
    slots: list[int]
    progress: int = 0  # rank-local
    final: bool = False  # rank-local
    timed_out: bool = False
    settled: bool = False  # the request's usable length is decided
    cancelled: bool = False
    claims: list[int] = attrs.Factory(list)  # host slots the op owns until it ends


@attrs.define(slots=True, eq=False)
class _LoadEntry:
    req: str
    tier: str  # "l2" or "l3"
    first_page: int
    host_slots: list[int]
    device_slots: list[int]
    orphan: bool = False


@attrs.define(slots=True, eq=False)
class _Load:
    op: int
    entries: list[_LoadEntry]
    done: bool = False  # rank-local: this rank's copy has ended
    failed: set[str] = attrs.Factory(set)  # rank-local: requests whose pages did not arrive here
    claims_device: list[int] = attrs.Factory(list)
    claims_host: list[int] = attrs.Factory(list)
    pins: list = attrs.Factory(list)


@attrs.define(slots=True, eq=False)
class _Transfer:
    tid: int
    req: str
    start: int
    end: int
    dst: list[int]
    attempt: int
    fallback: bool
    orphan: bool = False
    claims: list[int] = attrs.Factory(list)
    abandoned: bool = False  # the driver could not stop it: only its outcome frees `claims`


class DecodeNodeCore:
    """One decode node's cache decisions. Feed events with `handle`; execute what it returns."""

    def __init__(self, config: DecodeConfig) -> None:
        self.cfg = config
        self.device_pool = SlotPool("L1", config.l1_pages)
        self.host_pool = SlotPool("L2", config.l2_pages)
        self.tree = TieredRadixTree(
            self.device_pool,
            self.host_pool,
            eviction=config.eviction,
            write_policy=config.write_policy,
            store_to_l3=config.storage,
            store_backlog_pages=int(config.store_backlog * config.l2_pages),
        )
        self.requests: dict[str, Request] = {}
        self.queue: deque[str] = deque()
        self.retracted: list[str] = []
        self.reserved = 0  # decode pages promised to admitted requests, still free in the pool
        self.stats = NodeStats()
        self.now = 0.0
        self._ids = itertools.count(1)
        self._outbox: list[cmd.Command] = []
        self._to_query: list[Request] = []
        self._queries: dict[int, _Query] = {}
        self._prefetches: dict[int, _Prefetch] = {}
        self._load_queue: list[_LoadEntry] = []
        self._loads: dict[int, _Load] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._timers: dict[int, int] = {}
        self._agreements: dict[int, tuple[str, Callable[[dict], None]]] = {}
        self._agreeing: set[str] = set()
        self._handlers: dict[type, Callable] = {
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
        }

    # ------------------------------------------------------------------ driving

    def handle(self, event: ev.Event) -> list[cmd.Command]:
        """Apply one event; return the commands to execute, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise CoreError(f"unknown event {event!r}")
        self.now = max(self.now, event.at)
        handler(event)
        self._collect_tree()
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

    def evict(self, l1_pages: int, l2_pages: int = 0, *, at: float | None = None) -> list[cmd.Command]:
        """An operator frees cache memory: up to `l1_pages` from L1 (demoted to L2 where the
        write policy backs them up) and `l2_pages` from L2, by the eviction policy; locked and
        pinned pages stay. Returns the commands to execute, like `handle`."""
        if at is not None:
            self.now = max(self.now, at)
        self.tree.evict_device(l1_pages)
        self.tree.evict_host(l2_pages)
        self._collect_tree()
        out, self._outbox = self._outbox, []
        return out

    def device_slots(self, rid: str) -> tuple[int, ...]:
        """The L1 pages holding a running request's KV, one per page of its sequence so far
        (a decoder writes each new token's KV into them; they grow on `Decoded`)."""
        r = self.requests.get(rid)
        if r is None:
            raise CoreError(f"device_slots: unknown request {rid!r}")
        return tuple(r.slots)

    def forget(self, rid: str) -> Request:
        """Drop a request that has ended and that no I/O refers to any more (a driver that
        replays a long trace calls this once it has read the request's account)."""
        r = self.requests.get(rid)
        if r is None or not r.state.terminal:
            raise CoreError(f"forget: request {rid!r} has not ended")
        busy = (
            any(rid in q.reqs for q in self._queries.values())
            or any(t.req == rid for t in self._transfers.values())
            or any(p.req == rid for p in self._prefetches.values())
            or any(e.req == rid for load in self._loads.values() for e in load.entries)
        )
        if busy:
            raise CoreError(f"forget: request {rid!r} still has I/O in flight")
        del self.requests[rid]
        return r

    def _emit(self, c: cmd.Command) -> None:
        self._outbox.append(c)

    def _collect_tree(self) -> None:
        self._outbox.extend(self.tree.drain())

    def _req(self, rid: str, event: object) -> Request:
        r = self.requests.get(rid)
        if r is None:
            raise CoreError(f"{type(event).__name__}: unknown request {rid!r}")
        return r

    def _move(self, r: Request, trigger: str) -> None:
        nxt = TRANSITIONS[r.state].get(trigger)
        if nxt is None:
            raise TransitionError(r.id, r.state.value, trigger)
        r.state = nxt

    # ------------------------------------------------------------------ arrival and admission

    def _on_arrived(self, e: ev.RequestArrived) -> None:
        if e.req in self.requests:
            raise CoreError(f"RequestArrived: request {e.req!r} already exists")
        page = self.cfg.page_size
        if e.prompt_len < 1 or len(e.keys) != e.prompt_len // page:
            raise CoreError(
                f"RequestArrived {e.req!r}: expected prompt_len >= 1 with prompt_len // {page} keys, "
                f"got prompt_len={e.prompt_len} and {len(e.keys)} keys"
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
            self._move(r, "resume")
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
            self._agree("l3_hits", self._query_values(), self._on_l3_agreed)
        if self._prefetches:
            self._agree("prefetch", self._prefetch_values(), self._on_prefetch_agreed)
        if self.cfg.tp_size > 1 and self._loads:
            self._agree("load", self._load_values(), self._on_load_agreed)
        self._issue_loads()

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
                    "reject",
                    "failed",
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
            r.account.l1 = r.device_pages * page
            self.stats.admitted += 1
            self._plan_l2(r)
            candidates = r.prompt_len // page - r.device_pages - r.host_pages
            if (
                cfg.storage
                and r.l2_pages == r.host_pages
                and candidates >= max(1, cfg.prefetch_threshold_pages)
            ):
                self._move(r, "admit")
                self._to_query.append(r)
            else:
                self._move(r, "admit_local")
                self._plan_l3(r, 0)

    # ------------------------------------------------------------------ agreement across ranks

    def _agree(self, kind: str, values: dict, apply: Callable[[dict], None]) -> None:
        """One collective per kind at a time; with one rank the answer is the local value."""
        if self.cfg.tp_size == 1:
            apply(values)
            return
        if kind in self._agreeing:
            return
        aid = next(self._ids)
        self._agreeing.add(kind)
        self._agreements[aid] = (kind, apply)
        self._emit(cmd.Agree(aid, kind, tuple(values.items())))

    def _on_agreed(self, e: ev.Agreed) -> None:
        entry = self._agreements.pop(e.agreement, None)
        if entry is None:
            raise CoreError(f"Agreed: no agreement #{e.agreement} is open")
        kind, apply = entry
        self._agreeing.discard(kind)
        apply(dict(e.values))

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
            out[("final", p.op)] = int(p.final)
        return out

    # ------------------------------------------------------------------ L3 query and the plan

    def _on_storage_queried(self, e: ev.StorageQueried) -> None:
        q = self._queries.get(e.op)
        if q is None:
            raise CoreError(f"StorageQueried: no query #{e.op} is in flight")
        hits = dict(e.hits)
        unknown = set(hits) - set(q.reqs)
        if unknown or any(h < 0 for h in hits.values()):
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
                    self._move(r, "l3_known")
                    self._plan_l3(r, hits)

    def _plan_l2(self, r: Request) -> None:
        """At admission: start loading the L2 span back at once (it overlaps the L3 query), or
        give it up when the promise policy says receiving it is faster."""
        l2, _ = choose_parts(self.cfg, r.host_pages, 0)
        if l2 < r.host_pages and r.pin is not None:
            self.tree.unpin_host(r.pin)
            r.pin = None
        r.l2_pages = l2
        if l2:
            self._queue_load(r, "l2", r.device_pages, r.host_slots_l2[:l2])

    def _plan_l3(self, r: Request, l3_hits: int) -> None:
        """Once the L3 hit is known: start the prefetch and promise the prefix to prefill."""
        cfg = self.cfg
        page = cfg.page_size
        l2 = r.l2_pages
        candidates = r.prompt_len // page - r.device_pages - r.host_pages
        l3 = min(l3_hits, candidates) if l2 == r.host_pages else 0  # the promise is a prefix
        if l3 < max(1, cfg.prefetch_threshold_pages):
            l3 = 0  # below the threshold L3 is neither fetched nor promised
        _, l3 = choose_parts(cfg, l2, l3)
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
                self._timers[timer] = op
                self._emit(cmd.SetTimer(timer, self.now + cfg.prefetch_timeout(l3 * page)))
        if not (cfg.promise == "confirmed" and l3):
            self._promise(r, start + l2 + l3)

    def _promise(self, r: Request, pages: int) -> None:
        r.promised_pages = pages
        self._request_kv(r, pages * self.cfg.page_size, r.prompt_len, fallback=False)

    def _request_kv(self, r: Request, start: int, end: int, *, fallback: bool, attempt: int = 0) -> None:
        page = self.cfg.page_size
        tid = next(self._ids)
        dst = r.slots[start // page : math.ceil(end / page)]
        self._transfers[tid] = _Transfer(tid, r.id, start, end, dst, attempt, fallback)
        r.transfers.add(tid)
        if fallback and attempt == 0:
            r.account.fallback += end - start
            self.stats.fallback_tokens += end - start
        self._emit(cmd.RequestKV(tid, r.id, start, end, tuple(dst)))

    # ------------------------------------------------------------------ restore track

    def _on_prefetch_progress(self, e: ev.PrefetchProgress) -> None:
        p = self._prefetch(e)
        p.progress = max(p.progress, min(e.pages, p.planned))

    def _on_prefetch_done(self, e: ev.PrefetchDone) -> None:
        p = self._prefetch(e)
        if p.final:
            raise CoreError(f"PrefetchDone: prefetch #{e.op} already ended")
        p.progress = max(p.progress, min(e.pages, p.planned))
        p.final = True

    def _prefetch(self, e: ev.PrefetchProgress | ev.PrefetchDone) -> _Prefetch:
        p = self._prefetches.get(e.op)
        if p is None:
            raise CoreError(f"{type(e).__name__}: no prefetch #{e.op} is in flight")
        return p

    def _on_timer(self, e: ev.TimerFired) -> None:
        op = self._timers.pop(e.timer, None)
        if op is None:
            raise CoreError(f"TimerFired: no timer #{e.timer} is set")
        p = self._prefetches.get(op)
        if p is not None:
            p.timed_out = True

    def _on_prefetch_agreed(self, values: dict) -> None:
        for p in list(self._prefetches.values()):
            if ("progress", p.op) not in values:
                continue
            got = min(values[("progress", p.op)], p.planned)
            ended = bool(values[("final", p.op)])
            if not p.settled and p.req is None:
                p.settled = True  # the request ended: only the op's claims remain
            if not p.settled:
                r = self.requests[p.req]  # type: ignore[index]
                stop = ended or got >= p.planned
                if not stop:
                    policy = self.cfg.prefetch_policy
                    if policy == "timeout" and p.timed_out:
                        stop = True
                    elif policy == "best_effort" and r.promised_pages >= 0 and not r.transfers:
                        stop = True  # the request could be scheduled now: use what arrived
                if stop:
                    if not ended and got < p.planned:
                        p.cancelled = True
                        self._emit(cmd.CancelPrefetch(p.op))
                    self._settle(p, got)
            if ended:
                if p.claims:
                    self.host_pool.free(p.claims, ("op", p.op))
                    p.claims = []
                del self._prefetches[p.op]

    def _settle(self, p: _Prefetch, fetched: int) -> None:
        """Fix how much of a prefetch the request uses; re-request the rest from prefill."""
        p.settled = True
        r = self.requests[p.req]  # type: ignore[index]
        page = self.cfg.page_size
        r.prefetch_open = False
        rest = r.prefetch_slots[fetched:]
        if rest:
            self.host_pool.transfer(rest, r.owner, ("op", p.op))
            p.claims.extend(rest)
        r.prefetch_slots = r.prefetch_slots[:fetched]
        first = r.device_pages + r.l2_pages
        if fetched:
            self._queue_load(r, "l3", first, r.prefetch_slots)
        if r.promised_pages < 0:
            self._promise(r, first + fetched)  # confirmed: promise what is in L2 now
        elif fetched < p.planned:
            self._request_kv(r, (first + fetched) * page, (first + p.planned) * page, fallback=True)
        self._maybe_ready(r)

    def _queue_load(self, r: Request, tier: str, first: int, host: list[int]) -> None:
        r.loads += 1
        device = r.slots[first : first + len(host)]
        self._load_queue.append(_LoadEntry(r.id, tier, first, list(host), device))

    def _issue_loads(self) -> None:
        """All restores ready this tick go into one merged LoadBack, up to K batches in flight."""
        if not self._load_queue or len(self._loads) >= self.cfg.load_batches_in_flight:
            return
        entries, self._load_queue = self._load_queue, []
        op = next(self._ids)
        self._loads[op] = _Load(op, entries)
        self.stats.load_batches += 1
        self.stats.max_loads_in_flight = max(self.stats.max_loads_in_flight, len(self._loads))
        host = tuple(s for e in entries for s in e.host_slots)
        device = tuple(s for e in entries for s in e.device_slots)
        self._emit(cmd.LoadBack(op, host, device, tuple(dict.fromkeys(e.req for e in entries))))

    def _on_load_done(self, e: ev.LoadDone) -> None:
        load = self._loads.get(e.op)
        if load is None or load.done:
            raise CoreError(f"LoadDone: no load-back #{e.op} is in flight")
        load.done = True
        load.failed = set(e.failed)
        if self.cfg.tp_size == 1:
            self._finish_load(load, load.failed)
        # With several ranks a load's outcome may differ between them (one rank's copy fails):
        # the next tick agrees on it, and every rank falls back for the same requests.

    def _load_values(self) -> dict:
        out = {}
        for load in self._loads.values():
            out[("done", load.op)] = int(load.done)
            for entry in load.entries:
                out[("ok", load.op, entry.req)] = int(entry.req not in load.failed)
        return out

    def _on_load_agreed(self, values: dict) -> None:
        for load in list(self._loads.values()):
            if values.get(("done", load.op)) != 1:
                continue  # some rank's copy is still running
            failed = {e.req for e in load.entries if values.get(("ok", load.op, e.req), 1) == 0}
            self._finish_load(load, failed)

    def _finish_load(self, load: _Load, failed: set[str]) -> None:
        """A load-back ended on every rank: account what arrived, fall back for what did not."""
        del self._loads[load.op]
        page = self.cfg.page_size
        for entry in load.entries:
            if entry.orphan:
                continue
            r = self.requests[entry.req]
            n = len(entry.host_slots)
            if entry.req in failed:
                self._request_kv(r, entry.first_page * page, (entry.first_page + n) * page, fallback=True)
            elif entry.tier == "l2":
                r.account.l2 += n * page
            else:
                r.account.l3 += n * page
            if entry.tier == "l2" and r.pin is not None:
                self.tree.unpin_host(r.pin)
                r.pin = None
            elif entry.tier == "l3":
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

    def _on_kv_arrived(self, e: ev.KVArrived) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        self._move(r, "KVArrived")
        del self._transfers[t.tid]
        if t.orphan:
            self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        r.transfers.discard(t.tid)
        r.account.transferred += t.end - t.start
        self._maybe_ready(r)

    def _on_kv_failed(self, e: ev.KVFailed) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        del self._transfers[t.tid]
        if t.orphan:
            self._move(r, "KVFailed")
            self.device_pool.free(t.claims, ("xfer", t.tid))
            return
        r.transfers.discard(t.tid)
        if t.attempt < self.cfg.transfer_retries:
            self._move(r, "KVFailed")  # QUERYING or RESTORING: retried
            self.stats.transfer_retries += 1
            self._request_kv(r, t.start, t.end, fallback=t.fallback, attempt=t.attempt + 1)
            return
        self._end(
            r,
            "transfer_failed",
            "failed",
            f"prefill transfer failed after {t.attempt + 1} attempts: {e.reason}",
        )

    def _on_kv_abandoned(self, e: ev.KVAbandoned) -> None:
        r = self._req(e.req, e)
        t = self._transfer(e)
        if t.orphan:  # the request ended already; the claims wait for the transfer's outcome
            self._move(r, "KVAbandoned")
            if t.abandoned:
                raise CoreError(f"KVAbandoned: transfer #{t.tid} of {r.id!r} was abandoned already")
            t.abandoned = True
            return
        t.abandoned = True
        self.stats.transfers_abandoned += 1
        # No retry: a retry would write the same slots, which the abandoned transfer may still
        # overwrite. Ending the request orphans the transfer, its slots claimed until it ends.
        self._end(r, "transfer_failed", "failed", f"prefill transfer abandoned: {e.reason}")

    def _transfer(self, e: ev.KVArrived | ev.KVFailed | ev.KVAbandoned) -> _Transfer:
        t = self._transfers.get(e.transfer)
        if t is None or t.req != e.req:
            raise CoreError(
                f"{type(e).__name__}: no transfer #{e.transfer} for request {e.req!r} is in flight"
            )
        return t

    def _maybe_ready(self, r: Request) -> None:
        if (
            r.state is State.RESTORING
            and r.promised_pages >= 0
            and not r.prefetch_open
            and r.loads == 0
            and not r.transfers
        ):
            self._move(r, "ready")
            a = r.account
            s = self.stats
            s.prompt_tokens += r.prompt_len
            s.l1_tokens += a.l1
            s.l2_tokens += a.l2
            s.l3_tokens += a.l3
            s.transferred_tokens += a.transferred
            self._emit(cmd.StartDecode(r.id, tuple(r.slots)))

    # ------------------------------------------------------------------ decoding, retraction, finish

    def _on_decoded(self, e: ev.Decoded) -> None:
        r = self._req(e.req, e)
        self._move(r, "Decoded")
        if e.tokens < 0:
            raise CoreError(f"Decoded {e.req!r}: tokens must be >= 0, got {e.tokens}")
        written = r.seq_len  # the KV of tokens before this step is in place
        r.decoded += e.tokens
        r.keys.extend(e.new_keys)
        if len(r.keys) != r.seq_len // self.cfg.page_size:
            raise CoreError(
                f"Decoded {e.req!r}: {r.seq_len} tokens need {r.seq_len // self.cfg.page_size} page keys, "
                f"the request has {len(r.keys)}"
            )
        self._grow(r, written)

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
        running = [x for x in self.requests.values() if x.state is State.RUNNING]
        policy = self.cfg.retract_policy
        if policy == "newest":
            return max(running, key=lambda x: (x.admitted_at, x.id))
        if policy == "fewest_decoded":
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
        self._move(r, "retract")
        self._store_in_tree(r, shed, written)
        r.account.retractions += 1
        self.stats.retracted += 1
        self.retracted.append(r.id)
        self._emit(cmd.Retract(r.id))

    def _on_finished(self, e: ev.Finished) -> None:
        r = self._req(e.req, e)
        was = r.state
        self._move(r, "Finished")
        if was.terminal:
            return  # late, after an abort
        self._store_in_tree(r)
        r.outcome = "finished"
        self.stats.finished += 1
        self._emit(cmd.Respond(r.id, "finished"))

    # ------------------------------------------------------------------ abort and failure

    def _on_abort(self, e: ev.AbortRequested) -> None:
        r = self._req(e.req, e)
        if r.state.terminal:
            self._move(r, "AbortRequested")
            return
        self._end(r, "AbortRequested", "aborted", e.reason)

    def _end(self, r: Request, trigger: str, outcome: str, reason: str) -> None:
        self._move(r, trigger)
        self._release(r)
        r.outcome, r.reason = outcome, reason
        if outcome == "aborted":
            self.stats.aborted += 1
        else:
            self.stats.failed += 1
        self._emit(cmd.Respond(r.id, outcome, reason))

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
        if r in self._to_query:
            self._to_query.remove(r)
        for tid in sorted(r.transfers):
            t = self._transfers[tid]
            t.orphan = True
            t.claims = self._claim(self.device_pool, t.dst, r, ("xfer", tid))
        r.transfers = set()
        kept = []
        for entry in self._load_queue:
            if entry.req != r.id:
                kept.append(entry)
            elif entry.tier == "l3":
                self.host_pool.free(entry.host_slots, r.owner)
        self._load_queue = kept
        for load in self._loads.values():
            for entry in load.entries:
                if entry.req != r.id or entry.orphan:
                    continue
                entry.orphan = True
                load.claims_device += self._claim(self.device_pool, entry.device_slots, r, ("op", load.op))
                if entry.tier == "l3":
                    load.claims_host += self._claim(self.host_pool, entry.host_slots, r, ("op", load.op))
                elif r.pin is not None:
                    load.pins.append(r.pin)
                    r.pin = None
        p = self._prefetches.get(r.prefetch_op) if r.prefetch_op is not None else None
        if p is not None:
            if not p.settled:
                p.claims += self._claim(self.host_pool, p.slots, r, ("op", p.op))
                if not p.cancelled:  # not `p.final`: that is rank-local; a driver ignores a late cancel
                    p.cancelled = True
                    self._emit(cmd.CancelPrefetch(p.op))
            p.req = None
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
        self.tree.backup_done(e.op)

    def _on_store_done(self, e: ev.StoreDone) -> None:
        self.tree.store_done(e.op)

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Verify the node's invariants (tree, pools, per-request holdings)."""
        self.tree.check()
        if self.reserved != sum(r.reserve for r in self.requests.values()):
            raise CoreError("reserved pages do not add up to the requests' reservations")
        if self.device_pool.num_free < self.reserved:
            raise CoreError(
                f"{self.reserved} decode pages reserved but only {self.device_pool.num_free} free"
            )
        head = self.queue[0] if self.queue else None
        for r in self.requests.values():
            if r.state is State.QUEUED and r.id != head and (r.matched or r.lock or r.pin or r.slots):
                raise CoreError(f"request {r.id!r} waits behind the head but holds a match")
            if r.state.terminal or r.state is State.RETRACTED:
                held = (r.lock, r.pin, r.slots, r.prefetch_slots, r.transfers, r.reserve, r.loads)
                if any(held):
                    raise CoreError(f"request {r.id!r} is {r.state.value} but still holds {held!r}")
