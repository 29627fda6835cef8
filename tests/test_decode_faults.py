"""Scenario tests, one group per fault of the reference implementation (docs/architecture.md,
"Six faults of the reference implementation").

Each scenario drives a decode-node core inside the ground-truth `World` of `kvworld`: the world
executes the core's commands against a model of slot contents and raises `WrongKV` if a request
reaches the decode batch with KV that differs from the truth. Every test asserts a behaviour
that the reference implementation (SGLang PR #26227) gets wrong: a restore shortfall that kills
the request, per-request collectives, repeated matches and L3 queries of a blocked head, locks
that leak, retraction that bypasses the tree and stalls restores, no per-tier attribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from builders import decode_config
from builders import prompt as tokens
from helpers import (
    admit_with_l3,
    assert_clean,
    cmds,
    complete_loads,
    complete_transfers,
    finish_and_back_up,
    only,
    put_in_l3,
    run_to_decode,
    transfers_of,
)
from kvworld import World

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.errors import LockError, TransitionError
from hicache.core.states import State
from hicache.core.tree import TREE

PAGE = 4


def config(**kw: Any) -> DecodeConfig:
    """Small tiers so every scenario fits in a few dozen slots (`tests/builders.py`)."""
    return decode_config(**{"l1_pages": 40, "l2_pages": 40, **kw})


# ============================================================================ fault 1: shortfalls


def test_partial_prefetch_falls_back_for_exactly_the_missing_range() -> None:
    w = World(config())
    toks = tokens(1, 42)  # 10 full pages and a 2-token tail
    put_in_l3(w, toks)
    pf = admit_with_l3(w, "a", toks)
    r = w.core.requests["a"]
    assert len(pf.keys) == 10 and r.promised_pages == 10  # eager: L3 promised before it arrives
    (increment,) = transfers_of(w, "a")
    assert (increment.start, increment.end) == (40, 42)

    mark = len(w.log)
    w.prefetch_done(pf.op, 6)  # a best-effort read ends early: pages 6..9 never arrive
    w.tick()
    (fallback,) = transfers_of(w, "a", mark)
    assert (fallback.start, fallback.end) == (6 * PAGE, 10 * PAGE)
    assert fallback.dst_slots == tuple(r.slots[6:10])
    load = only(w, cmd.LoadBack, mark)
    assert load.device_slots == tuple(r.slots[:6]) and load.host_slots == pf.host_slots[:6]

    run_to_decode(w, "a")  # the world checks every page against the truth
    assert r.account.fallback == 4 * PAGE
    assert (r.account.l1, r.account.l2, r.account.l3, r.account.transferred) == (0, 0, 24, 18)
    w.decode("a", 3)
    w.finish("a")
    assert w.outcomes["a"] == ("finished", "")
    w.settle()
    assert_clean(w)


def test_failed_prefetch_falls_back_for_the_whole_l3_span() -> None:
    w = World(config())
    toks = tokens(2, 30)  # 7 full pages and a tail
    put_in_l3(w, toks)
    pf = admit_with_l3(w, "a", toks)
    mark = len(w.log)
    w.prefetch_done(pf.op, 0)  # the L3 read failed outright
    w.tick()
    (fallback,) = transfers_of(w, "a", mark)
    assert (fallback.start, fallback.end) == (0, 28)
    assert cmds(w, cmd.LoadBack, mark) == []  # nothing to load back
    run_to_decode(w, "a")
    r = w.core.requests["a"]
    assert r.account.fallback == 28 and r.account.l3 == 0 and r.account.transferred == 30
    w.finish("a")
    w.settle()
    assert w.outcomes["a"] == ("finished", "")
    assert w.core.stats.failed == 0
    assert_clean(w)


def test_prefetch_timeout_uses_what_arrived_and_rerequests_the_rest() -> None:
    w = World(config(prefetch_policy="timeout"))
    toks = tokens(3, 41)  # 10 full pages
    put_in_l3(w, toks)
    pf = admit_with_l3(w, "a", toks)
    timer = only(w, cmd.SetTimer)
    r = w.core.requests["a"]
    w.prefetch_progress(pf.op, 4)
    w.tick()
    assert r.state is State.RESTORING and cmds(w, cmd.CancelPrefetch) == []  # still within time

    mark = len(w.log)
    w.fire_timer(timer.timer)
    w.tick()
    assert only(w, cmd.CancelPrefetch, mark) == cmd.CancelPrefetch(pf.op)
    (fallback,) = transfers_of(w, "a", mark)
    assert (fallback.start, fallback.end) == (16, 40)
    load = only(w, cmd.LoadBack, mark)
    assert load.host_slots == pf.host_slots[:4] and load.device_slots == tuple(r.slots[:4])
    # The cancelled read may still write its later slots: they stay the operation's until it ends.
    for h in pf.host_slots[4:]:
        assert w.core.host_pool.owner_of(h) == ("op", pf.op)

    w.load_done(load.op)
    complete_transfers(w, "a")
    assert w.started.get("a") == 1  # ready without waiting for the cancelled read to end
    w.prefetch_done(pf.op, 7)  # it ended later, having written more than was used
    w.tick()
    for h in pf.host_slots[4:]:
        assert w.core.host_pool.owner_of(h) is None
    assert r.account.l3 == 16 and r.account.fallback == 24
    w.finish("a")
    w.settle()
    assert_clean(w)


def test_l3_hit_below_threshold_is_neither_prefetched_nor_promised() -> None:
    w = World(config(prefetch_threshold_tokens=3 * PAGE))
    base = tokens(4, 16)  # 4 full pages
    w.arrive("a", base + [7, 7])
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")  # a's 4 pages are on L1 (and L2, L3)

    toks = base + tokens(5, 26)  # 4 cached pages, then 6 pages and a 2-token tail
    put_in_l3(w, toks)
    w.arrive("b", toks)
    mark = len(w.log)
    w.tick()
    q = only(w, cmd.QueryStorage, mark)
    assert q.queries[0][0] == "b" and len(q.queries[0][1]) == 6
    w.answer_query(q.op, {"b": 2})  # L3 holds 2 pages: below the 3-page threshold
    w.tick()
    assert cmds(w, cmd.Prefetch, mark) == []
    (increment,) = transfers_of(w, "b", mark)
    r = w.core.requests["b"]
    assert r.promised_pages == 4 and (increment.start, increment.end) == (16, 42)
    run_to_decode(w, "b")
    assert r.account.fallback == 0 and r.account.l1 == 16 and r.account.transferred == 26
    w.finish("b")
    w.settle()
    assert_clean(w)


def test_l2_pages_matched_at_admission_survive_l2_pressure_until_loaded_back() -> None:
    w = World(config(l1_pages=40, l2_pages=10, storage=True))
    base = tokens(6, 32)  # 8 full pages
    w.arrive("a", base + [1, 1])
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")  # a's pages: L1 + L2 (8 of 10 L2 slots)
    assert w.core.tree.host_pages == 8

    # A big request evicts a's pages from L1 (they stay on L2), then goes away.
    w.arrive("big", tokens(7, 33 * PAGE))
    w.tick()
    assert w.core.tree.device_pages == 0 and w.core.tree.host_pages == 8
    w.abort("big")
    w.settle()

    # b extends a's prompt: 8 pages on L2, 1 page that only prefill has, and a tail.
    w.arrive("b", base + tokens(8, 6))
    w.arrive("f", tokens(9, 22))  # an unrelated request admitted alongside b
    mark = len(w.log)
    w.tick()
    rb = w.core.requests["b"]
    assert (rb.device_pages, rb.host_pages) == (0, 8) and rb.pin is not None
    load = only(w, cmd.LoadBack, mark)
    assert "b" in load.reqs and len(load.host_slots) == 8
    l2_span = load.host_slots

    # While b's load-back is in flight, L2 runs short twice: f's backup needs 5 pages and e's
    # prefetch needs 8 (2 are free). Neither may take b's pinned pages.
    for op in sorted(w.queries):
        w.answer_query(op)  # L3 holds nothing of f
    w.tick()
    complete_transfers(w, "f")
    assert w.started.get("f") == 1
    failed_before = w.core.tree.stats.backup_failed
    w.finish("f")
    assert w.core.tree.stats.backup_failed > failed_before
    e_toks = tokens(10, 34)
    put_in_l3(w, e_toks)
    w.arrive("e", e_toks)
    w.tick()
    w.answer_query(max(w.queries))
    mark_e = len(w.log)
    w.tick()
    assert [c for c in cmds(w, cmd.Prefetch, mark_e) if c.req == "e"] == []  # e degrades instead
    for h in l2_span:
        assert w.core.host_pool.owner_of(h) == TREE

    for op in sorted(w.backups):
        w.backup_done(op)
    for op in sorted(w.prefetches):
        w.prefetch_done(op)
    w.load_done(load.op)  # copies what L2 holds *now*: wrong KV if b's pages had been reused
    run_to_decode(w, "b")
    assert rb.account.l2 == 32 and rb.account.fallback == 0
    run_to_decode(w, "e")
    assert w.core.requests["e"].account.transferred == 34
    w.settle()
    assert all(o == ("finished", "") for o in w.outcomes.values() if o[0] != "aborted")
    assert_clean(w)


def test_l1_budget_is_reserved_at_admission_so_a_load_back_always_has_room() -> None:
    w = World(config(l1_pages=20))
    a = tokens(11, 38)  # 10 pages (9 full), +1 reserved
    put_in_l3(w, a)
    pf = admit_with_l3(w, "a", a)
    ra = w.core.requests["a"]
    a_slots = list(ra.slots)
    assert len(a_slots) == 10 and ra.reserve == 1

    w.arrive("b", tokens(12, 38))  # would fit only if a's restore had not reserved its pages
    w.arrive("c", tokens(13, 8))
    for _ in range(5):
        w.tick()
        rb, rc = w.core.requests["b"], w.core.requests["c"]
        assert rb.state is State.QUEUED and rc.state is State.QUEUED
        assert rb.slots == [] and rb.reserve == 0  # waiting costs no L1
        assert rb.lock is None or rb.lock.node is w.core.tree.root  # nothing of the tree locked
        assert not rc.matched and rc.lock is None and rc.pin is None  # behind the head: nothing
        w.core.check()

    mark = len(w.log)
    w.prefetch_done(pf.op)
    w.tick()
    load = only(w, cmd.LoadBack, mark)
    assert list(load.device_slots) == a_slots[:9]  # the slots reserved at admission
    run_to_decode(w, "a")
    w.finish("a")
    w.tick()
    assert w.core.requests["b"].state is not State.QUEUED
    run_to_decode(w, "b")
    w.settle()
    assert w.outcomes == {k: ("finished", "") for k in ("a", "b", "c")}
    assert_clean(w)


def test_failed_load_back_falls_back_to_prefill() -> None:
    w = World(config())
    base = tokens(14, 20)  # 5 full pages
    w.arrive("a", base + [3])
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")
    w.core.tree.evict_device(5)  # a's pages leave L1 and stay on L2
    assert w.core.tree.host_pages == 5 and w.core.tree.device_pages == 0

    w.arrive("b", base + [4, 4])
    mark = len(w.log)
    w.tick()
    load = only(w, cmd.LoadBack, mark)
    rb = w.core.requests["b"]
    w.load_done(load.op, failed=("b",))  # the copy failed: b's L1 slots hold garbage
    (fallback,) = [t for t in transfers_of(w, "b", mark) if t.start == 0]
    assert (fallback.start, fallback.end) == (0, 20) and fallback.dst_slots == tuple(rb.slots[:5])
    run_to_decode(w, "b")
    assert rb.account.l2 == 0 and rb.account.fallback == 20 and rb.account.transferred == 22
    assert rb.pin is None
    w.settle()
    assert w.outcomes["b"] == ("finished", "")
    assert_clean(w)


def test_a_bad_l2_page_falls_back_from_that_page_and_is_dropped_once() -> None:
    """A load-back finds page 2 of a 5-page L2 span bad: the request keeps pages 0-1, asks
    prefill for pages 2-4, and the tree drops page 2 (and the L2 copies below it), so a request
    arriving meanwhile with the same prompt loads only the 2 good pages and never reads the bad
    one again."""
    w = World(config(storage=False))
    base = tokens(15, 20)  # 5 full pages
    w.arrive("a", base + [3])
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")
    w.feed(ev.EvictRequested(w.now, 5))  # a's pages leave L1 and stay on L2
    assert w.core.tree.host_pages == 5 and w.core.tree.device_pages == 0

    w.arrive("b", base + [4, 4])
    mark = len(w.log)
    w.tick()
    load = only(w, cmd.LoadBack, mark)
    assert len(load.host_slots) == 5
    w.load_done(load.op, bad_pages=(2,))
    (fallback,) = transfers_of(w, "b", mark)[1:]
    assert (fallback.start, fallback.end) == (8, 20)
    assert w.core.stats.bad_l2_pages == 1 and w.core.tree.stats.host_dropped == 3
    assert w.core.tree.host_pages == 2

    w.arrive("c", base + [5])
    mark = len(w.log)
    w.tick()
    assert len(only(w, cmd.LoadBack, mark).host_slots) == 2  # the bad page is not read again
    run_to_decode(w, "b")
    run_to_decode(w, "c")
    w.settle()
    assert w.accounts["b"].l2 == 8 and w.accounts["b"].fallback == 12
    assert w.accounts["c"].l2 == 8
    assert w.outcomes["b"] == w.outcomes["c"] == ("finished", "")
    assert_clean(w)


# ============================================================================ fault 2: batched collectives


def agree_locally(w: World, out: list[cmd.Command]) -> None:
    """Answer every `Agree` in `out` as if all other ranks held the same values."""
    for c in out:
        if isinstance(c, cmd.Agree):
            w.feed(ev.Agreed(w.now, c.agreement, c.values))


def test_tp_agreements_are_batched_one_per_kind_per_tick() -> None:
    w = World(config(tp_size=2, prefetch_policy="wait_complete"))
    names = ["a", "b", "c", "d"]
    for i, rid in enumerate(names):
        toks = tokens(30 + i, 26)  # 6 full pages each, all in L3
        put_in_l3(w, toks)
        w.arrive(rid, toks)
    per_tick: list[dict[str, int]] = []

    def tick(answer: bool = True) -> list[cmd.Command]:
        out = w.tick()
        kinds: dict[str, int] = {}
        for c in out:
            if isinstance(c, cmd.Agree):
                kinds[c.kind] = kinds.get(c.kind, 0) + 1
        per_tick.append(kinds)
        if answer:
            agree_locally(w, out)
        return out

    out = tick(answer=False)
    (query,) = [c for c in out if isinstance(c, cmd.QueryStorage)]
    assert [rid for rid, _ in query.queries] == names  # one L3 query for all four
    (l3,) = [c for c in out if isinstance(c, cmd.Agree)]
    assert l3.kind == "l3_hits"
    assert sorted(k[2] for k, _ in l3.values) == names  # one collective carries every request
    w.answer_query(query.op)
    tick()  # the first collective is still open: no second one of its kind
    assert per_tick[-1] == {}
    w.feed(ev.Agreed(w.now, l3.agreement, l3.values))  # answered late, with "not known yet"
    out = tick()  # now every rank knows: the hits are agreed and all four prefetches start
    assert per_tick[-1] == {"l3_hits": 1}
    prefetches = cmds(w, cmd.Prefetch)
    assert sorted(p.req for p in prefetches) == names
    for p in prefetches:
        w.prefetch_progress(p.op, 2)
    out = tick()
    (pf,) = [c for c in out if isinstance(c, cmd.Agree)]
    assert pf.kind == "prefetch" and {k[1] for k, _ in pf.values} == {p.op for p in prefetches}
    for p in prefetches:
        w.prefetch_done(p.op)
    for _ in range(6):
        complete_loads(w)
        for tid in sorted(w.transfers):
            w.kv_arrive(tid)
        tick()
    assert all(w.started.get(rid) == 1 for rid in names)
    assert all(n <= 1 for kinds in per_tick for n in kinds.values()), per_tick
    agrees = cmds(w, cmd.Agree)
    assert [a.kind for a in agrees].count("l3_hits") == 2  # for four requests: asked, then answered
    assert len(agrees) <= len(per_tick)
    assert len(cmds(w, cmd.LoadBack)) == 1  # the four restores were ready together: one batch


# ============================================================================ fault 3: no redundant work


def count_matches(w: World) -> list[tuple[int, ...]]:
    """Record the keys of every tree match the core makes (wrapping the tree's method)."""
    calls: list[tuple[int, ...]] = []
    tree = w.core.tree
    original = tree.match

    def match(keys: Any, now: float) -> Any:
        calls.append(tuple(keys))
        return original(keys, now)

    tree.match = match  # type: ignore[method-assign]
    return calls


@pytest.mark.plain_python  # spies on the tree's match
def test_blocked_head_is_matched_once_and_queried_once() -> None:
    w = World(config(l1_pages=24))
    shared = tokens(40, 16)  # 4 pages b will find on L1
    w.arrive("z", shared + [9])
    run_to_decode(w, "z")
    finish_and_back_up(w, "z")
    calls = count_matches(w)
    stats = w.core.tree.stats
    hog = tokens(41, 40)  # 10 pages + 1 reserved
    w.arrive("hog", hog)
    w.tick()
    b_toks = shared + tokens(42, 34)  # 4 cached pages + 8 more full pages + a tail: 14 pages
    w.arrive("b", b_toks)
    b_keys = tuple(w.keys_of(b_toks))
    matched_before = (stats.matched_device, stats.matched_host)
    for _ in range(30):
        w.tick()
    rb = w.core.requests["b"]
    assert rb.state is State.QUEUED and rb.matched
    assert calls.count(b_keys) == 1
    assert (stats.matched_device, stats.matched_host) == (matched_before[0] + 4, matched_before[1])
    assert not [q for q in cmds(w, cmd.QueryStorage) if any(rid == "b" for rid, _ in q.queries)]

    run_to_decode(w, "hog")
    w.finish("hog")
    run_to_decode(w, "b")
    assert calls.count(b_keys) == 1  # no second match at restore time either
    queries = [q for q in cmds(w, cmd.QueryStorage) if any(rid == "b" for rid, _ in q.queries)]
    assert len(queries) == 1
    assert rb.account.l1 == 16
    w.settle()
    assert_clean(w)


# ============================================================================ fault 4: lock ownership


def test_receipts_release_exactly_once() -> None:
    w = World(config())
    w.arrive("a", tokens(50, 18))
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")
    tree = w.core.tree
    m = tree.match(w.keys_of(tokens(50, 16)), w.now)
    lock = tree.lock(m.device_node)
    pin = tree.pin_host(m.host_node if m.host_pages else m.device_node)
    tree.unlock(lock)
    tree.unpin_host(pin)
    with pytest.raises(LockError):
        tree.unlock(lock)
    with pytest.raises(LockError):
        tree.unpin_host(pin)
    other = World(config())
    with pytest.raises(LockError):
        other.core.tree.unlock(tree.lock(m.device_node))  # a receipt of another tree
    tree.unlock(tree.live_locks[0])
    assert_clean(w)


def test_no_request_end_leaves_a_lock_or_pin_behind() -> None:
    """Requests end in every way (finished, aborted in several phases, failed transfer,
    rejected) on a node whose tree they share; afterwards nothing is held."""
    w = World(config(l1_pages=40, transfer_retries=0))
    shared = tokens(51, 24)  # 6 pages
    for rid, n in (("z1", 12), ("z2", 24)):
        w.arrive(rid, shared[:n] + [1])
        run_to_decode(w, rid)
        finish_and_back_up(w, rid)
    w.core.tree.evict_device(3)  # the last 3 pages of z2 leave L1 and stay on L2
    assert w.core.tree.device_pages == 3 and w.core.tree.host_pages == 6
    put_in_l3(w, shared + tokens(52, 20))

    w.arrive("fin", shared + tokens(52, 21))  # L1 + L2 + L3 + transfer
    w.arrive("fail", shared + tokens(53, 6))
    w.arrive("abort", shared + tokens(52, 20) + tokens(54, 3))
    w.arrive("huge", tokens(55, 200))  # never fits L1: rejected
    w.tick()
    assert w.outcomes["huge"][0] == "failed" and "L1" in w.outcomes["huge"][1]
    for rid in ("fin", "fail", "abort"):
        r = w.core.requests[rid]
        assert (r.device_pages, r.host_pages) == (3, 3) and r.lock is not None and r.pin is not None
    (tid,) = [t for t, c in w.transfers.items() if c.req == "fail"]
    w.kv_fail(tid, "prefill crashed")
    assert w.outcomes["fail"] == ("failed", "prefill transfer failed after 1 attempts: prefill crashed")
    w.answer_query(max(w.queries))
    w.tick()
    assert w.core.requests["abort"].prefetch_op is not None
    w.abort("abort")
    run_to_decode(w, "fin")
    w.finish("fin")
    w.settle()
    assert w.outcomes["fin"] == ("finished", "") and w.outcomes["abort"][0] == "aborted"
    assert_clean(w)


# ============================================================================ fault 5: retraction


@pytest.mark.plain_python  # spies on the tree's match
def test_retracted_request_goes_through_the_tree_and_never_stalls_restores() -> None:
    w = World(config(l1_pages=16, decode_reserve_tokens=0))
    calls = count_matches(w)
    w.arrive("a", tokens(60, 18))  # 5 pages
    w.arrive("b", tokens(61, 17))  # 5 pages, the last one partial
    run_to_decode(w, "a")
    run_to_decode(w, "b")
    c_toks = tokens(62, 22)  # 6 pages, 5 of them in L3: takes the last free pages of L1
    put_in_l3(w, c_toks)
    pf = admit_with_l3(w, "c", c_toks)
    assert w.core.device_pool.num_free == 0
    w.decode("b", 2)  # b: 19 tokens, 4 full pages and a 3-token tail
    rb = w.core.requests["b"]
    b_keys = tuple(rb.keys)
    b_full_slots = rb.slots[:4]

    device_before = w.core.tree.device_pages
    w.decode("a", 3)  # a needs a 6th page: L1 is full, so b (the newest by policy) yields
    assert w.retracts == ["b"]
    assert rb.state is State.RETRACTED and rb.account.retractions == 1
    assert w.core.requests["a"].state is State.RUNNING
    assert w.core.tree.device_pages == device_before + 4  # b's KV went into the tree
    assert all(w.core.device_pool.owner_of(s) == TREE for s in b_full_slots)

    matched = calls.count(b_keys)
    w.tick()  # b resumes: it re-matches and finds its own pages; it waits for 1 page of L1
    assert rb.state is State.QUEUED and rb.matched and rb.prompt_len == 19
    assert calls.count(b_keys) == matched + 1 and rb.device_pages == 4

    # Meanwhile c's restore runs to the end: prefetch, load-back, decode.
    w.prefetch_done(pf.op)
    w.tick()
    complete_loads(w)
    complete_transfers(w, "c")
    assert w.started.get("c") == 1 and rb.state is State.QUEUED
    assert calls.count(b_keys) == matched + 1  # waiting does not re-match

    w.finish("a")
    run_to_decode(w, "b")  # b's resumed KV (its own pages + the re-requested tail) is checked
    assert w.started["b"] == 2
    assert rb.account.cached == 16 and rb.account.l1 == 16 and rb.account.transferred == 3
    assert rb.account.retractions == 1 and w.core.stats.retracted == 1
    w.decode("b", 1)
    w.finish("b")
    w.settle()
    assert w.outcomes == {k: ("finished", "") for k in ("a", "b", "c")}
    assert_clean(w)


def test_resumed_request_restores_its_own_pages_from_l2() -> None:
    """A retracted request whose pages then leave L1 resumes from L2, not from prefill."""
    w = World(config(l1_pages=12, decode_reserve_tokens=0))
    w.arrive("a", tokens(63, 18))  # 5 pages
    w.arrive("b", tokens(64, 22))  # 6 pages: 1 page of L1 left
    run_to_decode(w, "a")
    run_to_decode(w, "b")
    w.decode("b", 2)  # 24 tokens: still 6 pages
    w.decode("a", 3)  # 21 tokens: takes the last page
    w.decode("b", 1)  # 25 tokens: b needs a 7th page and is the newest: it yields
    assert w.retracts == ["b"]
    w.finish("a")
    for _ in range(3):
        for op in sorted(w.backups):
            w.backup_done(op)
        for op in sorted(w.stores):
            w.store_done(op)
    w.core.tree.evict_device(12)  # every page leaves L1; the tree keeps them on L2
    assert w.core.tree.device_pages == 0 and w.core.tree.host_pages == 11
    mark = len(w.log)
    w.tick()
    rb = w.core.requests["b"]
    assert (rb.device_pages, rb.host_pages) == (0, 6)
    run_to_decode(w, "b")
    assert (rb.account.l1, rb.account.l2, rb.account.transferred) == (0, 24, 1)
    assert [(t.start, t.end) for t in transfers_of(w, "b", mark)] == [(24, 25)]
    w.settle()
    assert w.outcomes["b"] == ("finished", "")
    assert_clean(w)


def test_retracting_one_victim_is_enough_for_one_page() -> None:
    """Under the default write-through policy a retracted request's pages go into the tree with
    a backup in flight, so they cannot be evicted at once. Retracting it must still make room
    for the request that grew; retracting every running request for one page must not happen."""
    w = World(config(l1_pages=10, decode_reserve_tokens=0))
    w.arrive("a", tokens(66, 20))  # 5 full pages
    w.arrive("b", tokens(67, 20))  # 5 full pages: L1 is full
    run_to_decode(w, "a")
    run_to_decode(w, "b")
    w.decode("a", 1)  # a needs a 6th page
    assert len(w.retracts) == 1, f"retracted {w.retracts} for one page"
    (kept,) = {"a", "b"} - set(w.retracts)
    assert w.core.requests[kept].state is State.RUNNING
    w.settle()
    assert_clean(w)


@pytest.mark.parametrize("page_size", [1, 4])
def test_self_retraction_on_a_page_completing_decode(page_size: int) -> None:
    """The only running request grows past a full L1 with a decode step that completes a page
    (any step when page_size is 1, SGLang's default): it must retract itself cleanly."""
    w = World(config(l1_pages=10, page_size=page_size, decode_reserve_tokens=0, storage=False))
    w.arrive("a", tokens(68, 5 * page_size))
    run_to_decode(w, "a")
    w.arrive("c", tokens(69, 5 * page_size))  # restoring: its transfer holds the other 5 pages
    w.tick()
    assert w.core.device_pool.num_free == 0 and w.core.requests["c"].state is State.RESTORING
    w.decode("a", page_size)  # one more full page; L1 has no room for it
    r = w.core.requests["a"]
    assert r.state is State.RETRACTED and w.retracts == ["a"]
    w.core.check()
    w.settle()
    assert w.outcomes == {"a": ("finished", ""), "c": ("finished", "")}
    assert_clean(w)


def tree_kv_is_true(w: World) -> None:
    """Every page the tree holds on L1 holds that page's KV (keys are the world's KV identity)."""
    for node in w.core.tree.nodes():
        if node.device is not None:
            for key, slot in zip(node.keys, node.device, strict=True):
                assert w.l1[slot] == key, f"tree page in L1 slot {slot} holds {w.l1[slot]!r}"


def test_retraction_never_puts_unwritten_kv_in_the_tree() -> None:
    """A decode step that uses the request's reserved page and then needs one more retracts the
    request itself. The tokens of that step never got their KV written (the decoder had no room
    for them), so the page they fill must not enter the tree: it would be served as a cache hit
    (and backed up to L2 and stored to L3, where other nodes would read it)."""
    w = World(config(l1_pages=8, storage=False))  # 1 page reserved per request
    w.arrive("a", tokens(98, 16))  # 4 pages + 1 reserved
    run_to_decode(w, "a")
    w.arrive("c", tokens(99, 8))  # 2 pages + 1 reserved: L1 is full; c's transfer stays in flight
    w.tick()
    w.decode("a", 5)  # 21 tokens: the reserved page, then a 6th page that does not exist
    assert w.retracts == ["a"] and w.core.requests["a"].state is State.RETRACTED
    tree_kv_is_true(w)
    w.settle()  # a resumes from its own pages: WrongKV if one of them was never written
    assert w.outcomes == {"a": ("finished", ""), "c": ("finished", "")}
    assert_clean(w)


# ============================================================================ fault 6: attribution


def test_accounts_attribute_every_prompt_token_to_one_tier() -> None:
    w = World(config(l1_pages=20))
    base = tokens(70, 16)  # 4 pages
    ext = tokens(71, 16)  # 4 more
    w.arrive("a", base + [1, 1])
    run_to_decode(w, "a")
    finish_and_back_up(w, "a")
    w.arrive("a2", base + ext + [2, 2])
    run_to_decode(w, "a2")
    finish_and_back_up(w, "a2")
    w.arrive("big", tokens(72, 48))  # needs 13 of the 12 free pages: ext leaves L1 for L2
    w.tick()
    w.abort("big")
    assert (w.core.tree.device_pages, w.core.tree.host_pages) == (4, 8)

    c_toks = base + ext + tokens(73, 16) + [3, 3]  # 4 on L1, 4 on L2, 4 in L3, a 2-token tail
    put_in_l3(w, c_toks)
    w.arrive("c", c_toks)
    run_to_decode(w, "c")
    a = w.core.requests["c"].account
    assert (a.l1, a.l2, a.l3, a.transferred, a.fallback) == (16, 16, 16, 2, 0)
    assert a.cached + a.transferred == len(c_toks)

    w.settle()
    s = w.core.stats
    reached = [r for r in w.core.requests.values() if r.id != "big"]
    assert s.prompt_tokens == sum(r.prompt_len for r in reached)
    for tier in ("l1", "l2", "l3", "transferred"):
        assert getattr(s, f"{tier}_tokens") == sum(getattr(r.account, tier) for r in reached), tier
    assert s.l1_tokens + s.l2_tokens + s.l3_tokens + s.transferred_tokens == s.prompt_tokens
    assert s.l1_tokens == 16 + 16 and s.l2_tokens == 16 and s.l3_tokens == 16
    assert_clean(w)


# ============================================================================ abort, late completions, claims

PHASES = {
    "queued_head": State.QUEUED,
    "queued_behind": State.QUEUED,
    "querying": State.QUERYING,
    "prefetching": State.RESTORING,
    "loading": State.RESTORING,
    "transferring": State.RESTORING,
    "running": State.RUNNING,
    "retracted": State.RETRACTED,
}


def reach(w: World, phase: str) -> Callable[[], None]:
    """Bring request "t" to `phase` on a node that also serves others; return a function that
    delivers the completions still in flight for it (the late ones, after its abort)."""
    shared = tokens(80, 24)  # 6 pages on L1, L2 and L3 after z
    w.arrive("z", shared + [1])
    run_to_decode(w, "z")
    finish_and_back_up(w, "z")
    core = w.core
    nothing: Callable[[], None] = lambda: None  # noqa: E731
    if phase in ("queued_head", "queued_behind"):
        w.arrive("hog", tokens(81, 60))  # 15 + 1 of the 24 free pages
        w.tick()
        w.arrive("head" if phase == "queued_behind" else "t", shared + tokens(82, 30))
        if phase == "queued_behind":
            w.arrive("t", shared + tokens(83, 30))
        w.tick()
        head = core.requests[core.queue[0]]
        assert head.state is State.QUEUED and head.matched and head.lock.node is not core.tree.root
        return nothing
    if phase == "retracted":
        core.tree.evict_device(6)  # z's pages: L2 only, so L1 is all for t and hog
        w.arrive("t", tokens(84, 38))  # 10 pages, the last with 2 tokens, + 1 reserved
        w.arrive("hog", tokens(85, 44))  # 11 pages + 1 reserved: 1 page of L1 left
        run_to_decode(w, "t")
        run_to_decode(w, "hog")
        w.decode("hog", 5)  # 13 pages: its reserve and the last free page
        w.decode("hog", 4)  # a 14th page: t (admitted with hog, named later) yields
        assert core.requests["t"].state is State.RETRACTED and w.retracts == ["t"]
        return nothing
    t_toks = shared + tokens(86, 21)  # 6 cached pages, 5 more full pages, a tail
    if phase == "loading":
        core.tree.evict_device(6)  # z's pages are on L2 only
        t_toks = shared + [3, 3]
    put_in_l3(w, t_toks)
    mark = len(w.log)
    w.arrive("t", t_toks)
    w.tick()
    if phase == "querying":
        (q,) = cmds(w, cmd.QueryStorage, mark)
        return lambda: w.answer_query(q.op)
    if phase == "loading":
        (load,) = cmds(w, cmd.LoadBack, mark)
        return lambda: w.load_done(load.op)
    w.answer_query(only(w, cmd.QueryStorage, mark).op)
    w.tick()
    (pf,) = cmds(w, cmd.Prefetch, mark)
    if phase == "prefetching":
        return lambda: w.prefetch_done(pf.op, 3)
    w.prefetch_done(pf.op)
    w.tick()
    complete_loads(w)
    if phase == "transferring":
        (tid,) = [x for x, c in w.transfers.items() if c.req == "t"]
        return lambda: w.kv_arrive(tid)
    run_to_decode(w, "t")
    w.decode("t", 2)
    return nothing


@pytest.mark.parametrize("phase", PHASES)
def test_abort_in_every_phase_releases_everything(phase: str) -> None:
    w = World(config(l1_pages=24, l2_pages=40))
    late = reach(w, phase)
    core = w.core
    t = core.requests["t"]
    state = t.state
    assert state is PHASES[phase]
    prefetching = any(c.req == "t" for c in w.prefetches.values())
    loading = any("t" in c.reqs for c in w.loads.values())
    transferring = any(c.req == "t" for c in w.transfers.values())
    in_flight = {
        "prefetching": prefetching,
        "loading": loading,
        "transferring": transferring and not (prefetching or loading),
    }
    assert in_flight.get(phase, True), phase
    w.abort("t")
    assert w.outcomes["t"] == ("aborted", "client went away") and t.state is State.ABORTED
    assert t.lock is None and t.pin is None and t.slots == [] and t.reserve == 0, state
    w.core.check()
    late()  # a completion of I/O started before the abort: absorbed
    w.tick()
    w.abort("t")  # a second abort is absorbed too
    assert w.outcomes["t"] == ("aborted", "client went away")
    w.settle()
    assert all(o == ("finished", "") for rid, o in w.outcomes.items() if rid != "t"), w.outcomes
    assert w.core.stats.aborted == 1
    assert_clean(w)


def test_in_flight_transfer_keeps_its_slots_until_it_ends() -> None:
    w = World(config(l1_pages=12, storage=False))
    w.arrive("a", tokens(90, 36))  # 9 pages + 1 reserved
    w.tick()
    (xfer,) = transfers_of(w, "a")
    w.abort("a")
    for s in xfer.dst_slots:  # prefill may still be writing them
        assert w.core.device_pool.owner_of(s) == ("xfer", xfer.transfer)
    w.arrive("b", tokens(91, 8))  # 2 pages + 1: only the slots no transfer writes are free
    w.tick()
    rb = w.core.requests["b"]
    assert rb.state is State.RESTORING and not set(rb.slots) & set(xfer.dst_slots)
    w.arrive("c", tokens(92, 16))  # 4 + 1 pages: would need claimed slots, so it waits
    w.tick()
    assert w.core.requests["c"].state is State.QUEUED
    w.kv_arrive(xfer.transfer)  # late: the KV lands in slots nobody uses, then they free
    assert all(w.core.device_pool.owner_of(s) != ("xfer", xfer.transfer) for s in xfer.dst_slots)
    w.tick()
    assert w.core.requests["c"].state is State.RESTORING
    w.settle()
    assert w.outcomes["b"] == w.outcomes["c"] == ("finished", "")
    assert_clean(w)


def test_in_flight_prefetch_and_load_keep_their_slots_until_they_end() -> None:
    w = World(config(l1_pages=30, l2_pages=18))
    shared = tokens(93, 16)
    w.arrive("z", shared + [1])
    run_to_decode(w, "z")
    finish_and_back_up(w, "z")
    w.core.tree.evict_device(4)  # z's 4 pages: L2 only
    toks = shared + tokens(94, 36)  # 4 pages on L2, 9 in L3, no tail
    put_in_l3(w, toks)
    pf = admit_with_l3(w, "a", toks)
    (load,) = [c for c in cmds(w, cmd.LoadBack) if "a" in c.reqs]
    w.abort("a")
    assert only(w, cmd.CancelPrefetch) == cmd.CancelPrefetch(pf.op)
    host, device = w.core.host_pool, w.core.device_pool
    assert all(host.owner_of(h) == ("op", pf.op) for h in pf.host_slots)
    assert all(device.owner_of(d) == ("op", load.op) for d in load.device_slots)
    assert all(host.owner_of(h) == TREE for h in load.host_slots)
    assert len(w.core.tree.live_pins) == 1  # the load still reads z's L2 pages

    b_toks = tokens(95, 20)  # 5 pages in L3: wants L2 slots for its prefetch
    put_in_l3(w, b_toks)
    pb = admit_with_l3(w, "b", b_toks)
    assert not set(pb.host_slots) & set(pf.host_slots)
    assert not set(w.core.requests["b"].slots) & set(load.device_slots)

    w.prefetch_done(pf.op, 9)  # late; it wrote all its slots
    w.load_done(load.op)
    assert all(device.owner_of(d) is None for d in load.device_slots)
    assert w.core.tree.live_pins == []
    w.tick()
    assert all(host.owner_of(h) is None for h in pf.host_slots)
    w.settle()
    assert w.outcomes["b"] == ("finished", "")
    assert_clean(w)


def test_invalid_event_names_request_state_and_event() -> None:
    w = World(config(l1_pages=12))
    w.arrive("hog", tokens(96, 40))
    w.arrive("q", tokens(97, 8))
    w.tick()
    assert w.core.requests["q"].state is State.QUEUED
    with pytest.raises(TransitionError) as err:
        w.core.handle(ev.Decoded(w.now, "q", 1))
    assert (err.value.req, err.value.state, err.value.event) == ("q", "queued", "Decoded")
    assert "'q'" in str(err.value) and "queued" in str(err.value) and "Decoded" in str(err.value)
    assert w.core.requests["hog"].state is State.QUERYING
    with pytest.raises(TransitionError, match="querying cannot take Finished"):
        w.core.handle(ev.Finished(w.now, "hog"))  # not running yet
    w.abort("q")
    with pytest.raises(TransitionError, match="aborted"):
        w.core.handle(ev.Decoded(w.now, "q", 1))  # no decoding after the end either
