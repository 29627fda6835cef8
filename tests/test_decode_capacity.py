"""What a decode node says it can hold at once (`DecodeConfig.max_running_requests`, which the
front door admits by, and `max_prompt_tokens`, its context cap) against what its core actually
admits: that many one-page requests are all admitted at once, and with no `max_running` one more
waits for L1."""

from __future__ import annotations

from builders import decode_config, prompt
from helpers import cmds
from hypothesis import given
from hypothesis import strategies as st
from kvworld import World

from hicache.core import commands as cmd

PAGE = 4


@given(
    l1=st.integers(1, 48),
    reserve=st.integers(0, 3 * PAGE),
    max_running=st.integers(0, 12),
)
def test_the_capacity_a_node_states_is_what_its_core_admits(l1: int, reserve: int, max_running: int) -> None:
    cfg = decode_config(
        l1_pages=l1,
        l2_pages=0,
        storage=False,
        page_size=PAGE,
        decode_reserve_tokens=reserve,
        max_running=max_running,
    )
    n = cfg.max_running_requests
    assert n >= 1
    assert cfg.max_prompt_tokens == max(0, l1 - cfg.decode_reserve_pages) * PAGE
    if 1 + cfg.decode_reserve_pages > l1:
        return  # not even one request fits: the node refuses every prompt (its limit is 0 tokens)
    w = World(cfg)
    for i in range(n + 1):
        w.arrive(f"r{i}", prompt(i, PAGE))
    w.tick()
    admitted = {c.req for c in cmds(w, cmd.RequestKV)}
    assert {f"r{i}" for i in range(n)} <= admitted  # every request it says it holds is admitted
    if not max_running or max_running >= l1 // (1 + cfg.decode_reserve_pages):
        assert f"r{n}" not in admitted  # L1 is the bound: one more waits
