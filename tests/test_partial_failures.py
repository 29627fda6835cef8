"""Page-level failures of the tree's copies, each reduced to the smallest schedule that showed it.

A failed backup, store or load-back must never leave a page marked valid on a tier that holds
other bytes, never wedge eviction, never leak a slot; and a malformed completion is refused the
same way by the compiled and the plain-Python core. The random worlds that found these live in
`tests/test_io_faults_stateful.py`; here each one is a fixed, readable schedule.
"""

from __future__ import annotations

import typing

import attrs
import pytest
from builders import decode_config, prompt
from kvworld import World
from test_tree import make_tree, node_at, one_backup, one_store, put

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.errors import CoreError
from hicache.core.tree import EvictResult

# ---------------------------------------------------------------------- 1. a bad L2 page stays


def _l2_only(keys: list[int]):
    """A tree holding `keys` on L2 only."""
    tree, dev, host = make_tree()
    put(tree, keys)
    tree.backup_done(one_backup(tree).op)
    assert tree.evict_device(len(keys)).freed == len(keys)
    return tree, dev, host


def test_two_bad_pages_reported_through_one_anchor_both_leave_l2() -> None:
    """Two requests pinned the same L2-only span (one anchor). The first load reports page 3
    bad: pages [3, 5) leave, the anchor among them. The second reports page 0 bad through that
    detached anchor: pages [0, 3), still attached, must leave too."""
    tree, _, host = _l2_only([1, 2, 3, 4, 5])
    anchor = tree.match([1, 2, 3, 4, 5], 1.0).host_node
    pins = [tree.pin_host(anchor), tree.pin_host(anchor)]
    assert tree.drop_host(anchor, 3) == 2
    assert tree.peek([1, 2, 3, 4, 5]) == 3
    assert tree.drop_host(anchor, 0) == 3
    tree.check()
    assert tree.peek([1, 2, 3, 4, 5]) == 0
    assert tree.match([1, 2, 3, 4, 5], 2.0).host_pages == 0
    for pin in pins:
        tree.unpin_host(pin)
    tree.check()
    assert host.num_free == host.capacity and tree.num_nodes == 0


def test_a_bad_page_below_a_cut_already_changes_nothing() -> None:
    tree, _, _ = _l2_only([1, 2, 3, 4, 5])
    anchor = tree.match([1, 2, 3, 4, 5], 1.0).host_node
    pin = tree.pin_host(anchor)
    assert tree.drop_host(anchor, 1) == 4
    assert tree.drop_host(anchor, 3) == 0  # inside what left already
    tree.check()
    assert tree.peek([1, 2, 3, 4, 5]) == 1
    tree.unpin_host(pin)
    tree.check()


def test_a_bad_page_of_a_copy_given_up_since_leaves_the_new_copy_alone() -> None:
    """The load read slot `h` of page 0; that copy was given up and the page backed up again to
    another slot. The report is about the old slot: the new copy stays."""
    tree, _, _ = _l2_only([1, 2])
    anchor = tree.match([1, 2], 1.0).host_node
    pin = tree.pin_host(anchor)
    old = anchor.host
    assert old is not None
    assert tree.drop_host(anchor, 1, slot=old[1]) == 1
    assert tree.drop_host(anchor, 1, slot=old[1]) == 0  # the same report twice
    tree.unpin_host(pin)
    tree.check()
    assert tree.peek([1, 2]) == 1


