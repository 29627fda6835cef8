"""The demo command and the generated workload it replays."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cli import main
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


def test_demo_command_runs_all_four_baselines(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--set", "workload.conversations=8", "--set", "workload.turns=3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for label in ("no_decode_cache", "l1 ", "l1_l2 ", "l1_l2_l3"):
        assert label in printed
    assert {p.name for p in out.iterdir()} == {
        "summary.json",
        "requests.csv",
        "ttft_cdf.png",
        "cached_by_tier.png",
        "pd_transfer.png",
    }


def test_demo_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--set", "cache.eviction=random"]) == 2
    assert "cache.eviction" in capsys.readouterr().err
