"""The core decides the same in every process: fed the same events, two processes with different
hash seeds (`PYTHONHASHSEED`), compiled or plain Python, emit the same commands, timers included.

TP ranks are separate processes that each run the core on the same shared events and must stay
in lockstep; a recorded run must replay exactly. Anything per-process in a decision (a `hash()`
of a string, the iteration order of a set of strings, an object id) would make a retry's backoff
timer, a victim, or an id differ between ranks. Run as a script, this file drives seeded worlds
and prints every command they executed; the test compares those prints across processes.

The worlds run with one rank and as one rank of a TP-2 node: each process is then a rank on its
own, fed the same shared and rank-local events as its peer would be, so a collective's answer
(the minimum over ranks) is its own values; ranks in processes with different hash seeds must
enter the same collectives and emit the same commands.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.process  # each test starts child Pythons

HERE = Path(__file__).resolve().parent
SEEDS = range(6)
TP_SIZES = (1, 2)


def run_world(seed: int, tp_size: int = 1) -> list[str]:
    """One world driven by a seeded schedule (arrivals over shared prefixes, transfers that fail
    and retry after a backoff, backups and stores that fail now and then, evictions); returns
    the repr of every command it executed, in order."""
    from builders import decode_config, prompt
    from kvworld import World

    from hicache.core import events as ev

    rng = random.Random(seed)
    cfg = decode_config(
        page_size=2,
        l1_pages=24,
        l2_pages=rng.choice([8, 24]),
        storage=True,
        write_policy=rng.choice(["write_through", "write_back", "write_through_selective"]),
        eviction=rng.choice(["lru", "lfu", "priority"]),
        transfer_retries=3,
        transfer_backoff_s=0.25,
        transfer_backoff_max_s=2.0,
        decode_reserve_tokens=0,
        tp_size=tp_size,
    )
    w = World(cfg)
    prefixes = [prompt(i, rng.randrange(2, 9)) for i in range(3)]
    arrived = 0
    for _ in range(150):
        moves = [w.tick]
        if arrived < 12:

            def arrive() -> None:
                nonlocal arrived
                base = rng.choice(prefixes)
                w.arrive(f"r{arrived}", base + prompt(50 + arrived, rng.randrange(1, 6)), rng.randrange(3))
                arrived += 1

            moves += [arrive, arrive]
        moves += [lambda op=op: w.answer_query(op) for op in sorted(w.queries)]
        moves += [lambda op=op: w.prefetch_done(op) for op in sorted(w.prefetches)]
        moves += [lambda op=op: w.load_done(op) for op in sorted(w.loads)]
        for tid in sorted(w.transfers):
            moves += [lambda tid=tid: w.kv_arrive(tid), lambda tid=tid: w.kv_fail(tid)]
        for op in sorted(w.backups):
            n = len(w.backups[op].host_slots)
            moves += [lambda op=op: w.backup_done(op), lambda op=op, n=n: w.backup_done(op, (n - 1,))]
        for op in sorted(w.stores):
            moves += [lambda op=op: w.store_done(op)]
        moves += [lambda timer=timer: w.fire_timer(timer) for timer in sorted(w.timers)]
        for rid in sorted(w.running):
            moves += [lambda rid=rid: w.decode(rid, rng.randrange(1, 4)), lambda rid=rid: w.finish(rid)]
        moves.append(lambda: w.feed(ev.EvictRequested(w.now, rng.randrange(6), rng.randrange(6))))
        rng.choice(moves)()
        answer_own_collectives(w)
    w.settle(collectives=lambda: answer_own_collectives(w))
    return [repr(c) for c in w.log]


def answer_own_collectives(w: Any) -> bool:
    """Answer every open `Agree` as a collective of identical ranks would: with its own values."""
    from hicache.core import events as ev

    answered = bool(w.agrees)
    while w.agrees:
        a = w.agrees.pop(0)
        w.feed(ev.Agreed(w.now, a.agreement, a.values))
    return answered


def _child(**env: str) -> list[list[str]]:
    run = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        cwd=HERE,
        env={**{k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "HICACHE_PURE")}, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize(
    "other",
    [{"PYTHONHASHSEED": "4242"}, {"PYTHONHASHSEED": "17", "HICACHE_PURE": "1"}],
    ids=["another hash seed", "another hash seed, plain Python"],
)
def test_processes_with_different_hash_seeds_emit_identical_commands(other: dict[str, str]) -> None:
    first = _child(PYTHONHASHSEED="0")
    second = _child(**other)
    retries = [line for log in first for line in log if "TRANSFER_RETRY" in line]
    assert retries, "the worlds never backed a retry off: the test would not see the jitter"
    assert any("Agree(" in line for log in first for line in log), "no TP rank entered a collective"
    assert sum(len(log) for log in first) > 500
    for seed, (a, b) in enumerate(zip(first, second, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert x == y, f"world {seed}, command {i}: {x} in one process, {y} in the other"
        assert len(a) == len(b), f"world {seed}: {len(a)} commands in one process, {len(b)} in the other"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    print(json.dumps([run_world(seed, tp) for tp in TP_SIZES for seed in SEEDS]))
