"""The core's contract with drivers: documented vocabulary, operation lifecycles as tables, one
stop rule, and a run that the log of its events alone replays (`hicache/core/events.py`)."""

from __future__ import annotations

import itertools
import re
import typing
from pathlib import Path

import pytest
from builders import decode_config, prompt
from kvworld import World

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import PrefetchPolicy
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import TransitionError
from hicache.core.lifecycles import LOAD, PREFETCH, TRANSFER, Step
from hicache.core.prefetch_rule import prefetch_should_stop


@pytest.mark.parametrize("kind", [*typing.get_args(ev.Event), *typing.get_args(cmd.Command)])
def test_every_event_and_command_states_its_contract(kind: type) -> None:
    doc = kind.__dict__.get("__doc__") or ""
    assert len(doc.split()) >= 5, f"{kind.__name__} has no docstring stating its contract"


def test_lifecycle_tables_are_closed() -> None:
    """Every phase a table names has a row, and only event classes or the core's steps move it."""
    for table in (PREFETCH, TRANSFER, LOAD):
        for phase, moves in table.items():
            for trigger, nxt in moves.items():
                assert nxt in table, (phase, trigger, nxt)
                assert isinstance(trigger, type) or type(trigger).__name__ == "Step", trigger


def l3_world(policy: str = "wait_complete") -> tuple[World, cmd.Prefetch]:
    w = World(decode_config(prefetch_policy=policy))
    w.arrive_from_l3("a", prompt(1, 26))
    w.tick()
    (pf,) = w.prefetches.values()
    return w, pf


def test_a_second_prefetch_done_is_refused_naming_the_prefetch_and_its_phase() -> None:
    w, pf = l3_world()
    w.core.handle(ev.PrefetchDone(w.now, pf.op, 2))
    with pytest.raises(TransitionError, match=rf"prefetch #{pf.op} of request 'a' in state open_done"):
        w.core.handle(ev.PrefetchDone(w.now, pf.op, 2))


def test_a_transfer_abandoned_twice_is_refused_naming_the_transfer() -> None:
    w, _ = l3_world()
    (tid,) = w.transfers
    w.feed(ev.KVAbandoned(w.now, "a", tid))
    with pytest.raises(TransitionError, match=rf"transfer #{tid} of request 'a' in state abandoned"):
        w.core.handle(ev.KVAbandoned(w.now, "a", tid))


@pytest.mark.parametrize(
    ("policy", "timed_out", "schedulable", "stop"),
    [
        (PrefetchPolicy.WAIT_COMPLETE, True, True, False),
        (PrefetchPolicy.TIMEOUT, False, True, False),
        (PrefetchPolicy.TIMEOUT, True, False, True),
        (PrefetchPolicy.BEST_EFFORT, False, False, False),
        (PrefetchPolicy.BEST_EFFORT, False, True, True),
    ],
)
def test_the_stop_rule_of_each_prefetch_policy(
    policy: PrefetchPolicy, timed_out: bool, schedulable: bool, stop: bool
) -> None:
    kw = dict(planned=4, timed_out=timed_out, schedulable=schedulable)
    assert prefetch_should_stop(policy, progress=1, ended=False, **kw) is stop
    assert prefetch_should_stop(policy, progress=4, ended=False, **kw) is True  # all in
    assert prefetch_should_stop(policy, progress=1, ended=True, **kw) is True  # it ended


def test_the_log_of_events_alone_replays_a_run() -> None:
    """Evictions and forgetting are events too: replaying the recorded events into a fresh core
    gives the same commands, in the same order, and the same final state."""
    w = World(decode_config(l1_pages=24, l2_pages=16, write_policy="write_back"))
    log: list[ev.Event] = []
    feed = w.feed

    def recording(event: ev.Event) -> list[cmd.Command]:
        log.append(event)
        return feed(event)

    w.feed = recording  # type: ignore[method-assign]
    history = prompt(7, 10)
    for turn in range(4):
        rid = f"t{turn}"
        w.arrive(rid, history + prompt(20 + turn, 5))
        w.settle()
        history = w.tokens[rid]
        w.feed(ev.ForgetRequested(w.now, rid))
        w.feed(ev.EvictRequested(w.now, 3, 1))
    w.settle()
    replay = DecodeNodeCore(w.core.cfg)
    commands = [c for e in log for c in replay.handle(e)]
    assert commands == w.log
    assert replay.snapshot() == w.core.snapshot()


def test_every_event_is_either_shared_by_all_ranks_or_rank_local() -> None:
    events = set(typing.get_args(ev.Event))
    assert set(ev.SHARED) | set(ev.RANK_LOCAL) == events
    assert not set(ev.SHARED) & set(ev.RANK_LOCAL)


def test_the_docs_transfer_lifecycle_table_is_the_code() -> None:
    """docs/architecture.md shows `TRANSFER` as a table (phase by trigger); it must say what
    the code does, cell by cell (a cell's first `name` is the next phase; — : refused)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    header = "| phase | `TimerFired` | `KVArrived` | `KVFailed` | `KVAbandoned` | `orphan` |"
    assert header in doc
    triggers = [ev.TimerFired, ev.KVArrived, ev.KVFailed, ev.KVAbandoned, Step.ORPHAN]
    lines = doc[doc.index(header) :].splitlines()[2:]
    rows = {}
    for line in itertools.takewhile(lambda x: x.strip().startswith("|"), lines):
        phase, *cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[phase.strip("`")] = [re.match(r"`(\w+)`", c).group(1) if c != "—" else None for c in cells]
    want = {
        phase.value: [nxt.value if (nxt := moves.get(t)) else None for t in triggers]
        for phase, moves in TRANSFER.items()
        if moves
    }
    assert rows == want
