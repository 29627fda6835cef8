"""Retries of a failed prefill transfer back off, with a jitter the core derives from its events.

A prefill node that restarts fails every transfer for a while; retries sent at once would all
fail inside that window. With `transfer_backoff_s > 0` the core waits before each retry
(`hicache/core/backoff.py`): the retry is a transfer in phase `waiting`, announced by a
`SetTimer` of kind `transfer_retry` and sent when it fires, or dropped unsent if its request
ends first. These tests pin the delay function, drive the core by hand through each path, run
every TP rank in lockstep, fail transfers at random under hypothesis, and run the simulator.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import hypothesis.strategies as st
import pytest
from builders import decode_config, examples, prompt
from hypothesis import event, given, settings
from kvworld import World
from lockstep import Lockstep

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.backoff import jitter, retry_delay
from hicache.core.commands import TimerKind
from hicache.core.config import DecodeConfig
from hicache.core.errors import CoreError, TransitionError
from hicache.core.lifecycles import TransferPhase
from hicache.core.states import State

RETRY = TimerKind.TRANSFER_RETRY


def since(w: World, mark: int) -> list[cmd.Command]:
    return w.log[mark:]


def fail(w: World, tid: int, reason: str = "prefill restarting") -> list[cmd.Command]:
    """Fail transfer `tid` (its slots left with garbage); the commands the core answered with."""
    mark = len(w.log)
    w.kv_fail(tid, reason)
    return since(w, mark)


def fire(w: World, timer: int) -> list[cmd.Command]:
    mark = len(w.log)
    w.fire_timer(timer)
    return since(w, mark)


def one_transfer(**kw: Any) -> tuple[World, cmd.RequestKV]:
    """Request "a" (10 tokens, no cache: all from prefill) and its one transfer, in flight."""
    w = World(decode_config(storage=False, **kw))
    w.arrive("a", prompt(1, 10))
    w.tick()
    (c,) = w.transfers.values()
    return w, c


def two_transfers(**kw: Any) -> tuple[World, cmd.RequestKV, cmd.RequestKV]:
    """Request "a" with two transfers in flight: its tail (promised at once) and the fallback for
    the 5 L3 pages its prefetch did not bring; a one-page load-back of the page it did bring."""
    w = World(decode_config(prefetch_policy="wait_complete", **kw))
    w.arrive_from_l3("a", prompt(1, 26))
    w.tick()
    (op,) = w.prefetches
    w.prefetch_done(op, 1)
    w.tick()
    tail, fallback = (w.transfers[t] for t in sorted(w.transfers))
    assert (tail.start, tail.end, fallback.start, fallback.end, fallback.fallback) == (24, 26, 4, 24, True)
    return w, tail, fallback


def waiting(w: World) -> list[int]:
    """The core's retries that are backing off (the test of the core may look inside it)."""
    return [t.tid for t in w.core._transfers.values() if t.phase is TransferPhase.WAITING]


def owner(w: World, slot: int) -> object:
    return w.core.device_pool.owner_of(slot)


# ============================================================================ the delay


def test_each_retry_waits_twice_as_long_as_the_last_up_to_the_cap() -> None:
    for req in ("a", "b", "conversation-7/turn-3"):
        steps = [retry_delay(0.1, 1.0, req, k) / jitter(req, k) for k in range(1, 9)]
        assert steps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0])


@settings(max_examples=examples(300), deadline=None)
@given(
    base=st.floats(1e-6, 100.0),
    cap=st.floats(1e-6, 1000.0),
    req=st.text(max_size=20),
    attempt=st.integers(1, 2000),
)
def test_the_delay_is_the_capped_step_times_a_jitter_in_half_to_one(
    base: float, cap: float, req: str, attempt: int
) -> None:
    j = jitter(req, attempt)
    assert 0.5 <= j < 1.0
    assert jitter(req, attempt) == j  # a function of its inputs only
    step = min(cap, base * 2.0 ** min(attempt - 1, 1000))
    delay = retry_delay(base, cap, req, attempt)
    assert delay == retry_delay(base, cap, req, attempt)
    assert 0.5 * step * (1 - 1e-12) <= delay <= step
    assert delay == pytest.approx(step * j, rel=1e-12)


