"""Tensor-parallel ranks keep agreeing while their storage misbehaves differently.

Two to four replicas of the decode-node core (`tp_size = N`) run in lock-step, one per TP rank.
Shared facts (arrivals, ticks, prefill transfers, timers, decode steps, finishes, aborts) reach
every rank at the same step; rank-local facts differ: how many pages each rank's shard of L3
reports, when it answers, how far each rank's prefetch gets, whether it ends early with an
error, and whether a load-back L2 -> L1 fails on that rank alone. Every `Agree` is answered as a
collective would be — once all ranks have entered it, each receives the element-wise minimum.

Ranks that decide differently deadlock in mismatched collectives or put different requests in
the decode batch, so after every step each rank must have emitted the same sequence of `Agree`
kinds and made the same decisions for every request: promised length, the ranges requested
from prefill, the pages handed to the decode batch, retractions and the outcome. Every rank's
invariants (`DecodeNodeCore.check`) hold after every step, and every request ends.
"""

from __future__ import annotations

from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from builders import decode_config, examples
from builders import prompt as tokens
from hypothesis import HealthCheck, Phase, event, given, settings
from lockstep import Lockstep

from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.states import State

PAGE = 4
MAX_STEPS = 40

# Shrinking a multi-rank run takes minutes; a failing example is printed unshrunk.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def config(ranks: int, **kw: Any) -> DecodeConfig:
    return decode_config(**{"transfer_retries": 1, "tp_size": ranks, **kw})


# ---------------------------------------------------------------------------------- schedules


@attrs.frozen
class RankView:
    """One rank's local view of one request's restore."""

    l3_pages: int  # pages its shard of L3 reports (capped by what L3 really holds)
    query_delay: int  # steps before it answers the L3 query
    progress: tuple[int, int]  # (steps after the prefetch starts, pages) of a progress report
    end: tuple[int, int]  # (steps after the progress report, pages intact) of PrefetchDone
    load_fails: bool  # a load-back carrying this request fails on this rank


@attrs.frozen
class Plan:
    """One request's shared fate and each rank's local view of it."""

    prompt_pages: int
    tail: int
    shares: int  # pages shared with the previous request's prompt
    in_l3: bool  # its prompt was stored in L3 beforehand
    arrive: int
    views: tuple[RankView, ...]
    load_fails_everywhere: bool  # its first load-back fails on every rank (a shared fault)
    fail_first_transfer: bool
    abort_after: int | None
    decode: int


def rank_views(ranks: int) -> st.SearchStrategy[tuple[RankView, ...]]:
    view = st.builds(
        RankView,
        l3_pages=st.integers(0, 9) | st.just(9),
        query_delay=st.integers(0, 3),
        progress=st.tuples(st.integers(0, 4), st.integers(0, 9)),
        end=st.tuples(st.integers(0, 4), st.integers(0, 9)),
        load_fails=st.booleans(),
    )
    return st.tuples(*[view] * ranks)


@st.composite
def schedules(draw: st.DrawFn, *, local_load_faults: bool) -> dict[str, Any]:
    ranks = draw(st.integers(2, 4), label="ranks")
    plan = st.builds(
        Plan,
        prompt_pages=st.integers(2, 9),
        tail=st.integers(0, 3),
        shares=st.integers(0, 4),
        in_l3=st.sampled_from([True, True, True, False]),
        arrive=st.integers(0, 4),
        views=rank_views(ranks),
        load_fails_everywhere=st.booleans(),
        fail_first_transfer=st.booleans(),
        abort_after=st.none() | st.integers(1, 8),
        decode=st.integers(0, 8),
    )
    plans = draw(st.lists(plan, min_size=1, max_size=4), label="plans")
    if not local_load_faults:
        plans = [
            attrs.evolve(p, views=tuple(attrs.evolve(v, load_fails=False) for v in p.views)) for p in plans
        ]
    return dict(
        ranks=ranks,
        plans=plans,
        policy=draw(st.sampled_from(["best_effort", "wait_complete", "timeout"]), label="policy"),
        promise=draw(st.sampled_from(["eager", "confirmed"]), label="promise"),
        timer_at=draw(st.none() | st.integers(0, 10), label="timer_at"),
        backoff=draw(st.sampled_from([0.0, 0.001]), label="transfer_backoff_s"),  # retries wait a timer
        l1=draw(st.integers(16, 64), label="l1"),
        # Steps at which the collectives opened so far are answered (they always are at the
        # end): a collective may take a while, during which no second one of its kind opens.
        late=draw(st.frozensets(st.integers(0, MAX_STEPS - 1), max_size=10), label="late"),
    )


