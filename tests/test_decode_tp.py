"""Tensor-parallel agreement: N replicas of the decode-node core, one per TP rank.

Every rank sees the same shared events (arrivals, ticks, transfers, load-backs, backups, stores,
decodes, finishes, aborts, timers) and its own rank-local ones: how many pages of a prompt its
shard of L3 holds, and how far its prefetch got and when. Each `Agree` is answered the way a
collective would be: once every rank has entered it, every rank receives the minimum of each
value. Because the core decides only on agreed values, every rank must emit the same commands
in the same order, collectives included; otherwise ranks deadlock in mismatched collectives
(fault 2 of DESIGN.md section 1) or restore different KV.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, given, settings
from kvworld import World

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.states import State

PAGE = 4
RANKS = 3


def config(**kw: Any) -> DecodeConfig:
    base: dict[str, Any] = dict(
        l1_pages=64,
        l2_pages=64,
        page_size=PAGE,
        prefetch_threshold_tokens=2 * PAGE,
        decode_reserve_tokens=PAGE,
        tp_size=RANKS,
    )
    base.update(kw)
    return DecodeConfig(**base)


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


def shape(c: cmd.Command) -> object:
    """What must be identical across ranks: everything, except the values of an `Agree`."""
    if isinstance(c, cmd.Agree):
        return ("Agree", c.agreement, c.kind, tuple(k for k, _ in c.values))
    return c


class Ranks:
    """N worlds, one per TP rank, driven in lockstep, with collectives answered by minimum."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.worlds = [World(cfg) for _ in range(cfg.tp_size)]
        self.seen = 0  # commands of the logs already compared
        self.agreed: set[int] = set()
        self.cancelled: set[int] = set()  # prefetches some rank was told to cancel

    @property
    def lead(self) -> World:
        return self.worlds[0]

    def core(self, rank: int = 0) -> Any:
        return self.worlds[rank].core

    # ------------------------------------------------------------------ checks

    def check_same(self) -> None:
        """Every rank has emitted the same commands (collective ids, kinds and keys included)."""
        start = self.seen
        logs = [[shape(c) for c in w.log[start:]] for w in self.worlds]
        for rank, log in enumerate(logs[1:], start=1):
            if log != logs[0]:
                i = next((i for i, (a, b) in enumerate(zip(logs[0], log, strict=False)) if a != b), None)
                if i is None:
                    i = min(len(log), len(logs[0]))
                raise AssertionError(
                    f"rank {rank} diverges from rank 0 at command {start + i}:\n"
                    f"  rank 0: {logs[0][i : i + 3]}\n  rank {rank}: {log[i : i + 3]}"
                )
        for c in self.lead.log[start:]:
            if isinstance(c, cmd.CancelPrefetch):
                self.cancelled.add(c.op)
        self.seen += len(logs[0])

    # ------------------------------------------------------------------ shared events

    def each(self, method: str, *args: Any) -> None:
        for w in self.worlds:
            getattr(w, method)(*args)
        self.check_same()

    def tick(self) -> None:
        mark = len(self.lead.log)
        for w in self.worlds:
            w.tick()
        self.check_same()
        kinds = [c.kind for c in self.lead.log[mark:] if isinstance(c, cmd.Agree)]
        assert len(kinds) == len(set(kinds)), f"more than one collective of a kind in a tick: {kinds}"
        self.collect()

    def collect(self) -> None:
        """Answer every collective all ranks have entered: each value is the minimum over ranks."""
        open_: list[dict[int, cmd.Agree]] = []
        for w in self.worlds:
            open_.append({a.agreement: a for a in w.agrees if a.agreement not in self.agreed})
            w.agrees.clear()
        ids = sorted(open_[0])
        for aid in ids:
            calls = [o[aid] for o in open_]
            assert len({(c.kind, tuple(k for k, _ in c.values)) for c in calls}) == 1, calls
            values = tuple((key, min(dict(c.values)[key] for c in calls)) for key, _ in calls[0].values)
            self.agreed.add(aid)
            for w in self.worlds:
                w.feed(ev.Agreed(w.now, aid, values))
        self.check_same()

    def shared_ops(self, attr: str) -> list[int]:
        """The open operations of a shared kind; they must be the same on every rank."""
        ops = [sorted(getattr(w, attr)) for w in self.worlds]
        assert all(o == ops[0] for o in ops), (attr, ops)
        return ops[0]

    def complete_shared(self) -> None:
        for op in self.shared_ops("loads"):
            self.each("load_done", op)
        for tid in self.shared_ops("transfers"):
            self.each("kv_arrive", tid)
        for op in self.shared_ops("backups"):
            self.each("backup_done", op)
        for op in self.shared_ops("stores"):
            self.each("store_done", op)

    def running(self) -> list[str]:
        states = [{k: r.state for k, r in w.core.requests.items()} for w in self.worlds]
        assert all(s == states[0] for s in states), states
        return [k for k, s in states[0].items() if s is State.RUNNING]

    def rest(self, rounds: int = 200) -> None:
        """Complete everything (rank-local ops too, with each rank's full L3) and finish every
        running request until all ranks are idle."""
        for _ in range(rounds):
            for w in self.worlds:
                for op in sorted(w.queries):
                    w.answer_query(op)
                for op in sorted(w.prefetches):
                    w.prefetch_done(op)
            self.complete_shared()
            for op in self.shared_ops("timers"):
                self.each("fire_timer", op)
            for rid in self.running():
                self.each("finish", rid)
            self.tick()
            idle = [w.core.idle for w in self.worlds]
            assert all(i == idle[0] for i in idle)
            if idle[0]:
                break
        else:
            raise AssertionError("the ranks did not come to rest")
        for w in self.worlds:
            w.core.check()
            assert w.core.tree.live_locks == [] and w.core.tree.live_pins == []
        outcomes = [w.outcomes for w in self.worlds]
        assert all(o == outcomes[0] for o in outcomes)