def test_the_jitter_spreads_requests_and_attempts_apart() -> None:
    """Many requests whose transfers failed together retry at different times, spread over the
    whole [0.5, 1) band; one request's successive retries are jittered independently."""
    by_req = [jitter(f"req-{i}", 1) for i in range(2000)]
    assert len(set(by_req)) == len(by_req)
    assert min(by_req) < 0.51 and max(by_req) > 0.99
    assert statistics.mean(by_req) == pytest.approx(0.75, abs=0.02)
    assert [sum(0.5 + i / 10 <= j < 0.5 + (i + 1) / 10 for j in by_req) for i in range(5)] == pytest.approx(
        [400] * 5, abs=80
    )
    by_attempt = [jitter("a", k) for k in range(1, 200)]
    assert len(set(by_attempt)) == len(by_attempt)


def test_no_base_or_no_cap_means_retry_at_once() -> None:
    assert retry_delay(0.0, 5.0, "a", 1) == 0.0
    assert retry_delay(0.0, 5.0, "a", 7) == 0.0
    assert retry_delay(1.0, 0.0, "a", 3) == 0.0
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(1.0, 5.0, "a", 0)


def test_a_huge_retry_number_stays_at_the_cap() -> None:
    assert 2.5 <= retry_delay(1e-300, 5.0, "a", 100_000) <= 5.0
    assert 2.5 <= retry_delay(1.0, 5.0, "a", 10**9) <= 5.0


@pytest.mark.parametrize("field", ["transfer_backoff_s", "transfer_backoff_max_s"])
@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, True, "1"])
def test_the_config_refuses_a_bad_backoff_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        DecodeConfig(l1_pages=8, l2_pages=0, **{field: value})


def test_by_default_there_is_no_backoff() -> None:
    cfg = DecodeConfig(l1_pages=8, l2_pages=0)
    assert (cfg.transfer_backoff_s, cfg.transfer_backoff_max_s) == (0.0, 5.0)


# ============================================================================ the core, by hand


def test_a_failure_with_backoff_sets_a_timer_and_its_firing_sends_the_retry() -> None:
    w, c = one_transfer(transfer_backoff_s=0.5)
    now = w.now
    out = fail(w, c.transfer)
    (timer,) = out  # a timer, not a RequestKV
    assert isinstance(timer, cmd.SetTimer) and timer.kind is RETRY
    assert timer.at == pytest.approx(now + 0.5 * jitter("a", 1))
    assert timer.op not in w.ids  # the id the retry will carry, not handed out yet
    assert w.transfers == {} and waiting(w) == [timer.op]
    r = w.core.requests["a"]
    assert r.state is State.RESTORING and r.transfers == {timer.op}
    assert all(owner(w, s) == ("req", "a") for s in c.dst_slots)  # still the request's
    assert w.core.stats.transfer_retries == 1
    w.core.check()
    for _ in range(3):  # ticks do not send it, and the request is not ready without it
        assert not [x for x in w.tick() if isinstance(x, cmd.RequestKV | cmd.StartDecode)]
    out = fire(w, timer.timer)
    assert out == [cmd.RequestKV(timer.op, "a", c.start, c.end, c.dst_slots, c.prompt_len, c.fallback, 1)]
    assert w.now == pytest.approx(timer.at) and waiting(w) == []
    w.core.check()
    w.kv_arrive(timer.op)
    assert w.started == {"a": 1}  # with prefill's KV, not the failed transfer's garbage
    w.settle()
    assert w.outcomes["a"] == ("finished", "")
    assert w.core.stats.transfer_retries == 1


