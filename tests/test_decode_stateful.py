"""Stateful property test of the decode-node core, driven through the ground-truth `World`.

Random interleavings of arrivals (multi-turn: shared prefixes, earlier conversations' prompt +
output, random suffixes), ticks, storage answers (full and capped), prefetch progress and ends
(complete, partial, zero), load-backs (ok and failed), prefill transfers (arrived, failed,
abandoned while still writing; retries sent at once or after a backoff timer),
backups, stores, timers, decode growth (retraction under pressure), finishes, aborts at any
phase, operator evictions, and a shared L3 that other nodes fill and evict. Tiny pools, every
policy combination.

Copies of the tree fail too, one at a time or persistently: a world draws which kinds of copy
keep failing (backups, stores, load-backs) and how long the tree's copies stay in flight, so
backups of nested spans overlap (a turn's pages backed up while the previous turn's backup still
runs), stores race new backups of the same pages, and twins arriving in one tick share an L2
span and its anchor in one load-back. Under write-back with backups that always fail, the cache
must still make room.

The world models every L1/L2 slot and L3 page by the identity of the KV it holds, including the
writes of I/O still in flight after its request ended (late transfers write their slots; torn
prefetches and failed transfers leave garbage), so a slot reused too early shows up as wrong KV.
After every step: the core's own invariants, every page the tree holds is its key's KV in the
world, a live request's locked L1 prefix is untouched, at most K load-back batches in flight,
every request handed to decode has exactly the right KV (`WrongKV`) and an account adding up to
its prompt, and a failure is only ever a transfer failure or a prompt too large for L1. At the
end everything settles, every request is answered once, nothing but the tree holds a slot,
and every slot comes back.

The world (`tests/kvworld.py`) also keeps every copy in flight until its completion: a command
that reads a slot still being written, or writes one still being read, is a `Hazard`; and
after every step every page the tree holds as valid on L1, L2 or L3 must hold its own bytes.
"""

from __future__ import annotations

import itertools
import random

import hypothesis.strategies as st
import pytest
from builders import examples
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvworld import World, corrupt

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import PREFETCH_POLICIES, PROMISE_POLICIES, RETRACT_POLICIES, DecodeConfig
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.lifecycles import TransferPhase
from hicache.core.states import State
from hicache.core.write_policy import WritePolicy

WAITING = TransferPhase.WAITING  # a transfer retry backing off
OUTCOME = {State.FINISHED: "finished", State.ABORTED: "aborted", State.FAILED: "failed"}
ADMITTED = (
    State.QUERYING,
    State.RESTORING,
    State.READY,
    State.RUNNING,
)  # holding L1 (and a lock on its match)


@st.composite
def configs(draw: st.DrawFn) -> DecodeConfig:
    page = draw(st.integers(2, 4), label="page_size")
    promise = draw(st.sampled_from(PROMISE_POLICIES), label="promise")
    estimates: dict[str, float] = {}
    if promise == "adaptive":
        # A span's overlap window is ~ network_latency + r seconds for the r prompt tokens from
        # its start on (prefill at 1 token/s); restoring t tokens costs ~2t / h2d from L2 and
        # l3_latency + 2t / h2d from L3. With these choices both outcomes happen for each tier,
        # depending on the span's length and where it starts.
        estimates = dict(
            kv_bytes_per_token=2.0,
            network_bandwidth=1e9,
            prefill_tokens_per_s=1.0,
            l3_bandwidth=1e9,
            network_latency=draw(st.sampled_from([0.0, 4.0, 9.0])),
            host_to_device_bandwidth=draw(st.sampled_from([1e9, 1.0])),
            l3_latency=draw(st.sampled_from([0.0, 5.0, 12.0])),
        )
    radix = draw(st.sampled_from([True] * 7 + [False]), label="radix")  # False: no decode cache
    return DecodeConfig(
        l1_pages=draw(st.integers(12, 40), label="l1_pages"),
        l2_pages=draw(st.integers(0, 60), label="l2_pages") if radix else 0,
        page_size=page,
        eviction=draw(st.sampled_from(sorted(EVICTION_POLICIES))),
        write_policy=draw(st.sampled_from([p.value for p in WritePolicy])),
        storage=draw(st.sampled_from([True, True, False]), label="storage") if radix else False,
        radix=radix,
        store_backlog=draw(st.sampled_from([0.25, 0.0, 10.0]), label="store_backlog"),
        promise=promise,
        prefetch_policy=draw(st.sampled_from(PREFETCH_POLICIES)),
        prefetch_threshold_tokens=draw(st.integers(0, 2 * page)),
        prefetch_timeout_base=draw(st.sampled_from([0.0, 0.01, 1.0])),
        prefetch_timeout_per_ki_token=0.5,
        prefetch_timeout_max=draw(st.sampled_from([0.005, 5.0])),
        load_batches_in_flight=draw(st.integers(1, 3)),
        decode_reserve_tokens=draw(st.integers(0, 2 * page)),
        transfer_retries=draw(st.integers(0, 2)),
        # A retry backs off (its timer fires through `fire_timer` and `advance`), or not.
        transfer_backoff_s=draw(st.sampled_from([0.0, 0.0, 0.002, 1.0]), label="transfer_backoff_s"),
        transfer_backoff_max_s=draw(st.sampled_from([5.0, 0.003]), label="transfer_backoff_max_s"),
        retract_policy=draw(st.sampled_from(RETRACT_POLICIES)),
        max_running=draw(st.sampled_from([0, 0, 1, 2]), label="max_running"),  # 0: no batch limit
        **estimates,
    )