def put_in_l3(r: Ranks, toks: list[int]) -> None:
    for w in r.worlds:
        for k in w.keys_of(toks):
            w.l3[k] = k


def of(w: World, kind: type, since: int = 0) -> list[Any]:
    return [c for c in w.log[since:] if isinstance(c, kind)]


# ============================================================================ deterministic


def test_ranks_with_different_l3_hits_prefetch_and_promise_the_agreed_minimum() -> None:
    r = Ranks(config(prefetch_policy="wait_complete"))
    toks = tokens(1, 34)  # 8 full pages and a 2-token tail, all in every rank's L3
    put_in_l3(r, toks)
    r.each("arrive", "a", toks)
    r.tick()
    (q,) = of(r.lead, cmd.QueryStorage)
    (first,) = of(r.lead, cmd.Agree)
    assert first.kind == "l3_hits"  # entered before any rank knows: every value is -1
    for w, cap in zip(r.worlds, (5, 3, 4), strict=True):
        w.answer_query(q.op, {"a": cap})  # each rank's shard of L3 answers differently
    r.check_same()
    r.tick()
    locals_ = [dict(of(w, cmd.Agree)[-1].values) for w in r.worlds]
    assert [v[("l3", q.op, "a")] for v in locals_] == [5, 3, 4]
    for w in r.worlds:
        (pf,) = of(w, cmd.Prefetch)
        assert len(pf.keys) == 3 and pf.keys == tuple(w.keys_of(toks)[:3])
        (xfer,) = of(w, cmd.RequestKV)
        assert (xfer.start, xfer.end) == (12, 34)  # the same 3 pages promised by every rank
        assert w.core.requests["a"].promised_pages == 3
    op = pf.op

    # Prefetch progress differs by rank; nothing settles until every rank has all 3 pages.
    r.worlds[0].prefetch_progress(op, 3)
    r.worlds[1].prefetch_progress(op, 1)
    r.tick()
    r.worlds[0].prefetch_done(op, 3)
    r.worlds[2].prefetch_progress(op, 2)
    r.tick()
    assert not of(r.lead, cmd.LoadBack)
    r.worlds[1].prefetch_done(op, 3)
    r.tick()
    assert not of(r.lead, cmd.LoadBack)  # rank 2 is still reading
    r.worlds[2].prefetch_done(op, 3)
    r.tick()  # the collective settles the prefetch; the load-back goes out with the next tick
    r.tick()
    (load,) = of(r.lead, cmd.LoadBack)
    assert len(load.host_slots) == 3
    r.complete_shared()
    r.tick()
    assert all(w.started.get("a") == 1 for w in r.worlds)  # each rank's KV checked
    assert all(w.core.requests["a"].account.l3 == 12 for w in r.worlds)
    r.rest()
    kinds = [a.kind for a in of(r.lead, cmd.Agree)]
    assert kinds.count("l3_hits") == 2