def test_later_retries_double_the_delay_up_to_the_cap_then_the_request_fails() -> None:
    w, c = one_transfer(transfer_retries=3, transfer_backoff_s=1.0, transfer_backoff_max_s=1.5)
    tid = c.transfer
    for k, step in enumerate([1.0, 1.5, 1.5], start=1):
        now = w.now
        (timer,) = fail(w, tid)
        assert isinstance(timer, cmd.SetTimer) and timer.kind is RETRY
        assert timer.at - now == pytest.approx(step * jitter("a", k))
        (retry,) = fire(w, timer.timer)
        assert isinstance(retry, cmd.RequestKV) and retry.attempt == k and retry.dst_slots == c.dst_slots
        tid = retry.transfer
    (respond,) = fail(w, tid, "still restarting")
    assert respond == cmd.Respond(
        "a", cmd.Outcome.FAILED, "prefill transfer failed after 4 attempts: still restarting", respond.account
    )
    assert w.core.stats.transfer_retries == 3
    w.core.check()
    assert w.core.idle and w.core.audit()["l1_leaked"] == 0


def test_an_abort_during_the_backoff_drops_the_retry_and_frees_its_slots() -> None:
    w, c = one_transfer(transfer_backoff_s=0.5)
    (timer,) = fail(w, c.transfer)
    mark = len(w.log)
    w.abort("a")
    assert [type(x) for x in since(w, mark)] == [cmd.Respond]  # nothing sent
    assert waiting(w) == [] and w.core._transfers == {}
    assert all(owner(w, s) is None for s in c.dst_slots)  # nothing can write them: freed at once
    w.core.check()
    assert w.core.idle
    assert fire(w, timer.timer) == []  # the late timer is absorbed
    with pytest.raises(CoreError, match=f"no timer #{timer.timer}"):
        w.core.handle(ev.TimerFired(w.now, timer.timer))  # a timer fires once
    w.feed(ev.ForgetRequested(w.now, "a"))
    assert "a" not in w.core.requests
    audit = w.core.audit()
    assert audit["l1_leaked"] == audit["live"] == audit["reserved"] == audit["locks"] == 0, audit


def test_a_forgotten_request_s_late_retry_timer_is_absorbed() -> None:
    w, c = one_transfer(transfer_backoff_s=0.5)
    (timer,) = fail(w, c.transfer)
    w.abort("a")
    w.feed(ev.ForgetRequested(w.now, "a"))
    assert "a" not in w.core.requests  # nothing refers to it: forgotten before its timer fires
    assert fire(w, timer.timer) == []
    w.core.check()


def test_another_transfer_failing_for_good_drops_the_waiting_retry() -> None:
    w, tail, fallback = two_transfers(transfer_retries=1, transfer_backoff_s=0.5)
    (t_tail,) = fail(w, tail.transfer)
    (t_fb,) = fail(w, fallback.transfer)
    assert {t_tail.kind, t_fb.kind} == {RETRY}
    assert t_tail.at == t_fb.at  # jitter keys on (request, attempt): one request's retries wait alike
    (retry,) = fire(w, t_fb.timer)
    assert (retry.start, retry.end, retry.attempt) == (4, 24, 1)
    assert waiting(w) == [t_tail.op]
    out = fail(w, retry.transfer)  # the fallback's last attempt: "a" fails
    assert [type(x) for x in out] == [cmd.Respond] and out[0].outcome == "failed"
    assert waiting(w) == []
    assert owner(w, tail.dst_slots[0]) is None  # the dropped retry claims nothing
    w.core.check()
    assert fire(w, t_tail.timer) == []  # absorbed: no RequestKV for an ended request
    (load,) = w.loads  # the load-back of the page the prefetch brought still claims its slot
    w.load_done(load)
    w.core.check()
    assert w.core.idle and w.core.audit()["l1_leaked"] == 0
    assert w.core.stats.transfer_retries == 2


