"""The demo command and the generated workload it replays."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cli import main
from hicache.demo import replay
from hicache.scenarios.multiturn import MultiTurnChat


def test_workload_is_deterministic_and_multi_turn() -> None:
    w = MultiTurnChat(conversations=5, turns=3, system_prompt=100, seed=7)
    a, b = w.generate(), w.generate()
    assert [(r.conversation, r.turn, r.arrival) for r in a] == [
        (r.conversation, r.turn, r.arrival) for r in b
    ]
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    by_conv: dict[int, list] = {}
    for r in a:
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = np.concatenate([prev.prompt, prev.output])
            assert np.array_equal(nxt.prompt[: len(history)], history)
    firsts = [t[0].prompt[:100] for t in by_conv.values()]
    assert all(np.array_equal(firsts[0], f) for f in firsts)
    assert (
        MultiTurnChat(conversations=5, turns=3, seed=8).generate()[0].prompt.tolist() != a[0].prompt.tolist()
    )


@pytest.mark.parametrize("field", ["conversations", "turns"])
def test_workload_rejects_bad_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MultiTurnChat(**{field: 0})


def test_replay_counts_tiers() -> None:
    reqs = MultiTurnChat(conversations=20, turns=4, system_prompt=256, seed=1).generate()
    big = replay(reqs, label="big", page_size=16, l1_pages=100_000, l2_pages=0)
    # With room for everything, a prompt hits exactly its longest prefix of pages that an
    # earlier request's prompt + output held (brute force over token tuples).
    held: set[tuple[int, ...]] = set()
    expect = 0
    for r in reqs:
        pages = len(r.prompt) // 16
        hit = 0
        while hit < pages and tuple(r.prompt[: (hit + 1) * 16].tolist()) in held:
            hit += 1
        expect += hit * 16
        seq = np.concatenate([r.prompt, r.output]).tolist()
        held.update(tuple(seq[: (k + 1) * 16]) for k in range(len(seq) // 16))
    assert big.l1_tokens == expect > 0
    assert big.l2_tokens == 0 and big.rejected == 0
    small = replay(reqs, label="small", page_size=16, l1_pages=400, l2_pages=0)
    tiered = replay(reqs, label="tiered", page_size=16, l1_pages=400, l2_pages=4000)
    assert small.l1_tokens < big.l1_tokens
    assert tiered.l2_tokens > 0
    assert small.l1_tokens < tiered.l1_tokens + tiered.l2_tokens <= big.l1_tokens
    assert tiered.dropped_pages == 0 and small.demoted_pages == 0


def test_demo_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--conversations", "10", "--turns", "3", "--l1-tokens", "20000"]) == 0
    out = capsys.readouterr().out
    assert "l1_l2" in out and "L2 hit" in out


def test_demo_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--eviction", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