def start_prefetch(r: Ranks, rid: str, toks: list[int]) -> cmd.Prefetch:
    """Put `toks` in every rank's L3, let `rid` arrive, answer its L3 query on every rank in
    full, and return the prefetch all ranks then start."""
    put_in_l3(r, toks)
    r.each("arrive", rid, toks)
    r.tick()
    (q,) = of(r.lead, cmd.QueryStorage)
    for w in r.worlds:
        w.answer_query(q.op)
    r.tick()
    (pf,) = of(r.lead, cmd.Prefetch)
    return pf


def test_prefetch_shortfall_on_one_rank_trims_every_rank() -> None:
    r = Ranks(config(prefetch_policy="timeout"))
    toks = tokens(2, 26)  # 6 full pages
    pf = start_prefetch(r, "a", toks)
    (timer,) = of(r.lead, cmd.SetTimer)
    for w, pages in zip(r.worlds, (6, 2, 4), strict=True):
        w.prefetch_progress(pf.op, pages)
    r.tick()
    r.each("fire_timer", timer.timer)
    mark = len(r.lead.log)
    r.tick()  # timed out: every rank uses the 2 pages all of them have, and re-requests 4
    assert of(r.lead, cmd.CancelPrefetch, mark) == [cmd.CancelPrefetch(pf.op)]
    (fb,) = of(r.lead, cmd.RequestKV, mark)
    assert (fb.start, fb.end) == (8, 24)
    for w, pages in zip(r.worlds, (6, 3, 4), strict=True):
        w.prefetch_done(pf.op, pages)
    r.check_same()
    r.rest()
    assert all(w.core.requests["a"].account.l3 == 8 for w in r.worlds)
    assert all(w.outcomes["a"] == ("finished", "") for w in r.worlds)


def test_abort_while_one_rank_has_finished_its_prefetch() -> None:
    """An abort is shared; whether a rank's prefetch had already ended is rank-local. The
    ranks must still emit the same commands."""
    r = Ranks(config(prefetch_policy="wait_complete"))
    toks = tokens(3, 26)
    pf = start_prefetch(r, "a", toks)
    r.worlds[0].prefetch_done(pf.op)  # rank 0's read is complete, the others are still reading
    r.each("abort", "a")
    for w in r.worlds[1:]:
        w.prefetch_done(pf.op, 2)
    r.check_same()
    r.rest()
    assert all(w.outcomes["a"][0] == "aborted" for w in r.worlds)


# ============================================================================ property


@attrs.frozen
class Plan:
    """One request's shared fate and every rank's local view of its restore."""

    prompt_pages: int
    tail: int
    shares: int  # pages shared with the previous request's prompt
    arrive: int  # tick it arrives at
    caps: tuple[int, ...]  # per rank: L3 pages its shard reports
    query_delay: tuple[int, ...]  # per rank: ticks before it answers the L3 query
    progress: tuple[tuple[int, int], ...]  # per rank: (tick after start, pages) of a progress
    done: tuple[tuple[int, int], ...]  # per rank: (tick after start, pages) of the end
    abort_after: int | None  # ticks after its arrival that the client goes away
    fail_first_transfer: bool
    decode: int  # tokens it generates, one per tick, before it finishes


def plans(n_ranks: int) -> st.SearchStrategy[list[Plan]]:
    per_rank = st.tuples(*[st.integers(0, 9)] * n_ranks)
    delays = st.tuples(*[st.integers(0, 3)] * n_ranks)
    steps = st.tuples(*[st.tuples(st.integers(0, 4), st.integers(0, 9))] * n_ranks)
    plan = st.builds(
        Plan,
        prompt_pages=st.integers(2, 9),
        tail=st.integers(0, 3),
        shares=st.integers(0, 4),
        arrive=st.integers(0, 3),
        caps=per_rank,
        query_delay=delays,
        progress=steps,
        done=steps,
        abort_after=st.none() | st.integers(1, 7),
        fail_first_transfer=st.booleans(),
        decode=st.integers(0, 9),
    )
    return st.lists(plan, min_size=1, max_size=4)