def test_an_abandoned_transfer_ends_the_request_and_drops_the_waiting_retry() -> None:
    w, tail, fallback = two_transfers(transfer_backoff_s=0.5)
    (timer,) = fail(w, tail.transfer)
    w.feed(ev.KVAbandoned(w.now, "a", fallback.transfer, "no fence"))
    assert w.outcomes["a"][0] == "failed" and waiting(w) == []
    assert owner(w, tail.dst_slots[0]) is None  # never sent: free at once
    assert {owner(w, s) for s in fallback.dst_slots} == {("xfer", fallback.transfer)}  # may still write
    assert fire(w, timer.timer) == []
    w.kv_fail(fallback.transfer)  # its real end: its slots come back
    (load,) = w.loads
    w.load_done(load)
    w.core.check()
    assert w.core.idle and w.core.audit()["l1_leaked"] == 0


@pytest.mark.parametrize("event", [ev.KVArrived, ev.KVFailed, ev.KVAbandoned])
def test_a_completion_of_a_retry_not_yet_sent_is_refused_naming_its_phase(event: type) -> None:
    w, c = one_transfer(transfer_backoff_s=0.5)
    (timer,) = fail(w, c.transfer)
    before = w.core.snapshot()
    args = (w.now, "a", timer.op) if event is ev.KVArrived else (w.now, "a", timer.op, "what?")
    with pytest.raises(
        TransitionError,
        match=rf"transfer #{timer.op} of request 'a' in state waiting cannot take {event.__name__}",
    ):
        w.core.handle(event(*args))
    assert w.core.snapshot() == before


def test_a_prefetch_timer_and_a_retry_timer_each_do_their_own_job() -> None:
    """Both kinds of timer in one node: the prefetch deadline stops the prefetch (its pages are
    re-requested), the retry's sends the retry."""
    w = World(decode_config(prefetch_policy="timeout", transfer_backoff_s=0.5))
    w.arrive_from_l3("a", prompt(1, 26))
    w.tick()
    (deadline,) = [x for x in w.log if isinstance(x, cmd.SetTimer)]
    assert deadline.kind is TimerKind.PREFETCH_TIMEOUT
    (tail,) = w.transfers
    (retry_timer,) = fail(w, tail)
    assert retry_timer.kind is RETRY
    assert fire(w, deadline.timer) == []
    out = w.tick()  # timed out with no page in: cancelled, and the whole L3 range asked of prefill
    assert [type(x) for x in out] == [cmd.CancelPrefetch, cmd.RequestKV]
    assert out[1].fallback and out[1].attempt == 0
    (retry,) = fire(w, retry_timer.timer)
    assert (retry.transfer, retry.start, retry.end, retry.attempt) == (retry_timer.op, 24, 26, 1)
    w.core.check()
    w.settle()
    assert w.outcomes["a"] == ("finished", "")


def test_requests_failing_together_retry_at_different_times() -> None:
    """Twenty requests whose transfers fail at the same instant (a prefill restarts) get
    twenty different retry times across the jitter band."""
    w = World(decode_config(storage=False, transfer_backoff_s=1.0))
    for i in range(20):
        w.arrive(f"r{i}", prompt(i, 5))
    w.tick()
    now = w.now
    timers = [t for tid in sorted(w.transfers) for t in fail(w, tid)]
    assert all(isinstance(t, cmd.SetTimer) and t.kind is RETRY for t in timers)
    ats = sorted(t.at - now for t in timers)
    assert len(set(ats)) == 20 and ats[0] >= 0.5 and ats[-1] < 1.0 and ats[-1] - ats[0] > 0.3
    w.settle()
    assert set(w.outcomes.values()) == {("finished", "")}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"transfer_backoff_s": 0.0, "transfer_backoff_max_s": 9.0},
        {"transfer_backoff_s": 2.0, "transfer_backoff_max_s": 0.0},
    ],
)
def test_without_backoff_the_retry_goes_out_at_once_as_before(kw: dict[str, float]) -> None:
    w, c = one_transfer(**kw)
    out = fail(w, c.transfer)
    assert out == [
        cmd.RequestKV(c.transfer + 1, "a", c.start, c.end, c.dst_slots, c.prompt_len, c.fallback, 1)
    ]
    assert not [x for x in w.log if isinstance(x, cmd.SetTimer)] and waiting(w) == []