def test_two_requests_in_one_load_back_report_bad_pages_of_one_span() -> None:
    """Through the decode core: both requests matched the same L2-only span, their entries
    went out in one LoadBack, and each came back with a different first bad page."""
    cfg = decode_config(page_size=2, l1_pages=24, l2_pages=24, storage=False, decode_reserve_tokens=0)
    w = World(cfg)
    shared = prompt(1, 10)  # 5 pages
    w.arrive("a", shared + [7])
    w.settle()
    w.feed(ev.EvictRequested(w.now, 10**6))  # L2 only now
    assert w.core.tree.peek(w.keys_of(shared)) == 5
    w.arrive("b", shared + [8, 9])
    w.arrive("c", shared + [10, 11])
    w.tick()
    (op,) = w.loads
    load = w.loads[op]
    assert load.reqs == ("b", "c")
    # The copy fails for b's page 3 and for c's page 0 (the copy, not the L2 bytes: the two
    # entries read the same slots, yet their first bad pages differ).
    del w.loads[op]
    for j, (h, d) in enumerate(zip(load.host_slots, load.device_slots, strict=True)):
        w.l1[d] = ("garbage", op) if j in (3, 4, 5, 6, 7, 8, 9) else w.l2[h]
    w.feed(ev.LoadDone(w.now, op, (3, 5)))
    w.core.check()
    assert w.core.tree.peek(w.keys_of(shared)) == 0  # no later match reads a bad page
    assert w.core.stats.bad_l2_pages == 2
    w.settle()
    assert w.outcomes["b"] == w.outcomes["c"] == ("finished", "")
    audit = w.core.audit()
    assert audit["l1_leaked"] == audit["l2_leaked"] == audit["pins"] == 0


# ---------------------------------------------------------------------- 2. a stale backup's end


def test_an_old_backups_end_never_validates_the_slots_a_newer_backup_writes() -> None:
    """X backs up [1, 2]; Y, issued while X runs, backs up [3, 4] below it. X fails: both leave
    L2, Y's slots retired while Y still writes them. A third insert backs the whole path up
    again (Z, new slots). Y's end must not mark Z's slots valid, nor store them to L3."""
    tree, _, host = make_tree(store_to_l3=True)
    put(tree, [1, 2])
    x = one_backup(tree)
    put(tree, [1, 2, 3, 4])
    y = one_backup(tree)
    assert y.host_slots != x.host_slots
    tree.backup_done(x.op, failed=(0,))
    tree.check()
    assert node_at(tree, [3, 4]).host is None
    put(tree, [1, 2, 3, 4])
    z = one_backup(tree)
    assert len(z.host_slots) == 4
    assert not set(z.host_slots) & set(y.host_slots)  # Y still writes its slots: not reused
    assert tree.backup_done(y.op).backed_keys == []
    tree.check()
    assert tree.drain() == []  # no Store reads Z's slots while Z writes them
    lower = node_at(tree, [3, 4])
    assert lower.host == z.host_slots[2:] and lower.host_pending
    assert tree.backup_done(z.op).backed_keys == [1, 2, 3, 4]
    store = one_store(tree)
    assert store.host_slots == z.host_slots
    tree.store_done(store.op)
    tree.check()
    assert host.num_free == host.capacity - 4


def test_a_stale_backups_failure_leaves_the_newer_copy_in_flight() -> None:
    """Y (stale, as above) fails: that says nothing of Z's copy, which must stay in flight."""
    tree, _, _ = make_tree(store_to_l3=True)
    put(tree, [1, 2])
    x = one_backup(tree)
    put(tree, [1, 2, 3, 4])
    y = one_backup(tree)
    tree.backup_done(x.op, failed=(0,))
    put(tree, [1, 2, 3, 4])
    z = one_backup(tree)
    tree.backup_done(y.op, failed=(0,))
    tree.check()
    assert node_at(tree, [1, 2]).host == z.host_slots[:2]
    assert node_at(tree, [3, 4]).host == z.host_slots[2:]
    assert tree.backup_done(z.op).backed_keys == [1, 2, 3, 4]
    tree.check()


# ---------------------------------------------------------------------- 3. write-back under failure


def test_a_write_back_page_whose_backup_failed_is_dropped_when_evicted_again() -> None:
    tree, dev, host = make_tree(l1=4, l2=8, write_policy="write_back")
    put(tree, [1, 2])
    assert tree.evict_device(2) == EvictResult(0, 2, [], [])
    tree.backup_done(one_backup(tree).op, failed=(0,))
    tree.check()
    assert node_at(tree, [1, 2]).device is not None  # kept: a miss costs nothing yet
    assert tree.evict_device(2) == EvictResult(2, 0, [], [1, 2])  # dropped, not backed up again
    assert tree.drain() == []
    tree.check()
    assert dev.num_free == 4 and host.num_free == 8 and tree.num_nodes == 0


