"""Example-based tests of the decode-node core: exact commands for the main paths, the
transition table as the single source of the documented diagram, and input validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import decode_config
from kvworld import World

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError, PolicyError, TransitionError
from hicache.core.states import TERMINAL, TRANSITIONS, State, mermaid

ROOT = Path(__file__).resolve().parent.parent


def cfg(**kw: object) -> DecodeConfig:
    return decode_config(**{"decode_reserve_tokens": 8, "prefetch_threshold_tokens": 8, **kw})


def of(kind: type, out: list) -> list:
    return [c for c in out if isinstance(c, kind)]


def test_documented_diagram_is_the_transition_table() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "```mermaid\n" + mermaid() + "\n```" in doc


def test_every_live_state_can_be_aborted_and_terminal_states_absorb_late_completions() -> None:
    for state, moves in TRANSITIONS.items():
        assert ev.AbortRequested in moves, state
        if state in TERMINAL:
            assert all(nxt is state for nxt in moves.values())
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("promise", "optimistic", PolicyError),
        ("prefetch_policy", "never", PolicyError),
        ("eviction", "random", PolicyError),
        ("retract_policy", "oldest", PolicyError),
        ("l1_pages", 0, ValueError),
        ("page_size", -4, ValueError),
        ("tp_size", 0, ValueError),
    ],
)
def test_config_names_the_bad_field(field: str, value: object, error: type) -> None:
    with pytest.raises(error, match=field):
        cfg(**{field: value})


def test_invalid_event_names_request_state_and_event() -> None:
    core = DecodeNodeCore(cfg())
    core.handle(ev.RequestArrived(0.0, "r1", 8, (11, 12)))
    with pytest.raises(TransitionError, match=r"request 'r1' in state queued cannot take Decoded"):
        core.handle(ev.Decoded(0.1, "r1", 1, ()))


def test_arrival_validation() -> None:
    core = DecodeNodeCore(cfg())
    with pytest.raises(CoreError, match="prompt_len // 4 keys"):
        core.handle(ev.RequestArrived(0.0, "r1", 9, (1,)))
    core.handle(ev.RequestArrived(0.0, "r1", 4, (1,)))
    with pytest.raises(CoreError, match="already exists"):
        core.handle(ev.RequestArrived(0.0, "r1", 4, (1,)))


def test_cold_request_is_transferred_whole_then_hits_l1_on_the_next_turn() -> None:
    w = World(cfg(storage=False))
    w.arrive("t1", list(range(10)))
    out = w.tick()
    (kv,) = of(cmd.RequestKV, out)
    assert (kv.req, kv.start, kv.end, len(kv.dst_slots)) == ("t1", 0, 10, 3)
    assert not of(cmd.QueryStorage, out)
    w.kv_arrive(kv.transfer)
    assert w.started == {"t1": 1}
    w.decode("t1", 6)  # 16 tokens: 4 full pages
    w.finish("t1")
    assert w.outcomes["t1"] == ("finished", "")
    w.arrive("t2", w.tokens["t1"] + [7, 7, 7])
    out = w.tick()
    (kv,) = of(cmd.RequestKV, out)
    assert (kv.start, kv.end) == (16, 19)  # the whole previous turn is on L1
    w.kv_arrive(kv.transfer)
    acc = w.core.requests["t2"].account
    assert (acc.l1, acc.l2, acc.l3, acc.transferred) == (16, 0, 0, 3)
    w.settle()
    w.core.check()


def test_requests_admitted_in_one_tick_share_one_storage_query_and_one_load_back() -> None:
    w = World(cfg())
    base = list(range(40))
    w.arrive("a", base)
    w.settle()
    # Push "a"'s pages out of L1 (to L2) so the next two requests restore from L2.
    w.core.tree.evict_device(10**9)
    for c in w.core.tree.drain():
        w.accept(c)
    w.arrive("b", base + [1] * 9)
    w.arrive("c", base + [2] * 9)
    out = w.tick()
    loads = of(cmd.LoadBack, out)
    queries = of(cmd.QueryStorage, out)
    assert len(loads) == 1 and set(loads[0].reqs) == {"b", "c"}
    assert len(queries) == 1 and [q[0] for q in queries[0].queries] == ["b", "c"]
    w.settle()
    for rid in ("b", "c"):
        acc = w.core.requests[rid].account
        assert acc.l2 == 40 and acc.l2 + acc.transferred == 49


def test_without_a_radix_every_prompt_is_transferred_whole_and_nothing_is_kept() -> None:
    w = World(cfg(storage=False, l2_pages=0, radix=False))
    for turn, rid in enumerate(("t1", "t2")):
        tokens = list(range(10)) if turn == 0 else w.tokens["t1"] + [7, 7, 7]
        w.arrive(rid, tokens)
        (kv,) = of(cmd.RequestKV, w.tick())
        assert (kv.start, kv.end) == (0, len(tokens))
        w.kv_arrive(kv.transfer)
        w.decode(rid, 6)
        w.finish(rid)
    assert w.core.tree.num_nodes == 0
    assert w.core.device_pool.num_free == w.core.device_pool.capacity
    with pytest.raises(ValueError, match="radix=False"):
        cfg(radix=False)  # storage and L2 make no sense without a tree


def test_forget_drops_an_ended_request_once_its_io_ends() -> None:
    w = World(cfg(storage=False))
    w.arrive("a", list(range(10)))
    (kv,) = of(cmd.RequestKV, w.tick())
    with pytest.raises(CoreError, match="has not ended"):
        w.feed(ev.ForgetRequested(w.now, "a"))
    w.abort("a")  # the transfer is still writing into the request's slots
    w.feed(ev.ForgetRequested(w.now, "a"))
    assert "a" in w.core.requests  # kept, holding nothing, until the transfer ends
    w.kv_arrive(kv.transfer)
    assert "a" not in w.core.requests
    with pytest.raises(CoreError, match="unknown request"):
        w.feed(ev.ForgetRequested(w.now, "a"))
    w.core.check()
