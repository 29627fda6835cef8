"""Each promise policy's decision as the decode core makes it, on both sides of the break-even:
what the first `RequestKV` asks prefill for once the L3 hit is known.

`eager` promises the L3 span at once whatever storage's speed; `confirmed` only once the pages
are in L2; `adaptive` when the restore fits within the time the remaining prompt's transfer
takes to land — after prefill, or streamed during it (solved by hand below, from the config's
fields) — else it asks for everything.
"""

from __future__ import annotations

import pytest
from builders import PAGE, decode_config, prompt
from kvworld import World

from hicache.core import commands as cmd
from hicache.core.config import DecodeConfig

PAGES = 10  # full pages of the prompt that L3 holds
TOKENS = PAGES * PAGE + 2
ESTIMATES = dict(
    kv_bytes_per_token=1000.0,
    network_bandwidth=1e9,
    network_latency=1e-3,
    prefill_tokens_per_s=1e5,
    prefill_attention_seconds=1e-8,
    l3_latency=2e-4,
    host_to_device_bandwidth=1e12,
)


def break_even(groups: int = 0) -> float:
    """The L3 bandwidth at which restoring the 10 pages takes as long as the whole prompt's
    transfer takes to land (nothing is on L1 or L2): after prefill, or streamed during it in
    `groups` layer groups."""
    e = ESTIMATES
    attended = TOKENS * (TOKENS - 1) / 2
    prefill = TOKENS / e["prefill_tokens_per_s"] + e["prefill_attention_seconds"] * attended
    wire = TOKENS * e["kv_bytes_per_token"] / e["network_bandwidth"]
    landed = max(prefill / groups + wire, prefill + wire / groups) if groups else prefill + wire
    window = e["network_latency"] + landed
    nbytes = PAGES * PAGE * e["kv_bytes_per_token"]
    return nbytes / (window - e["l3_latency"] - nbytes / e["host_to_device_bandwidth"])


def config(promise: str, factor: float, groups: int = 0) -> DecodeConfig:
    return decode_config(
        promise=promise, l3_bandwidth=break_even(groups) * factor, transfer_groups=groups, **ESTIMATES
    )


def after_l3_known(w: World) -> tuple[list[cmd.RequestKV], list[cmd.Prefetch]]:
    """Let a request whose prompt L3 holds arrive; the commands once its L3 hit is known."""
    tokens = prompt(1, TOKENS)
    w.l3.update((k, k) for k in w.keys_of(tokens))
    w.arrive("r", tokens)
    w.tick()
    (op,) = w.queries
    mark = len(w.log)
    w.answer_query(op)
    w.tick()
    out = w.log[mark:]
    return [c for c in out if isinstance(c, cmd.RequestKV)], [c for c in out if isinstance(c, cmd.Prefetch)]


@pytest.mark.parametrize("factor", [1.01, 0.99])
def test_eager_promises_l3_at_once_on_both_sides(factor: float) -> None:
    kvs, prefetches = after_l3_known(World(config("eager", factor)))
    assert [(k.start, k.end) for k in kvs] == [(PAGES * PAGE, TOKENS)]
    assert len(prefetches) == 1 and len(prefetches[0].keys) == PAGES


@pytest.mark.parametrize("factor", [1.01, 0.99])
def test_confirmed_promises_l3_only_once_it_is_in_l2_on_both_sides(factor: float) -> None:
    w = World(config("confirmed", factor))
    kvs, (prefetch,) = after_l3_known(w)
    assert kvs == []
    mark = len(w.log)
    w.prefetch_done(prefetch.op)
    w.tick()
    kvs = [c for c in w.log[mark:] if isinstance(c, cmd.RequestKV)]
    assert [(k.start, k.end) for k in kvs] == [(PAGES * PAGE, TOKENS)]


def test_adaptive_promises_l3_just_above_its_break_even() -> None:
    kvs, prefetches = after_l3_known(World(config("adaptive", 1.01)))
    assert [(k.start, k.end) for k in kvs] == [(PAGES * PAGE, TOKENS)]
    assert len(prefetches) == 1


def test_adaptive_asks_prefill_for_everything_just_below_it() -> None:
    kvs, prefetches = after_l3_known(World(config("adaptive", 0.99)))
    assert [(k.start, k.end) for k in kvs] == [(0, TOKENS)]
    assert prefetches == []


def test_without_prefill_time_the_break_even_moves_up() -> None:
    """Prefill's compute is part of the window: with an (almost) free prefill the same storage
    no longer pays, which is what the rule before the overlap got wrong."""
    w = World(
        decode_config(
            promise="adaptive",
            l3_bandwidth=break_even() * 1.01,
            **{**ESTIMATES, "prefill_tokens_per_s": 1e18, "prefill_attention_seconds": 0.0},
        )
    )
    kvs, _ = after_l3_known(w)
    assert [(k.start, k.end) for k in kvs] == [(0, TOKENS)]


@pytest.mark.parametrize("groups", [1, 4, 80])
@pytest.mark.parametrize(("factor", "promised"), [(1.01, True), (0.99, False)])
def test_adaptive_with_streamed_transfers_weighs_when_the_stream_lands(
    groups: int, factor: float, promised: bool
) -> None:
    """Streamed in layer groups during prefill, the transfer hides behind prefill: the window is
    max(P/G + T, P + T/G), shorter than P + T, so the same storage pays later."""
    kvs, _ = after_l3_known(World(config("adaptive", factor, groups)))
    want = (PAGES * PAGE, TOKENS) if promised else (0, TOKENS)
    assert [(k.start, k.end) for k in kvs] == [want]
    assert break_even(groups) > break_even() or groups == 1


def test_a_rule_that_ignores_streaming_would_restore_too_early() -> None:
    """Between the streamed break-even and the sent-after-prefill one, restoring does not pay
    when transfers stream, though it would if they followed prefill."""
    between = (break_even(80) + break_even()) / 2
    assert break_even() < between < break_even(80)
    for groups, promised in ((0, True), (80, False)):
        cfg = decode_config(promise="adaptive", l3_bandwidth=between, transfer_groups=groups, **ESTIMATES)
        kvs, _ = after_l3_known(World(cfg))
        assert [(k.start, k.end) for k in kvs] == [(PAGES * PAGE, TOKENS) if promised else (0, TOKENS)]
