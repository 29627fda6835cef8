"""Tensor-parallel agreement: N replicas of the decode-node core, one per TP rank.

Every rank sees the same shared events (arrivals, ticks, transfers, load-backs, backups, stores,
decodes, finishes, aborts, timers) and its own rank-local ones: how many pages of a prompt its
shard of L3 holds, and how far its prefetch got and when. Each `Agree` is answered the way a
collective would be: once every rank has entered it, every rank receives the minimum of each
value. Because the core decides only on agreed values, every rank must emit the same commands
in the same order, collectives included; otherwise ranks deadlock in mismatched collectives
(fault 2 of "Six faults of the reference implementation" in docs/architecture.md) or restore
different KV.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import hypothesis.strategies as st
from builders import decode_config, examples
from builders import prompt as tokens
from helpers import cmds as of
from hypothesis import HealthCheck, Phase, given, settings
from lockstep import Lockstep

from hicache.core import commands as cmd
from hicache.core.config import DecodeConfig
from hicache.core.states import State

PAGE = 4
RANKS = 3


def config(**kw: Any) -> DecodeConfig:
    return decode_config(**{"tp_size": RANKS, **kw})


def put_in_l3(r: Lockstep, toks: list[int]) -> None:
    for w in r.worlds:
        for k in w.keys_of(toks):
            w.l3[k] = k


# ============================================================================ deterministic


def test_ranks_with_different_l3_hits_prefetch_and_promise_the_agreed_minimum() -> None:
    r = Lockstep(config(prefetch_policy="wait_complete"))
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


def start_prefetch(r: Lockstep, rid: str, toks: list[int]) -> cmd.Prefetch:
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
    r = Lockstep(config(prefetch_policy="timeout"))
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
    r = Lockstep(config(prefetch_policy="wait_complete"))
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
) -> Lockstep:
    r = Lockstep(config(prefetch_policy=policy, l1_pages=l1, transfer_retries=1))
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
        r.complete_shared(transfers=False)
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
    max_examples=examples(150),
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
