"""A refused event leaves the core exactly as it was.

A driver that feeds a duplicated, malformed or out-of-order event gets a `CoreError` (naming
what was wrong) and may log it and go on: the core must not have counted, consumed or changed
anything on the way to refusing it, or the correct event that follows would be refused in turn
and the request stick, or TP ranks diverge. Between valid steps of a random workload in the
test world (`tests/kvworld.py`), this test feeds events that must be refused and compares
`DecodeNodeCore.snapshot()` before and after each one.
"""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
import pytest
from builders import decode_config, examples, prompt
from hypothesis import HealthCheck, given, settings
from kvworld import World

from hicache.core import events as ev
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError

PAGE = 2


def refused(core: DecodeNodeCore, event: ev.Event) -> str:
    """Feed `event`, which must be refused without any change; return the error's text."""
    before = core.snapshot()
    with pytest.raises(CoreError) as err:
        core.handle(event)
    after = core.snapshot()
    assert after == before, f"{event!r} was refused ({err.value}) but changed the core"
    return str(err.value)


def bad_events(w: World, history: list[ev.Event]) -> list[ev.Event]:
    """Events the world's core must refuse in its present state."""
    now = w.now
    core = w.core
    out: list[ev.Event] = [
        ev.StorageQueried(now, 10**6, ()),  # no such query
        ev.LoadDone(now, 10**6),
        ev.BackupDone(now, 10**6),
        ev.StoreDone(now, 10**6),
        ev.PrefetchDone(now, 10**6, 0),
        ev.TimerFired(now, 10**6),
        ev.Agreed(now, 10**6, ()),
        ev.KVArrived(now, "nobody", 10**6),
        ev.EvictRequested(now, -1),
        ev.ForgetRequested(now, "nobody"),
        ev.RequestArrived(now, "bad", 5, (1,)),  # 5 tokens of 2-token pages need 2 keys
    ]
    # Duplicates: every completion fed so far is refused a second time.
    out += [
        e for e in history if not isinstance(e, ev.Tick | ev.Decoded | ev.RequestArrived | ev.ForgetRequested)
    ]
    out += [e for e in history if isinstance(e, ev.ForgetRequested) and e.req in core.requests]
    out += [
        ev.RequestArrived(now, e.req, e.prompt_len, e.keys)
        for e in history
        if isinstance(e, ev.RequestArrived) and e.req in core.requests
    ]
    for op, q in w.queries.items():
        rids = [rid for rid, _ in q.queries]
        out.append(ev.StorageQueried(now, op, (("stranger", 1),)))
        if rids:
            out.append(ev.StorageQueried(now, op, ((rids[0], -1),)))
            out.append(ev.StorageQueried(now, op, ((rids[0], 1), (rids[0], 2))))
    for op, c in w.loads.items():
        out.append(ev.LoadDone(now, op, (len(c.device_slots),)))  # past the batch's last page
    for op, c in w.backups.items():
        out.append(ev.BackupDone(now, op, (len(c.host_slots),)))
    for op in w.stores:
        out.append(ev.StoreDone(now, op, (-1,)))
    for op in w.prefetches:
        out.append(ev.PrefetchProgress(now, op, -1))
    for tid in w.transfers:
        out.append(ev.KVArrived(now, "stranger", tid))
    for rid in w.running:
        n = len(w.tokens[rid])
        # One token more completes a page (n odd) or not (n even): either way the wrong number
        # of keys is refused, and so are negative tokens.
        wrong = () if n % 2 else (1,)
        out.append(ev.Decoded(now, rid, 1, wrong))
        out.append(ev.Decoded(now, rid, -1))
    for rid, r in core.requests.items():
        if rid not in w.running and not r.state.terminal:
            out.append(ev.Decoded(now, rid, 0))  # not running: out of order
            out.append(ev.Finished(now, rid))
            out.append(ev.ForgetRequested(now, rid))  # not ended
    return out