@pytest.mark.slow
def test_a_zero_backoff_run_is_the_default_run_command_for_command() -> None:
    """The same events with backoff 0 (explicitly) and by default give the same commands: the
    simulator's results do not change unless a scenario sets a backoff."""

    def run(**kw: Any) -> list[cmd.Command]:
        w, tail, fallback = two_transfers(transfer_retries=2, **kw)
        w.kv_fail(tail.transfer)
        w.kv_fail(fallback.transfer)
        for tid in sorted(w.transfers):
            w.kv_fail(tid)
        w.settle()
        return w.log

    assert run() == run(transfer_backoff_s=0.0, transfer_backoff_max_s=0.25)


# ============================================================================ TP ranks


def test_every_rank_sets_the_same_retry_timer_and_sends_the_same_retry() -> None:
    r = Lockstep(decode_config(tp_size=3, storage=False, transfer_backoff_s=0.25, transfer_retries=2))
    r.each("arrive", "a", prompt(1, 14))
    r.each("arrive", "b", prompt(2, 9))
    r.tick()
    tids = r.shared_ops("transfers")
    for tid in tids:
        r.each("kv_fail", tid)  # check_same: every rank emitted the same commands, `at` included
    timers = [x for x in r.lead.log if isinstance(x, cmd.SetTimer)]
    assert [t.kind for t in timers] == [RETRY, RETRY]
    assert {round(t.at - r.lead.now, 12) for t in timers} == {
        round(0.25 * jitter(rid, 1), 12) for rid in ("a", "b")
    }
    r.compare("after the failures")
    assert r.shared_ops("transfers") == []
    for t in timers:
        r.each("fire_timer", t.timer)
    retries = [r.lead.transfers[tid] for tid in r.shared_ops("transfers")]
    assert sorted((c.req, c.attempt) for c in retries) == [("a", 1), ("b", 1)]
    r.compare("after the retries")
    r.rest()
    assert all(w.outcomes == {"a": ("finished", ""), "b": ("finished", "")} for w in r.worlds)


# ============================================================================ at random