def run_schedule(s: dict[str, Any]) -> Lockstep:
    plans: list[Plan] = s["plans"]
    cfg = config(
        s["ranks"],
        prefetch_policy=s["policy"],
        promise=s["promise"],
        l1_pages=s["l1"],
        transfer_backoff_s=s["backoff"],
    )
    r = Lockstep(cfg)
    prompts: dict[str, list[int]] = {}
    prev: list[int] = []
    for i, p in enumerate(plans):
        shared = prev[: min(p.shares, p.prompt_pages, len(prev) // PAGE) * PAGE]
        toks = shared + tokens(10 + i, (p.prompt_pages - len(shared) // PAGE) * PAGE + p.tail)
        prompts[f"r{i}"] = toks
        prev = toks
        if p.in_l3:
            for w in r.worlds:
                for k in w.keys_of(toks):
                    w.l3[k] = k
    by_req = {f"r{i}": p for i, p in enumerate(plans)}
    first_seen: list[dict[int, int]] = [{} for _ in r.worlds]  # per rank: op -> step first seen
    failed_once: set[str] = set()
    loads_failed: set[str] = set()
    last_arrival = max(p.arrive for p in plans)
    n = len(r.worlds)
    for step in range(MAX_STEPS):
        where = f"step {step}"
        for rid, p in by_req.items():
            if p.arrive == step:
                r.each("arrive", rid, prompts[rid])
        # Rank-local: each shard answers the L3 query and reads its prefetch on its own schedule.
        for rank, w in enumerate(r.worlds):
            seen = first_seen[rank]
            for op, q in sorted(w.queries.items()):
                seen.setdefault(op, step)
                rids = [rid for rid, _ in q.queries]
                if step - seen[op] >= max(by_req[x].views[rank].query_delay for x in rids):
                    if any(len({v.l3_pages for v in by_req[x].views}) > 1 for x in rids):
                        event("ranks' L3 shards answered differently")
                    w.answer_query(op, {x: by_req[x].views[rank].l3_pages for x in rids})
            for op, pf in sorted(w.prefetches.items()):
                seen.setdefault(op, step)
                view = by_req[pf.req].views[rank]
                age = step - seen[op]
                (pa, pp), (ea, ep) = view.progress, view.end
                if age == pa:
                    w.prefetch_progress(op, min(pp, len(pf.keys)))
                if age >= pa + ea or (op in r.cancelled and age >= pa):
                    low = min(pp, len(pf.keys)) if age >= pa else 0
                    pages = max(low, min(ep, len(pf.keys)))
                    if pages < len(pf.keys):
                        event("a prefetch ended short on some rank")
                    w.prefetch_done(op, pages)  # an error (or a cancel) ends it early
        # Load-backs complete at the same step everywhere, each rank with its own failures.
        for op in r.shared_ops("loads"):
            reqs = r.lead.loads[op].reqs
            shared_fail = {x for x in reqs if by_req[x].load_fails_everywhere and x not in loads_failed}
            loads_failed |= shared_fail
            failed = [
                shared_fail | {x for x in reqs if by_req[x].views[rank].load_fails} for rank in range(n)
            ]
            if any(f != failed[0] for f in failed):
                event("a load-back failed on some ranks only")
            elif failed[0]:
                event("a load-back failed on every rank")
            for w, f in zip(r.worlds, failed, strict=True):
                w.load_done(op, tuple(sorted(f)))
        r.compare(f"{where}, after the load-backs")
        # Shared: prefill transfers, backups, stores, timers, decode steps, finishes, aborts.
        for tid in r.shared_ops("transfers"):
            rid = r.lead.transfers[tid].req
            if by_req[rid].fail_first_transfer and rid not in failed_once:
                failed_once.add(rid)
                r.each("kv_fail", tid)
            else:
                r.each("kv_arrive", tid)
        for op in r.shared_ops("backups"):
            r.each("backup_done", op)
        for op in r.shared_ops("stores"):
            r.each("store_done", op)
        if s["timer_at"] is not None and step >= s["timer_at"]:
            for t in r.shared_ops("timers"):
                r.each("fire_timer", t)
        for rid in r.running():
            if r.lead.core.requests[rid].state is not State.RUNNING:
                continue  # retracted by another request's growth this step
            if r.lead.core.requests[rid].decoded < by_req[rid].decode:
                r.each("decode", rid, 1)
            else:
                r.each("finish", rid)
        for rid, p in by_req.items():
            if p.abort_after is not None and p.arrive + p.abort_after == step:
                r.each("abort", rid)
        r.tick(answer=step not in s["late"])
        r.compare(where)
        if step > last_arrival and all(w.core.idle for w in r.worlds):
            break
    settle(r)
    return r


def settle(r: Lockstep) -> None:
    r.rest()


FUZZ = settings(
    max_examples=examples(200),
    deadline=None,
    phases=NO_SHRINK,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow
@FUZZ
@given(s=schedules(local_load_faults=False))
def test_ranks_decide_alike_whatever_their_storage_reports(s: dict[str, Any]) -> None:
    """Different L3 answers, answer times, prefetch progress, prefetch errors and partial
    prefetches per rank; load-back failures that hit every rank."""
    r = run_schedule(s)
    event(f"{s['ranks']} ranks")
    event("collectives: " + ("none" if not r.collectives else "1-9" if r.collectives < 10 else "10+"))
    for i, plan in enumerate(s["plans"]):  # every request ends; a cache fault never fails one
        outcome, reason = r.lead.outcomes[f"r{i}"]
        allowed = {"finished"} if plan.abort_after is None else {"finished", "aborted"}
        assert outcome in allowed, (f"r{i}", outcome, reason)


@pytest.mark.slow
@FUZZ
@given(s=schedules(local_load_faults=True))
def test_ranks_decide_alike_when_a_load_back_fails_on_one_rank_only(s: dict[str, Any]) -> None:
    """As above, and a load-back may fail on some ranks and succeed on others: whether the
    restored pages arrived is as rank-local as an L3 answer."""
    r = run_schedule(s)
    assert set(r.lead.outcomes) == {f"r{i}" for i in range(len(s["plans"]))}


def test_a_load_back_failing_on_one_rank_is_recovered_by_every_rank() -> None:
    """The smallest case: on two ranks, a request's 3 prompt pages are on L2 and load back to
    L1; the load-back fails on rank 1 only. Both ranks must then do the same (re-request the
    range from prefill, both of them), or rank 1 asks prefill for pages rank 0 does not and
    starts decoding later, so the ranks' batches differ."""
    r = Lockstep(config(2, prefetch_policy="wait_complete"))
    toks = tokens(1, 14)  # 3 full pages and a 2-token tail
    r.each("arrive", "a", toks)
    settle(r)  # "a" runs and finishes; its pages stay on L1 and are backed up to L2 and L3
    r.each("feed", ev.EvictRequested(r.lead.now, r.lead.cfg.l1_pages))  # demote everything to L2
    r.compare("after the first request")
    r.each("arrive", "b", toks)
    r.tick()
    (op,) = r.shared_ops("loads")
    r.worlds[0].load_done(op)
    r.worlds[1].load_done(op, ("b",))
    r.compare("after the load-back")
    settle(r)
    assert r.lead.outcomes["b"] == ("finished", "")