def _tokens(n: int, salt: object) -> list[int]:
    """`n` pseudo-random tokens, fixed by `salt` (cheaper to draw and to shrink than lists)."""
    return random.Random(repr(salt)).choices(range(50), k=n)


def _pick(data: st.DataObject, items: object, label: str) -> object:
    return data.draw(st.sampled_from(sorted(items)), label=label)  # type: ignore[call-overload]


class DecodeNodeMachine(RuleBasedStateMachine):
    """Drives one `World` (one decode node) with every event in every order the protocol allows."""

    # ------------------------------------------------------------------ setup

    @initialize(cfg=configs(), data=st.data())
    def setup(self, cfg: DecodeConfig, data: st.DataObject) -> None:
        self.cfg = cfg
        self.world = World(cfg)
        self.core = self.world.core
        self.page = cfg.page_size
        self.fits = (cfg.l1_pages - cfg.decode_reserve_pages) * cfg.page_size  # longest admissible prompt
        sizes = st.lists(st.integers(1, 6 * cfg.page_size), min_size=1, max_size=3)
        self.prefixes = [_tokens(n, ("prefix", i)) for i, n in enumerate(data.draw(sizes, label="prefixes"))]
        self.rids: list[str] = []
        self.threads: dict[int, str] = {}  # conversation -> its latest request (for `advance`)
        self.aged: dict[object, int] = {}  # I/O in flight -> how many `advance` rounds it has seen
        self.rounds = 0  # `advance` rounds so far (every third completes I/O newest first)
        self.ids = itertools.count()
        self.progress: dict[int, int] = {}  # prefetch op -> pages written to L2 and reported
        self.l3_dropped: set[int] = set()  # keys L3 lost behind the node's back
        self.abandoned: set[int] = set()  # transfers given up on, still writing until they end
        self.locked: dict[str, tuple[int, dict[int, object]]] = {}  # rid -> (admission, locked L1 KV)
        self.steady = True  # every step so far passed its checks (teardown then checks the end)
        # Which kinds of copy keep failing (each completion of that kind fails), and how many
        # `advance` rounds the tree's own copies stay in flight (long: backups of nested spans
        # overlap, stores race the next backup).
        kinds = st.sampled_from(["none", "none", "backup", "store", "load", "backup+store+load"])
        self.persistent = set(data.draw(kinds, label="persistent failures").split("+")) - {"none"}
        self.tree_age = data.draw(st.sampled_from([1, 1, 3, 6]), label="tree I/O rounds")
        self.fail_at = data.draw(st.sampled_from(["first", "last", "random"]), label="fails at")
        for kind in sorted(self.persistent):
            event(f"{kind} copies keep failing under {cfg.write_policy.value}")
        if cfg.storage and data.draw(st.booleans(), label="warm L3"):
            for tokens in self.prefixes:  # other nodes served these prefixes before
                self.world.l3.update((k, k) for k in self.world.keys_of(tokens))
        self.world.observe = self._check_command

    # ------------------------------------------------------------------ helpers

    def _begin(self) -> None:
        self.steady = False

    def _states(self, *states: State) -> list[str]:
        return [rid for rid, r in self.core.requests.items() if r.state in states]

    def _live(self) -> list[str]:
        return [rid for rid, r in self.core.requests.items() if not r.state.terminal]

    def _running(self) -> list[str]:
        return self._states(State.RUNNING)

    def _sources(self) -> list[list[int]]:
        return [[], *self.prefixes, *(self.world.tokens[rid] for rid in self.rids)]

    def _arrive(self, tokens: list[int], priority: int) -> None:
        rid = f"r{next(self.ids)}"
        self.rids.append(rid)
        self.world.arrive(rid, tokens or [0], priority)

    def _decode(self, rid: str, n: int) -> None:
        """`rid` generated `n` tokens. As in `World.decode`, the KV of a step's tokens is written
        after `Decoded`, into the pages the request holds then, and only if it still runs."""
        w, page = self.world, self.page
        r = self.core.requests[rid]
        before = r.seq_len
        w.tokens[rid] = w.tokens[rid] + _tokens(n, ("decode", rid, before))
        w.feed(ev.Decoded(w.now, rid, n, w.keys_of(w.tokens[rid])[before // page :]))
        if r.state is State.RUNNING:
            for i in range(before // page, len(r.slots)):
                w.l1[r.slots[i]] = w.truth(rid, i)
        else:
            event("a decode step retracted its own request")

    def _copy_prefetch(self, op: int, pages: int) -> int:
        """Write pages of prefetch `op` from L3 into L2 up to `pages` (stopping at the first page
        L3 no longer holds); return how many are complete. Pages already reported complete are
        never written again (`PrefetchProgress`): the core may have reused their slots."""
        w = self.world
        p = w.prefetches[op]
        done = self.progress.get(op, 0)
        while done < min(pages, len(p.keys)) and p.keys[done] in w.l3:
            w.l2[p.host_slots[done]] = w.l3[p.keys[done]]
            done += 1
        self.progress[op] = done
        return done

    def _end_prefetch(self, op: int, pages: int = 1 << 30) -> None:
        w = self.world
        got = self._copy_prefetch(op, pages)
        p = w.prefetches.pop(op)
        for h in p.host_slots[got:]:  # an ended prefetch may have torn-written its other slots
            w.l2[h] = ("torn prefetch", op)
        del self.progress[op]
        w.feed(ev.PrefetchDone(w.now, op, got))

    def _kv_fail(self, tid: int) -> None:
        w = self.world
        for s in w.transfers[tid].dst_slots:  # a failed transfer may have written part of its slots
            w.l1[s] = ("torn transfer", tid)
        w.kv_fail(tid)

    def _kv_arrive(self, tid: int) -> None:
        w = self.world
        c = w.transfers[tid]
        if self.core.requests[c.req].state.terminal:
            for s in c.dst_slots:  # in flight when its request ended: it still writes its slots
                w.l1[s] = ("late transfer", tid)
        w.kv_arrive(tid)

    def _persistent_failure(self, n: int) -> tuple[int, ...]:
        """The failed pages of a copy of `n` pages whose kind keeps failing."""
        if n == 0:
            return ()
        at = {"first": 0, "last": n - 1}.get(self.fail_at, random.Random(repr((n, self.rounds))).randrange(n))
        return (at,)

    def _backup_done(self, op: int) -> None:
        """A backup ends as the world's failure mode says (in `advance`)."""
        n = len(self.world.backups[op].host_slots)
        self.world.backup_done(op, self._persistent_failure(n) if "backup" in self.persistent else ())

    def _store_done(self, op: int) -> None:
        n = len(self.world.stores[op].keys)
        self.world.store_done(op, self._persistent_failure(n) if "store" in self.persistent else ())

    def _load_done(self, op: int) -> None:
        load = self.world.loads[op]
        bad = self._persistent_failure(len(load.device_slots)) if "load" in self.persistent else ()
        self.world.load_done(op, bad_pages=bad)

    # ------------------------------------------------------------------ the world runs on

    # Hypothesis favours the first rules in its order (fewest arguments first, then by name):
    # `advance`, `fault` and `tick` take none, so requests get through their many protocol steps
    # even when swarm testing switches most of the other rules off.
    @rule()
    def advance(self) -> None:
        """One round of normal operation: I/O in flight since the last round (prefetches and
        load-backs: the last two) completes successfully, oldest first (every third round newest
        first), so new I/O overlaps old (I/O of requests that ended comes last, once nothing else
        is in flight); every running request decodes a page (or finishes once it has two); one
        of three conversations comes back for another turn while fewer than three requests are
        live. Then a tick."""
        self._begin()
        w, page = self.world, self.page
        done = {rid for rid, r in self.core.requests.items() if r.state.terminal}
        ops = [
            *((op, w.answer_query, w.queries, False) for op in w.queries),
            *((op, self._end_prefetch, w.prefetches, w.prefetches[op].req in done) for op in w.prefetches),
            *((op, self._load_done, w.loads, set(w.loads[op].reqs) <= done) for op in w.loads),
            *((tid, self._kv_arrive, w.transfers, w.transfers[tid].req in done) for tid in w.transfers),
            *((timer, w.fire_timer, w.timers, False) for timer in w.timers),
            *((("tree", op), self._backup_done, w.backups, False) for op in w.backups),
            *((("tree", op), self._store_done, w.stores, False) for op in w.stores),
        ]
        only_late = all(late for *_, late in ops)
        self.rounds += 1
        newest_first = self.rounds % 3 == 0
        order = sorted(ops, key=lambda x: (isinstance(x[0], tuple), x[0]), reverse=newest_first)
        for op, complete, pending, late in order:
            slow = pending is w.loads or pending is w.prefetches
            age = self.tree_age if isinstance(op, tuple) else 1 + slow
            if self.aged.get(op, 0) >= age and (only_late or not late):
                key = op[1] if isinstance(op, tuple) else op
                if key in pending:
                    complete(key)
        for rid in self._running():
            if self.core.requests[rid].state is State.RUNNING:
                if self.core.requests[rid].decoded >= 2 * page:
                    w.finish(rid)
                else:
                    self._decode(rid, page)
        if len(self._live()) < 3:
            turn = len(self.rids)
            thread = turn % 3
            last = self.threads.get(thread)
            base = w.tokens[last] if last else self.prefixes[thread % len(self.prefixes)]
            if len(base) + page + 1 > self.fits:
                base = self.prefixes[thread % len(self.prefixes)]
            self._arrive(base + _tokens(page + 1, ("turn", turn)), thread)
            self.threads[thread] = self.rids[-1]
        w.tick()
        flight = [*w.queries, *w.prefetches, *w.loads, *w.transfers, *w.timers]
        flight += [("tree", op) for op in (*w.backups, *w.stores)]
        self.aged = {op: self.aged.get(op, 0) + 1 for op in flight}

    @precondition(lambda self: self.world.prefetches or self.world.loads or self.world.transfers)
    @rule()
    def fault(self) -> None:
        """The oldest prefetch, load-back or transfer in flight goes wrong: the prefetch ends
        with no more pages than already reported, the load-back loses every request's pages, the
        transfer fails. (The rules below do the same to any item, but less often.)"""
        self._begin()
        w = self.world
        op = min([*w.prefetches, *w.loads, *w.transfers])
        if op in w.prefetches:
            self._end_prefetch(op, self.progress.get(op, 0))
        elif op in w.loads:
            w.load_done(op, w.loads[op].reqs)
        else:
            self._kv_fail(op)

    @rule()
    def tick(self) -> None:
        self._begin()
        self.world.tick()

    # ------------------------------------------------------------------ requests

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        self._begin()
        sources = self._sources()
        base = sources[data.draw(st.integers(0, len(sources) - 1), label="base")]
        suffix = _tokens(data.draw(st.integers(0, 6 * self.page), label="suffix"), ("suffix", len(self.rids)))
        limit = data.draw(st.integers(1, self.fits + self.page), label="limit")  # may not fit L1
        self._arrive((base + suffix)[:limit], data.draw(st.integers(0, 2), label="priority"))

    @rule(data=st.data())
    def arrive_twins(self, data: st.DataObject) -> None:
        """Two requests over one prefix arrive in the same tick: admitted together, they match
        the same L2 span (one anchor) and load it back in one LoadBack."""
        self._begin()
        sources = [x for x in self._sources() if x]
        base = sources[data.draw(st.integers(0, len(sources) - 1), label="base")][: self.fits - 2 * self.page]
        for i in range(2):
            n = data.draw(st.integers(1, 2 * self.page), label="suffix")
            suffix = _tokens(n, ("twin", len(self.rids), i))
            self._arrive((base + suffix)[: self.fits], 0)
        self.world.tick()

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """An operator (or memory pressure elsewhere) evicts pages from L1 and L2."""
        self._begin()
        w = self.world
        l1 = data.draw(st.integers(0, self.cfg.l1_pages), label="l1 pages")
        l2 = data.draw(st.integers(0, self.cfg.l2_pages), label="l2 pages")
        w.feed(ev.EvictRequested(w.now, l1, l2))

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._begin()
        self._decode(_pick(data, self._running(), "rid"), data.draw(st.integers(1, 3 * self.page), label="n"))

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running request finishes (now and then: a late finish after an abort or failure)."""
        self._begin()
        ended = self._states(State.ABORTED, State.FAILED)
        late = ended and data.draw(st.integers(0, 9), label="late") == 0
        self.world.finish(_pick(data, ended if late else self._running(), "rid"))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort in any phase, often while I/O of the request is in flight (or late: after the
        request ended)."""
        self._begin()
        w = self.world
        live = set(self._live())
        groups = {
            "live": live,
            "prefetching": live & {p.req for p in w.prefetches.values()},
            "loading": live & {rid for c in w.loads.values() for rid in c.reqs},
            "transferring": live & {c.req for c in w.transfers.values()},
            "backing off": live & {t.req for t in self.core._transfers.values() if t.phase is WAITING},
            "any": set(self.rids),
        }
        group = data.draw(st.sampled_from([k for k, v in groups.items() if v]), label="group")
        rid = _pick(data, groups[group], "rid")
        r = self.core.requests[rid]
        event(f"abort in {r.state.value}{' (prefetch open)' if r.prefetch_open else ''}")
        self.world.abort(rid)

    # ------------------------------------------------------------------ storage (L3)

    @precondition(lambda self: self.world.queries)
    @rule(data=st.data())
    def answer_query(self, data: st.DataObject) -> None:
        """L3 answers, with all its consecutive hits or fewer (a partial hit)."""
        self._begin()
        op = _pick(data, self.world.queries, "op")
        cap = None
        if data.draw(st.booleans(), label="capped"):
            q = self.world.queries[op]
            cap = {rid: data.draw(st.integers(0, len(keys)), label="cap") for rid, keys in q.queries}
        self.world.answer_query(op, cap)

    @precondition(lambda self: self.cfg.storage)
    @rule(data=st.data())
    def l3_put(self, data: st.DataObject) -> None:
        """Another node stores a prefix of some conversation in the shared L3."""
        self._begin()
        sources = self._sources()
        keys = self.world.keys_of(sources[data.draw(st.integers(0, len(sources) - 1), label="source")])
        for key in keys[: data.draw(st.integers(0, len(keys)), label="pages")]:
            self.world.l3[key] = key

    @precondition(lambda self: self.cfg.storage and self.world.l3)
    @rule(data=st.data())
    def l3_drop(self, data: st.DataObject) -> None:
        """L3 evicts a page, mostly one that a prefetch in flight has yet to read (it falls short)."""
        self._begin()
        w = self.world
        wanted = {k for op, p in w.prefetches.items() for k in p.keys[self.progress.get(op, 0) :]} & set(w.l3)
        key = _pick(data, wanted if wanted and data.draw(st.booleans(), label="wanted") else w.l3, "key")
        del w.l3[key]
        self.l3_dropped.add(key)
        w.l3_lost.add(key)

    @precondition(lambda self: self.world.prefetches)
    @rule(data=st.data())
    def prefetch_progress(self, data: st.DataObject) -> None:
        self._begin()
        w = self.world
        op = _pick(data, w.prefetches, "op")
        got = self._copy_prefetch(op, data.draw(st.integers(0, len(w.prefetches[op].keys)), label="pages"))
        w.feed(ev.PrefetchProgress(w.now, op, got))

    @precondition(lambda self: self.world.prefetches)
    @rule(data=st.data())
    def prefetch_end(self, data: st.DataObject) -> None:
        """A prefetch ends: complete (as far as L3 still holds), partial, or with nothing more."""
        self._begin()
        op = _pick(data, self.world.prefetches, "op")
        n = len(self.world.prefetches[op].keys)
        seen = self.progress.get(op, 0)
        mode = data.draw(st.sampled_from(["complete", "partial", "zero"]), label="mode")
        pages = {"complete": n, "zero": seen}.get(mode)
        self._end_prefetch(op, data.draw(st.integers(seen, n), label="pages") if pages is None else pages)

    @precondition(lambda self: self.world.timers)
    @rule(data=st.data())
    def fire_timer(self, data: st.DataObject) -> None:
        self._begin()
        self.world.fire_timer(_pick(data, self.world.timers, "timer"))

    # ------------------------------------------------------------------ L2 -> L1 and prefill

    @precondition(lambda self: self.world.loads)
    @rule(data=st.data())
    def load_done(self, data: st.DataObject) -> None:
        """A load-back ends, now and then with some requests' pages lost, or single pages bad
        (garbage in L1)."""
        self._begin()
        op = _pick(data, self.world.loads, "op")
        load = self.world.loads[op]
        failed: list[str] = []
        bad: list[int] = []
        kind = data.draw(st.integers(0, 4), label="fail")
        if kind == 0:
            failed = data.draw(st.lists(st.sampled_from(load.reqs), min_size=1, unique=True), label="failed")
        elif kind == 1 and load.device_slots:
            pages = st.integers(0, len(load.device_slots) - 1)
            bad = data.draw(st.lists(pages, min_size=1, max_size=3, unique=True), label="bad pages")
        elif kind == 2:  # each entry from a page of its own on (entries may share one L2 span)
            start = 0
            for entry in load.entries:
                n = len(entry.device_slots)
                first = data.draw(st.integers(0, n), label="entry's first bad page")
                if first < n:
                    bad.append(start + first)
                start += n
        self.world.load_done(op, tuple(failed), bad_pages=tuple(bad))

    @precondition(lambda self: self.world.transfers)
    @rule(data=st.data())
    def kv_arrive(self, data: st.DataObject) -> None:
        self._begin()
        self._kv_arrive(_pick(data, self.world.transfers, "tid"))

    @precondition(lambda self: self.world.transfers)
    @rule(data=st.data())
    def kv_fail(self, data: st.DataObject) -> None:
        self._begin()
        self._kv_fail(_pick(data, self.world.transfers, "tid"))

    @precondition(lambda self: set(self.world.transfers) - self.abandoned)
    @rule(data=st.data())
    def kv_abandon(self, data: st.DataObject) -> None:
        """The driver gives up on a transfer it cannot stop: it keeps writing its slots, and
        its real outcome (arrived or failed) comes later."""
        self._begin()
        w = self.world
        tid = _pick(data, set(w.transfers) - self.abandoned, "tid")
        c = w.transfers[tid]
        for s in c.dst_slots:
            w.l1[s] = ("abandoned transfer", tid)
        self.abandoned.add(tid)
        w.feed(ev.KVAbandoned(w.now, c.req, tid, "no fence"))
        assert self.core.requests[c.req].state.terminal, f"{c.req} outlived its abandoned transfer"

    # ------------------------------------------------------------------ tree I/O

    @precondition(lambda self: self.world.backups)
    @rule(data=st.data())
    def backup_done(self, data: st.DataObject) -> None:
        """A backup ends, now and then with some pages not copied (garbage left in L2)."""
        self._begin()
        w = self.world
        op = _pick(data, w.backups, "op")
        self.world.backup_done(op, self._failed_pages(data, len(w.backups[op].host_slots)))

    @precondition(lambda self: self.world.stores)
    @rule(data=st.data())
    def store_done(self, data: st.DataObject) -> None:
        """A store ends, now and then with some pages not written to L3."""
        self._begin()
        w = self.world
        op = _pick(data, w.stores, "op")
        self.world.store_done(op, self._failed_pages(data, len(w.stores[op].keys)))

    def _failed_pages(self, data: st.DataObject, n: int) -> tuple[int, ...]:
        if n == 0 or data.draw(st.integers(0, 3), label="io fails") != 0:
            return ()
        pages = st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)
        return tuple(sorted(data.draw(pages, label="failed pages")))

    # ------------------------------------------------------------------ checks

    def _check_tree_contents(self) -> None:
        """Every page the tree holds on L1 (and on L2 once backed up) is its key's KV."""
        w = self.world
        for n in self.core.tree.nodes():
            if n.device is not None:
                for k, s in zip(n.keys, n.device, strict=True):
                    assert w.l1[s] == k, f"tree page {k} in L1 slot {s} holds {w.l1[s]!r}"
            if n.host is not None and not n.host_pending:
                for k, h in zip(n.keys, n.host, strict=True):
                    assert w.l2[h] == k, f"tree page {k} in L2 slot {h} holds {w.l2[h]!r}"
            if n.in_l3:  # L3 may drop a page behind the node's back (`l3_drop`), never hold a bad one
                for k in n.keys:
                    assert w.l3.get(k) == k or k in self.l3_dropped, f"tree page {k} marked in L3, not there"

    def _check_locked(self) -> None:
        """An admitted request's shared L1 prefix (locked at admission) keeps its slots, their
        owner (the tree) and their KV until the request ends or is retracted; so does the L2
        span it pinned, until loaded back."""
        w = self.world
        for rid, r in self.core.requests.items():
            if r.state not in ADMITTED:
                self.locked.pop(rid, None)
                continue
            shared = r.slots[: r.shared]
            admission, held = self.locked.get(rid, (-1, {}))
            if admission != r.account.retractions:  # admitted (again) in the last step
                for i, s in enumerate(shared):
                    assert w.l1[s] == r.keys[i], f"{rid}: shared page {i} in slot {s} holds {w.l1[s]!r}"
                self.locked[rid] = (r.account.retractions, {s: w.l1[s] for s in shared})
                continue
            assert shared == list(held), f"{rid}: its shared slots changed from {list(held)} to {shared}"
            for s, kv in held.items():
                assert self.core.device_pool.owner_of(s) == "tree", f"{rid}: locked slot {s} left the tree"
                assert w.l1[s] == kv, f"{rid}: locked L1 slot {s} now holds {w.l1[s]!r}, was {kv!r}"
            if r.pin is not None:  # the L2 span it matched stays until it is loaded back
                for i, h in enumerate(r.host_slots_l2):
                    assert self.core.host_pool.owner_of(h) == "tree", f"{rid}: pinned slot {h} left the tree"
                    truth = r.keys[r.device_pages + i]
                    # Or found bad by another request's load-back: this one's load reads it as bad too.
                    ok = w.l2[h] == truth or corrupt(w.l2[h])
                    assert ok, f"{rid}: pinned L2 slot {h} holds {w.l2[h]!r}, truth {truth}"

    def _check_command(self, c: cmd.Command) -> None:
        """Every write a command asks for goes to slots its owner holds: a transfer, prefetch or
        load-back into its requests' own slots, a backup or store between the tree's."""
        dev, host = self.core.device_pool.owner_of, self.core.host_pool.owner_of
        if isinstance(c, cmd.RequestKV):
            assert all(dev(s) == ("req", c.req) for s in c.dst_slots), c
        elif isinstance(c, cmd.Prefetch):
            assert all(host(h) == ("req", c.req) for h in c.host_slots), c
        elif isinstance(c, cmd.LoadBack):
            owners = {("req", rid) for rid in c.reqs}
            assert all(dev(s) in owners for s in c.device_slots), c
            assert all(host(h) in owners or host(h) == "tree" for h in c.host_slots), c
            if len(set(c.host_slots)) < len(c.host_slots):
                event("one load-back reads an L2 span for two requests")
        elif isinstance(c, cmd.Backup):
            assert all(dev(s) == "tree" for s in c.device_slots), c
            assert all(host(h) == "tree" for h in c.host_slots), c
            if self.world.backups:
                event("a backup starts while another runs")
            if self.world.stores:
                event("a backup starts while a store runs")
        elif isinstance(c, cmd.Store):
            assert all(host(h) == "tree" for h in c.host_slots), c
        elif isinstance(c, cmd.StartDecode):
            self._check_start(c.req)
        elif isinstance(c, cmd.SetTimer) and c.kind is cmd.TimerKind.TRANSFER_RETRY:
            event("a transfer retry backs off")
        elif isinstance(c, cmd.Respond) and c.outcome == "failed":
            event(f"failed: {'too large' if 'needs' in c.reason else 'transfer'}")

    def _check_start(self, rid: str) -> None:
        """A request handed to decode (checked as the command is executed, before `World`
        checks its KV page by page): its account adds up to its prompt."""
        r = self.core.requests[rid]
        a = r.account
        assert r.state is State.RUNNING, (rid, r.state)
        assert a.l1 + a.l2 + a.l3 + a.transferred == r.prompt_len, (rid, r.prompt_len, a)
        assert a.fallback <= a.transferred, (rid, a)
        for name in ("l1", "l2", "l3", "fallback", "retractions"):
            if getattr(a, name):
                event(f"decode starts with {name}")

    def _check_outcomes(self) -> None:
        """Answers match states; failures are transfer failures or prompts too large for L1;
        the node's counters agree with the requests."""
        w, s = self.world, self.core.stats
        for rid, (outcome, reason) in w.outcomes.items():
            r = self.core.requests[rid]
            assert r.state.terminal and OUTCOME[r.state] == outcome, (rid, r.state, outcome)
            if outcome == "failed":
                allowed = ("transfer failed", "transfer abandoned", "needs")
                assert any(a in reason for a in allowed), f"{rid} failed: {reason}"
        for rid, r in self.core.requests.items():
            if r.state.terminal:
                assert rid in w.outcomes, f"{rid} is {r.state.value} but was never answered"
        ends = [o for o, _ in w.outcomes.values()]
        assert (s.finished, s.aborted, s.failed) == tuple(map(ends.count, ("finished", "aborted", "failed")))
        assert s.arrived == len(self.core.requests)
        assert s.prompt_tokens == s.l1_tokens + s.l2_tokens + s.l3_tokens + s.transferred_tokens
        assert s.max_loads_in_flight <= self.cfg.load_batches_in_flight

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "world"):
            return
        self.core.check()
        assert len(self.world.loads) <= self.cfg.load_batches_in_flight, "too many load-back batches"
        assert not self.world.agrees, "a single rank never asks for an agreement"
        self._check_tree_contents()
        self.world.check_tiers()
        self._check_locked()
        self._check_outcomes()
        self.steady = True

    def teardown(self) -> None:
        if not hasattr(self, "world") or not self.steady:
            return  # a step failed: report that failure, not a follow-up one
        w, core = self.world, self.core
        for op in sorted(w.prefetches):  # (World.settle would rewrite pages reported complete)
            self._end_prefetch(op, len(w.prefetches[op].keys))
        w.settle()
        assert core.idle
        audit = core.audit()
        assert audit["l1_leaked"] == audit["l2_leaked"] == 0, f"slots held after the drain: {audit}"
        assert not w.flight, f"I/O still in flight after the drain: {sorted(w.flight)}"
        assert set(w.outcomes) == set(core.requests)
        for rid, r in core.requests.items():
            assert r.state.terminal and w.outcomes[rid][0] == OUTCOME[r.state], (rid, r.state)
        self._check_outcomes()
        core.check()
        self._check_tree_contents()
        assert not core.tree.live_locks and not core.tree.live_pins
        assert core.reserved == 0
        # Evict everything: every slot must come back (write-back frees one level per round),
        # also while the copies that kept failing go on failing.
        for _ in range(100):
            if core.tree.num_nodes == 0:
                break
            w.feed(ev.EvictRequested(w.now, 10**9))
            while w.backups or w.stores:
                for op in sorted(w.backups):
                    self._backup_done(op)
                for op in sorted(w.stores):
                    self._store_done(op)
            w.feed(ev.EvictRequested(w.now, 0, 10**9))
            w.check_tiers()
        core.check()
        assert core.tree.num_nodes == 0
        assert core.device_pool.num_free == core.device_pool.capacity, "L1 slots leaked"
        assert core.host_pool.num_free == core.host_pool.capacity, "L2 slots leaked"


TestDecodeNode = pytest.mark.slow(DecodeNodeMachine.TestCase)
TestDecodeNode.settings = settings(
    max_examples=examples(1000),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ---------------------------------------------------------------------- paths the machine found


def _one(d: dict) -> int:
    (key,) = d
    return key


def _serve(w: World, rid: str, tokens: list[int]) -> None:
    """Arrive, restore and transfer everything, decode a little, finish; back the pages up."""
    w.arrive(rid, tokens)
    while not w.core.requests[rid].state.terminal:
        w.complete_reads()
        for tid in sorted(w.transfers):
            w.kv_arrive(tid)
        if w.core.requests[rid].state is State.RUNNING:
            w.finish(rid)
        w.tick()
    for op in sorted(w.backups):
        w.backup_done(op)


def test_partial_prefetch_under_eager_falls_back_for_exactly_the_missing_range() -> None:
    cfg = DecodeConfig(
        l1_pages=16,
        l2_pages=16,
        page_size=2,
        promise="eager",
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
        decode_reserve_tokens=0,
    )
    w = World(cfg)
    tokens = list(range(11))  # 5 full pages and a tail token
    keys = w.keys_of(tokens)
    w.l3.update((k, k) for k in keys)
    w.arrive("a", tokens)
    w.tick()
    w.answer_query(_one(w.queries))
    w.tick()
    p = _one(w.prefetches)
    (tail,) = w.transfers.values()
    assert (tail.start, tail.end) == (10, 11)  # eager: all 5 L3 pages promised at once
    w.prefetch_progress(p, 2)
    w.tick()
    del w.l3[keys[2]]  # L3 loses page 2 before the prefetch reads it
    w.prefetch_done(p)
    out = w.tick()
    r = w.core.requests["a"]
    (fallback,) = [c for c in out if isinstance(c, cmd.RequestKV)]
    assert (fallback.start, fallback.end, fallback.dst_slots) == (4, 10, tuple(r.slots[2:5]))
    (load,) = [c for c in out if isinstance(c, cmd.LoadBack)]
    assert load.device_slots == tuple(r.slots[:2])
    for tid in sorted(w.transfers):
        w.kv_arrive(tid)
    assert "a" not in w.started  # pages 0-1 are still on their way from L2
    w.load_done(load.op)
    assert w.started == {"a": 1}  # and World checked every page's KV
    a = r.account
    assert (a.l3, a.transferred, a.fallback) == (4, 7, 6)
    w.finish("a")
    w.settle()
    assert w.core.idle and w.outcomes["a"] == ("finished", "")


def test_failed_load_back_falls_back_and_the_request_finishes_with_the_right_kv() -> None:
    w = World(DecodeConfig(l1_pages=8, l2_pages=16, page_size=2, storage=False, decode_reserve_tokens=0))
    history = [1, 2, 3, 4, 5, 6]
    _serve(w, "a", history)
    _serve(w, "b", list(range(10, 26)))  # fills L1: a's pages are demoted to L2
    w.arrive("c", [*history, 7, 8, 9])
    w.tick()
    load = w.loads[_one(w.loads)]
    r = w.core.requests["c"]
    assert (r.device_pages, r.host_pages) == (0, 3)
    w.load_done(load.op, failed=("c",))  # c's pages arrive as garbage
    fallback = [c for c in w.transfers.values() if c.start == 0]
    assert [(c.end, c.dst_slots) for c in fallback] == [(6, tuple(r.slots[:3]))]
    for tid in sorted(w.transfers):
        w.kv_arrive(tid)
    assert w.started["c"] == 1  # with prefill's KV, not the garbage
    assert (r.account.l2, r.account.transferred, r.account.fallback) == (0, 9, 6)
    w.decode("c", 3)
    w.finish("c")
    w.settle()
    assert w.core.idle and w.outcomes["c"] == ("finished", "")
    w.core.check()


def test_failed_l2_load_back_while_the_l3_query_is_open_falls_back() -> None:
    """The L2 load-back starts at admission, while the request still waits for L3's answer
    (QUERYING): its failure's fallback transfer can complete (or fail) in that state."""
    cfg = DecodeConfig(
        l1_pages=8, l2_pages=16, page_size=2, prefetch_threshold_tokens=0, decode_reserve_tokens=0
    )
    w = World(cfg)
    history = [1, 2, 3, 4]
    _serve(w, "a", history)
    _serve(w, "b", list(range(10, 26)))  # fills L1: a's pages are demoted to L2
    w.arrive("c", [*history, 5, 6, 7, 8])  # 2 pages on L2, 2 candidates for L3
    w.tick()
    assert w.core.requests["c"].state is State.QUERYING
    w.load_done(_one(w.loads), failed=("c",))
    w.kv_arrive(_one(w.transfers))  # the fallback for pages 0-1 arrives before L3 answers
    w.answer_query(_one(w.queries))
    w.settle()
    assert w.started == {"a": 1, "b": 1, "c": 1}
    assert w.core.idle and w.outcomes["c"] == ("finished", "")