def test_write_back_under_persistent_failure_frees_l1_for_the_next_request() -> None:
    """Every backup fails: a node waiting for room still gets it, one round later."""
    cfg = decode_config(
        page_size=2, l1_pages=8, l2_pages=8, storage=False, write_policy="write_back", decode_reserve_tokens=0
    )
    w = World(cfg)
    for i in range(6):
        w.arrive(f"r{i}", prompt(i, 9))
        for _ in range(50):
            w.complete_reads()
            for tid in sorted(w.transfers):
                w.kv_arrive(tid)
            for op in sorted(w.backups):
                w.backup_done(op, failed=(0,))
            for rid in list(w.running):
                w.finish(rid)
            w.tick()
            if f"r{i}" in w.outcomes:
                break
        assert w.outcomes.get(f"r{i}") == ("finished", ""), f"r{i} never got L1: {w.core.audit()}"
        w.core.check()


# ---------------------------------------------------------------------- 4. nothing kept after a drain


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_after_a_drain_with_copies_that_keep_failing_every_slot_comes_back(write_policy: str) -> None:
    """Every request ended and every copy completed (each one failing): nothing but the tree holds
    a slot, and evicting everything, with backups still failing, frees every slot."""
    cfg = decode_config(
        page_size=2, l1_pages=16, l2_pages=8, storage=True, write_policy=write_policy, decode_reserve_tokens=0
    )
    w = World(cfg)

    def fail_copies() -> None:
        for op in sorted(w.backups):
            w.backup_done(op, failed=(0,))
        for op in sorted(w.stores):
            w.store_done(op, failed=(0,))

    for i in range(4):
        w.arrive(f"r{i}", prompt(i % 2, 7) + prompt(10 + i, 2))
        while f"r{i}" not in w.outcomes:
            w.complete_reads()
            for tid in sorted(w.transfers):
                w.kv_arrive(tid)
            fail_copies()
            for rid in list(w.running):
                w.finish(rid)
            w.tick()
    fail_copies()
    assert w.core.idle
    audit = w.core.audit()
    assert audit["l1_leaked"] == audit["l2_leaked"] == audit["locks"] == audit["pins"] == 0, audit
    for _ in range(10):
        w.feed(ev.EvictRequested(w.now, 10**6, 10**6))
        fail_copies()
    w.core.check()
    assert w.core.audit()["l1_free"] == 16 and w.core.audit()["l2_free"] == 8, w.core.audit()


# ---------------------------------------------------------------------- 5. one refusal path


MALFORMED_PAGES = [("x",), (None,), (1.0,), (True,), ((0,),), (10**30,)]


def _serve_until_backed_up(w: World, rid: str, tokens: list[int]) -> None:
    """`rid` arrives, gets its KV from prefill, decodes and finishes: its pages go to the tree,
    whose backup is then in flight."""
    w.arrive(rid, tokens)
    while rid not in w.running:
        w.tick()
        w.complete_reads()
        for tid in sorted(w.transfers):
            w.kv_arrive(tid)
    w.finish(rid)


def _core_with_io_in_flight() -> tuple[World, int, int, int]:
    """A world with a backup, a store and a load-back in flight; their op ids."""
    cfg = decode_config(page_size=2, l1_pages=16, l2_pages=16, storage=True, decode_reserve_tokens=0)
    w = World(cfg)
    w.arrive("a", prompt(1, 8))
    w.settle()
    w.feed(ev.EvictRequested(w.now, 10**6))  # "a" on L2 only
    _serve_until_backed_up(w, "b", prompt(2, 4))
    (backup,) = w.backups
    w.backup_done(backup)  # its store is in flight now
    _serve_until_backed_up(w, "d", prompt(3, 4))  # and d's backup
    w.arrive("c", prompt(1, 8) + [5])
    w.tick()  # c's L2 load-back goes out
    assert len(w.backups) == len(w.stores) == len(w.loads) == 1, w.log
    return w, min(w.backups), min(w.stores), min(w.loads)