# Shrinking a multi-rank run can take minutes; a failure prints its (unshrunk) example, and the
# deterministic tests above give the minimal cases.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def run_plans(
    plans_: list[Plan], policy: str, timer_at: int | None, l1: int, seed: int, aborts: bool
) -> Ranks:
    r = Ranks(config(prefetch_policy=policy, l1_pages=l1, transfer_retries=1))
    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {}
    prev: list[int] = []
    for i, p in enumerate(plans_):
        shared = prev[: min(p.shares, p.prompt_pages, len(prev) // PAGE) * PAGE]
        toks = shared + tokens(10 + i, (p.prompt_pages - len(shared) // PAGE) * PAGE + p.tail)
        prompts[f"r{i}"] = toks
        prev = toks
        if rng.random() < 0.8:
            put_in_l3(r, toks)
    by_req = {f"r{i}": p for i, p in enumerate(plans_)}
    started_at: list[dict[int, int]] = [{} for _ in r.worlds]  # per rank: op -> step first seen
    failed: set[str] = set()
    last_arrival = max(p.arrive for p in plans_)
    for step in range(40):
        for rid, p in by_req.items():
            if p.arrive == step:
                r.each("arrive", rid, prompts[rid])
        # Rank-local: L3 answers and prefetch progress, each rank on its own schedule.
        for rank, w in enumerate(r.worlds):
            seen = started_at[rank]
            for op, q in sorted(w.queries.items()):
                seen.setdefault(op, step)
                rids = [rid for rid, _ in q.queries]
                if step - seen[op] >= max(by_req[x].query_delay[rank] for x in rids):
                    w.answer_query(op, {x: by_req[x].caps[rank] for x in rids})
            for op, pf in sorted(w.prefetches.items()):
                seen.setdefault(op, step)
                p = by_req[pf.req]
                age = step - seen[op]
                (pa, pp), (da, dp) = p.progress[rank], p.done[rank]
                if age == pa:
                    w.prefetch_progress(op, min(pp, len(pf.keys)))
                cancelled = op in r.cancelled
                if age >= pa + da or (cancelled and age >= pa):
                    low = min(pp, len(pf.keys)) if age >= pa else 0
                    w.prefetch_done(op, max(low, min(dp, len(pf.keys))))
        r.check_same()
        # Shared: completions, decodes, finishes, aborts, timers.
        for tid in r.shared_ops("transfers"):
            rid = r.lead.transfers[tid].req
            if by_req[rid].fail_first_transfer and rid not in failed:
                failed.add(rid)
                r.each("kv_fail", tid)
            else:
                r.each("kv_arrive", tid)
        for op in r.shared_ops("loads"):
            r.each("load_done", op)
        for op in r.shared_ops("backups"):
            r.each("backup_done", op)
        for op in r.shared_ops("stores"):
            r.each("store_done", op)
        if timer_at is not None and step >= timer_at:
            for t in r.shared_ops("timers"):
                r.each("fire_timer", t)
        for rid in r.running():
            p = by_req[rid]
            if r.core().requests[rid].state is not State.RUNNING:
                continue  # retracted by another's growth
            if r.core().requests[rid].decoded < p.decode:
                r.each("decode", rid, 1)  # one token per step, as a decode batch makes them
            else:
                r.each("finish", rid)
        if aborts:
            for rid, p in by_req.items():
                if p.abort_after is not None and p.arrive + p.abort_after == step:
                    r.each("abort", rid)
        r.tick()
        if step > last_arrival and r.lead.core.idle:
            break
    r.rest()
    return r


@settings(
    max_examples=150,
    deadline=None,
    phases=NO_SHRINK,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    plans_=plans(RANKS),
    policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    timer_at=st.none() | st.integers(0, 10),
    l1=st.integers(14, 64),
    seed=st.integers(0, 2**16),
    aborts=st.booleans(),
)
def test_ranks_emit_identical_commands_whatever_their_local_views(
    plans_: list[Plan], policy: str, timer_at: int | None, l1: int, seed: int, aborts: bool
) -> None:
    r = run_plans(plans_, policy, timer_at, l1, seed, aborts=aborts)
    assert set(r.lead.outcomes) == {f"r{i}" for i in range(len(plans_))}
