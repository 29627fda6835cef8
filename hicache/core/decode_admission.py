"""Admission: arrivals queue; at each `Tick` the head of the queue is matched once against the
tree, its L1 path locked and its L2 path pinned, and L1 reserved for the whole request (the head
waits, keeping its match, when L1 cannot make room). One `QueryStorage` per tick asks L3 about
the requests admitted; once their hits are known (agreed across ranks) the promise policy plans
what to restore from L2 and L3 and what to receive from prefill."""

from __future__ import annotations

import math

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.commands import AgreeKind, Outcome, TimerKind
from hicache.core.config import PromisePolicy
from hicache.core.decode_ops import PrefetchOp, QueryOp
from hicache.core.decode_restore import DecodeRestore
from hicache.core.errors import CoreError
from hicache.core.promise import choose_parts
from hicache.core.request import Request
from hicache.core.states import Decision, State


class DecodeAdmission(DecodeRestore):
    """Arrival, the tick, matching and admission, the L3 query and the restore plan."""

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
            self._queries[op] = QueryOp(op, [r.id for r in self._to_query])
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

    # ------------------------------------------------------------------ L3 query and the plan

    def _query_values(self) -> dict:
        out = {}
        for q in self._queries.values():
            for rid in q.reqs:
                out[("l3", q.op, rid)] = -1 if q.local is None else q.local.get(rid, 0)
        return out

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
            self._prefetches[op] = PrefetchOp(op, r.id, l3, list(host))
            self.stats.prefetches += 1
            self._emit(cmd.Prefetch(op, r.id, tuple(r.keys[first : first + l3]), tuple(host)))
            if cfg.prefetch_policy == "timeout":
                timer = next(self._ids)
                self._timers[timer] = (TimerKind.PREFETCH_TIMEOUT, op)
                at = self.now + cfg.prefetch_timeout(l3 * page)
                self._emit(cmd.SetTimer(timer, at, TimerKind.PREFETCH_TIMEOUT, op))
        if not (cfg.promise is PromisePolicy.CONFIRMED and l3):
            self._promise(r, start + l2 + l3)