@pytest.mark.parametrize("failed", MALFORMED_PAGES, ids=repr)
def test_a_malformed_failed_page_is_refused_with_the_core_and_its_clock_unchanged(failed: tuple) -> None:
    w, backup_op, store_op, load_op = _core_with_io_in_flight()
    core = w.core
    later = w.now + 5.0
    events: list[ev.Event] = [
        ev.BackupDone(later, backup_op, failed),
        ev.StoreDone(later, store_op, failed),
        ev.LoadDone(later, load_op, failed),
    ]
    for e in events:
        before = core.snapshot()
        with pytest.raises(CoreError, match="failed pages"):
            core.handle(e)
        assert core.snapshot() == before, f"{e!r} was refused but changed the core"
        assert core.now < later
    w.settle()
    core.check()


@pytest.mark.parametrize(
    "event",
    [
        ev.LoadDone(9.0, "1"),  # type: ignore[arg-type]
        ev.LoadDone(9.0, [1]),  # type: ignore[arg-type]
        ev.BackupDone(9.0, None),  # type: ignore[arg-type]
        ev.StoreDone(9.0, 1.0),  # type: ignore[arg-type]
        ev.TimerFired(9.0, [3]),  # type: ignore[arg-type]
        ev.KVArrived(9.0, ["a"], 1),  # type: ignore[arg-type]
        ev.Finished(9.0, {"a": 1}),  # type: ignore[arg-type]
        ev.AbortRequested(9.0, None),  # type: ignore[arg-type]
        ev.Agreed(9.0, {}, ()),  # type: ignore[arg-type]
        ev.PrefetchDone(9.0, 1, "3"),  # type: ignore[arg-type]
        ev.Decoded(9.0, "a", True),  # type: ignore[arg-type]
        ev.EvictRequested(9.0, 1.5),  # type: ignore[arg-type]
        ev.RequestArrived(9.0, ["x"], 2, (1,)),  # type: ignore[arg-type]
        ev.RequestArrived(9.0, "x", True, ()),  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_an_event_with_a_field_of_the_wrong_type_is_refused_by_name(event: ev.Event) -> None:
    w = World(decode_config(page_size=2))
    w.arrive("a", prompt(1, 5))
    w.tick()
    before = w.core.snapshot()
    with pytest.raises(CoreError):
        w.core.handle(event)
    assert w.core.snapshot() == before
    w.settle()
    assert w.outcomes["a"] == ("finished", "")


def test_every_event_type_says_which_of_its_fields_are_checked() -> None:
    """A new event type must name its id, count and request fields in `FIELD_TYPES`, or it would
    reach its handler unchecked."""
    assert set(ev.FIELD_TYPES) == set(typing.get_args(ev.Event))
    for kind, fields in ev.FIELD_TYPES.items():
        names = {a.name for a in attrs.fields(kind)}
        assert {name for name, _ in fields} <= names, kind


# ---------------------------------------------------------------------- 6. priority at arrival


@pytest.mark.parametrize("priority", ["high", None, 1.5, True, (1,)], ids=repr)
def test_a_priority_that_is_not_an_integer_is_refused_at_arrival(priority: object) -> None:
    w = World(decode_config(page_size=2))
    w.arrive("a", prompt(1, 6))
    w.settle()
    before = w.core.snapshot()
    keys = w.keys_of(prompt(1, 6))
    with pytest.raises(CoreError, match="priority"):
        w.core.handle(ev.RequestArrived(w.now + 1, "b", 6, keys, priority))  # type: ignore[arg-type]
    assert w.core.snapshot() == before
    # The same prompt with an integer priority goes through, over the pages "a" left.
    w.arrive("c", prompt(1, 6), priority=2)
    w.settle()
    assert w.outcomes["c"] == ("finished", "")
    w.core.check()


def test_respond_carries_every_request_to_one_end_after_a_refused_arrival() -> None:
    w = World(decode_config(page_size=2))
    with pytest.raises(CoreError):
        w.core.handle(ev.RequestArrived(0.0, "a", 4, w.keys_of(prompt(1, 4)), "high"))  # type: ignore[arg-type]
    assert "a" not in w.core.requests
    w.arrive("a", prompt(1, 4))
    w.settle()
    assert [c.req for c in w.log if isinstance(c, cmd.Respond)] == ["a"]