@settings(max_examples=examples(150), deadline=None)
@given(
    retries=st.integers(1, 3),
    base=st.sampled_from([0.001, 0.5]),
    cap=st.sampled_from([0.002, 5.0]),
    data=st.data(),
)
def test_transfers_failing_at_random_with_backoff_leave_every_request_ended_once_holding_nothing(
    retries: int, base: float, cap: float, data: st.DataObject
) -> None:
    cfg = decode_config(
        l1_pages=24,
        l2_pages=16,
        transfer_retries=retries,
        transfer_backoff_s=base,
        transfer_backoff_max_s=cap,
    )
    w = World(cfg)
    rids: list[str] = []
    retry_timers = 0

    def count(c: cmd.Command) -> None:
        nonlocal retry_timers
        if isinstance(c, cmd.SetTimer) and c.kind is RETRY:
            retry_timers += 1

    w.observe = count
    moves = [
        "arrive",
        "fail",
        "fail",
        "fail",
        "arrive_kv",
        "fire",
        "fire",
        "tick",
        "abort",
        "finish",
        "done_io",
    ]
    first = ["arrive"] * data.draw(st.integers(1, 4), label="first arrivals") + ["tick", "done_io", "tick"]
    for i in range(data.draw(st.integers(1, 60), label="steps")):
        move = first[i] if i < len(first) else data.draw(st.sampled_from(moves), label="move")
        if move == "arrive" and len(rids) < 8:
            rid = f"r{len(rids)}"
            rids.append(rid)
            shared = data.draw(st.integers(0, 2), label="shared prefix")  # some prompts share pages
            w.arrive(
                rid, prompt(shared, 8) + prompt(100 + len(rids), data.draw(st.integers(1, 20), label="n"))
            )
        elif move in ("fail", "arrive_kv") and w.transfers:
            tid = data.draw(st.sampled_from(sorted(w.transfers)), label="tid")
            (w.kv_fail if move == "fail" else w.kv_arrive)(tid)
        elif move == "fire" and w.timers:
            w.fire_timer(data.draw(st.sampled_from(sorted(w.timers)), label="timer"))
        elif move == "abort" and rids:
            w.abort(data.draw(st.sampled_from(rids), label="rid"))
        elif move == "finish" and w.running:
            w.finish(data.draw(st.sampled_from(sorted(w.running)), label="rid"))
        elif move == "done_io":
            w.complete_reads()
        else:
            w.tick()
        w.core.check()
        for tid in waiting(w):  # a retry backing off belongs to a live request, on its own slots
            assert not w.core.requests[w.core._transfers[tid].req].state.terminal
    w.settle()
    core = w.core
    core.check()
    assert set(w.outcomes) == set(rids)  # and World refuses a second answer to any of them
    for rid in rids:
        r = core.requests[rid]
        assert r.state.terminal and w.outcomes[rid][0] == r.state.value
        assert not (r.slots or r.transfers or r.lock or r.pin or r.reserve or r.prefetch_slots or r.loads)
        if r.state is State.FAILED:
            assert w.outcomes[rid][1].startswith(f"prefill transfer failed after {retries + 1} attempts")
    assert waiting(w) == [] and core.idle
    event("retries: " + ("none" if not retry_timers else "1-3" if retry_timers < 4 else "4+"))
    event(f"failed after retries: {any(o == 'failed' for o, _ in w.outcomes.values())}")
    assert core.stats.transfer_retries == retry_timers  # every retry waited its timer
    audit = core.audit()
    assert audit["l1_leaked"] == audit["l2_leaked"] == 0, audit
    assert audit["locks"] == audit["pins"] == audit["live"] == audit["reserved"] == 0, audit


# ============================================================================ the simulator


def test_the_simulator_waits_out_the_backoff_and_answers_every_request() -> None:
    """A scenario's `cache.transfer_backoff_s` reaches the core, and the simulator executes its
    retry timers like any other: every request is answered, nothing leaks."""
    from hicache.scenarios.build import build_workload
    from hicache.scenarios.scenario import parse_scenario
    from hicache.sim.cluster import Cluster
    from hicache.sim.setup import setups

    doc = {
        "workload": {"kind": "multiturn", "conversations": 6, "turns": 2, "rate": 4.0, "think_time": 1.0},
        "cache": {"l1_tokens": 60_000, "hicache_ratio": 1.0, "transfer_backoff_s": 0.05},
        "run": {"baselines": ["l1_l2_l3"]},
        "faults": {"seed": 3, "transfer": {"kind": "error", "rate": 0.3}},
    }
    scenario = parse_scenario(doc, "backoff.toml")
    items = build_workload(scenario)
    cluster = Cluster(setups(scenario)["l1_l2_l3"])
    result = cluster.run(items)
    assert sorted(r.id for r in result.records) == sorted(i.id for i in items)
    (d,) = cluster.decode
    assert d.core.cfg.transfer_backoff_s == 0.05
    assert d.core.stats.transfer_retries > 0
    assert any(r.outcome == "finished" for r in result.records)
    audit = d.core.audit()
    assert audit["l1_leaked"] == audit["l2_leaked"] == audit["live"] == 0, audit