def valid_step(w: World, data: st.DataObject, history: list[ev.Event], n: int) -> None:
    """One valid move of the world, recording the events it fed."""
    feed = w.feed

    def recording(event: ev.Event) -> list:
        history.append(event)
        return feed(event)

    w.feed = recording  # type: ignore[method-assign]
    try:
        moves: list[Callable[[], None]] = [w.tick]
        if n < 6:
            moves.append(
                lambda: w.arrive(f"r{n}", prompt(data.draw(st.integers(0, 3)), data.draw(st.integers(3, 13))))
            )
        for op in sorted(w.queries):
            moves.append(lambda op=op: w.answer_query(op))
        for op in sorted(w.prefetches):
            moves.append(
                lambda op=op: w.prefetch_done(op, data.draw(st.integers(0, len(w.prefetches[op].keys))))
            )
        for op in sorted(w.loads):
            moves.append(
                lambda op=op: w.load_done(
                    op,
                    bad_pages=tuple(
                        data.draw(st.sets(st.integers(0, len(w.loads[op].device_slots) - 1), max_size=2))
                    ),
                )
            )
        for tid in sorted(w.transfers):
            moves += [lambda tid=tid: w.kv_arrive(tid), lambda tid=tid: w.kv_fail(tid)]
        for op in sorted(w.backups):
            moves.append(
                lambda op=op: w.backup_done(
                    op,
                    tuple(data.draw(st.sets(st.integers(0, len(w.backups[op].host_slots) - 1), max_size=2))),
                )
            )
        for op in sorted(w.stores):
            moves.append(
                lambda op=op: w.store_done(
                    op, tuple(data.draw(st.sets(st.integers(0, len(w.stores[op].keys) - 1), max_size=2)))
                )
            )
        for timer in sorted(w.timers):
            moves.append(lambda timer=timer: w.fire_timer(timer))
        for rid in list(w.running):
            moves += [
                lambda rid=rid: w.decode(rid, data.draw(st.integers(1, 3))),
                lambda rid=rid: w.finish(rid),
            ]
        # Asked once: a request still referred to by I/O in flight stays until that I/O ends,
        # and asking again is refused (`bad_events` feeds that one).
        asked = {e.req for e in history if isinstance(e, ev.ForgetRequested)}
        for rid in list(w.outcomes):
            if rid in w.core.requests and rid not in asked:
                moves.append(lambda rid=rid: w.feed(ev.ForgetRequested(w.now, rid)))
        data.draw(st.sampled_from(moves), label="move")()
    finally:
        w.feed = feed  # type: ignore[method-assign]


@pytest.mark.slow
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data(), policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]))
def test_every_refused_event_changes_nothing(data: st.DataObject, policy: str) -> None:
    w = World(decode_config(page_size=PAGE, l1_pages=40, l2_pages=40, prefetch_policy=policy))
    history: list[ev.Event] = []
    for n in range(40):
        valid_step(w, data, history, n)
        w.core.check()
        candidates = bad_events(w, history)
        for event in data.draw(
            st.lists(st.sampled_from(candidates), max_size=3, unique_by=repr), label="bad"
        ):
            refused(w.core, event)
    w.settle()
    w.core.check()


def test_a_refused_decode_step_can_be_fed_again_correctly() -> None:
    """With 2-token pages, `Decoded(a, 1, ())` that completes a page is refused (it needs the
    page's key); the correct retry then counts the token once."""
    w = World(decode_config(page_size=PAGE, storage=False))
    w.arrive("a", prompt(1, 5))
    w.tick()
    for tid in list(w.transfers):
        w.kv_arrive(tid)
    assert "a" in w.running
    text = refused(w.core, ev.Decoded(w.now, "a", 1, ()))
    assert "6 tokens need 3 page keys" in text
    w.decode("a", 1)  # the correct event: one token, one new key
    w.finish("a")
    w.settle()
    assert w.outcomes["a"] == ("finished", "")


def test_a_duplicate_storage_answer_is_refused() -> None:
    w = World(decode_config(page_size=PAGE))
    op = w.arrive_from_l3("a", prompt(2, 12))
    assert "answered already" in refused(w.core, ev.StorageQueried(w.now, op, (("a", 0),)))
    w.settle()
    assert w.accounts["a"].l3 == 12  # the first answer stands


def test_a_malformed_agreement_leaves_it_open_for_the_correct_answer() -> None:
    w = World(decode_config(page_size=PAGE, tp_size=2))
    toks = prompt(3, 12)
    w.l3.update((k, k) for k in w.keys_of(toks))
    w.arrive("a", toks)
    w.tick()
    (agree,) = w.agrees
    refused(w.core, ev.Agreed(w.now, agree.agreement, (("not a key", 1),)))
    refused(w.core, ev.Agreed(w.now, agree.agreement, tuple((k, "x") for k, _ in agree.values)))
    w.feed(ev.Agreed(w.now, agree.agreement, agree.values))  # the correct answer is taken
