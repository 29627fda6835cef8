"""One lockstep harness for N TP ranks, each a replica of the decode-node core in its own
`World` (`tests/kvworld.py`).

It drives the contract of `hicache/core/events.py`: shared events reach every rank at the same
step (`each`); rank-local ones (L3 answers, prefetch progress, load-back outcomes) are fed to one
rank at a time by the test; every `Agree` is answered as a collective would be, once all ranks
have entered it, with the minimum of each value. After every shared step the ranks must have
emitted the same commands (the values of an `Agree` aside): ranks that decide differently
deadlock in mismatched collectives or restore different KV (fault 2 of "Six faults of the
reference implementation" in docs/architecture.md).
Like the world, it reads only what commands say, never the cores' requests.
"""

from __future__ import annotations

from typing import Any

import attrs
from kvworld import World

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig


def shape(c: cmd.Command) -> object:
    """What must be identical across ranks: everything, except the values of an `Agree`."""
    if isinstance(c, cmd.Agree):
        return ("Agree", c.agreement, c.kind, tuple(k for k, _ in c.values))
    return c


@attrs.define
class Decisions:
    """What one rank decided, per request and for the node; equal on every rank or a bug."""

    agree_kinds: list[str] = attrs.Factory(list)
    requested: dict[str, list[tuple[int, int]]] = attrs.Factory(dict)  # RequestKV ranges
    started: dict[str, list[int]] = attrs.Factory(dict)  # StartDecode: pages handed over
    promised: dict[str, list[int]] = attrs.Factory(dict)  # StartDecode: tokens restored locally
    retracted: dict[str, int] = attrs.Factory(dict)
    outcomes: dict[str, str] = attrs.Factory(dict)

    def read(self, commands: list[cmd.Command]) -> None:
        for c in commands:
            if isinstance(c, cmd.Agree):
                self.agree_kinds.append(c.kind)
            elif isinstance(c, cmd.RequestKV):
                self.requested.setdefault(c.req, []).append((c.start, c.end))
            elif isinstance(c, cmd.StartDecode):
                self.started.setdefault(c.req, []).append(len(c.device_slots))
                self.promised.setdefault(c.req, []).append(c.promised)
            elif isinstance(c, cmd.Retract):
                self.retracted[c.req] = self.retracted.get(c.req, 0) + 1
            elif isinstance(c, cmd.Respond):
                self.outcomes[c.req] = c.outcome


class Lockstep:
    """N worlds, one per TP rank, driven step by step; collectives answered by minimum."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.worlds = [World(cfg) for _ in range(cfg.tp_size)]
        self.decisions = [Decisions() for _ in self.worlds]
        self.read_up_to = [0] * len(self.worlds)
        self.seen = 0  # commands of the logs already compared by `check_same`
        self.cancelled: set[int] = set()  # prefetches the ranks were told to cancel
        self.collectives = 0

    @property
    def lead(self) -> World:
        return self.worlds[0]

    def core(self, rank: int = 0) -> Any:
        return self.worlds[rank].core

    # ------------------------------------------------------------------ checks

    def check_same(self) -> None:
        """Every rank was fed the same shared events in the same order (the contract of
        `hicache/core/events.py`: only `RANK_LOCAL` events may differ) and has emitted the same
        commands (collective ids, kinds and keys included)."""
        shared = [[e for e in w.fed if isinstance(e, ev.SHARED)] for w in self.worlds]
        for rank, events in enumerate(shared[1:], start=1):
            assert events == shared[0], f"rank {rank} was fed other shared events than rank 0"
        start = self.seen
        logs = [[shape(c) for c in w.log[start:]] for w in self.worlds]
        for rank, log in enumerate(logs[1:], start=1):
            if log != logs[0]:
                i = next((i for i, (a, b) in enumerate(zip(logs[0], log, strict=False)) if a != b), None)
                if i is None:
                    i = min(len(log), len(logs[0]))
                raise AssertionError(
                    f"rank {rank} diverges from rank 0 at command {start + i}:\n"
                    f"  rank 0: {logs[0][i : i + 3]}\n  rank {rank}: {log[i : i + 3]}"
                )
        for c in self.lead.log[start:]:
            if isinstance(c, cmd.CancelPrefetch):
                self.cancelled.add(c.op)
        self.seen += len(logs[0])

    def compare(self, where: str) -> None:
        """Every rank decided the same so far, and every rank's invariants hold."""
        self.check_same()
        for rank, w in enumerate(self.worlds):
            self.decisions[rank].read(w.log[self.read_up_to[rank] :])
            self.read_up_to[rank] = len(w.log)
            w.core.check()
        lead = attrs.asdict(self.decisions[0])
        for rank, d in enumerate(self.decisions[1:], start=1):
            mine = attrs.asdict(d)
            for name, value in lead.items():
                assert mine[name] == value, (
                    f"{where}: rank {rank} differs from rank 0 in {name}:\n"
                    f"  rank 0:    {value}\n  rank {rank}: {mine[name]}"
                )

    # ------------------------------------------------------------------ shared events

    def each(self, method: str, *args: Any) -> None:
        """A shared event: every rank sees it at the same step."""
        for w in self.worlds:
            getattr(w, method)(*args)
        self.check_same()

    def tick(self, *, answer: bool = True) -> None:
        """A shared tick; at most one collective of a kind opens in it. With `answer`, the
        collectives opened so far are answered at once (else the test answers them later)."""
        mark = len(self.lead.log)
        for w in self.worlds:
            w.tick()
        self.check_same()
        kinds = [c.kind for c in self.lead.log[mark:] if isinstance(c, cmd.Agree)]
        assert len(kinds) == len(set(kinds)), f"more than one collective of a kind in a tick: {kinds}"
        if answer:
            self.answer_collectives()

    def answer_collectives(self) -> None:
        """Answer every open `Agree`: all ranks must have entered the same ones (same ids, kinds
        and keys), else they would wait on each other forever."""
        open_ = [{a.agreement: a for a in w.agrees} for w in self.worlds]
        for w in self.worlds:
            w.agrees.clear()
        shapes = [
            sorted((a.agreement, a.kind, tuple(k for k, _ in a.values)) for a in o.values()) for o in open_
        ]
        for rank, s in enumerate(shapes[1:], start=1):
            assert s == shapes[0], f"mismatched collectives: rank 0 entered {shapes[0]}, rank {rank} {s}"
        for aid in sorted(open_[0]):
            calls = [o[aid] for o in open_]
            values = tuple((key, min(dict(c.values)[key] for c in calls)) for key, _ in calls[0].values)
            self.collectives += 1
            for w in self.worlds:
                w.feed(ev.Agreed(w.now, aid, values))
        self.check_same()

    def shared_ops(self, attr: str) -> list[int]:
        """The open operations of a shared kind; they must be the same on every rank."""
        ops = [sorted(getattr(w, attr)) for w in self.worlds]
        assert all(o == ops[0] for o in ops), f"ranks hold different {attr}: {ops}"
        return ops[0]

    def complete_shared(self, *, transfers: bool = True) -> None:
        """Complete every shared operation in flight, on every rank at the same step."""
        for op in self.shared_ops("loads"):
            self.each("load_done", op)
        for tid in self.shared_ops("transfers") if transfers else ():
            self.each("kv_arrive", tid)
        for op in self.shared_ops("backups"):
            self.each("backup_done", op)
        for op in self.shared_ops("stores"):
            self.each("store_done", op)

    def running(self) -> list[str]:
        """The requests in the decode batch, the same on every rank."""
        running = [list(w.running) for w in self.worlds]
        assert all(x == running[0] for x in running), f"ranks disagree on the batch: {running}"
        return running[0]

    def rest(self, rounds: int = 200) -> None:
        """Complete everything — each rank reads all its L3 holds, nothing fails any more — and
        finish every running request, until all ranks are idle."""
        for i in range(rounds):
            for w in self.worlds:
                for op in sorted(w.queries):
                    w.answer_query(op)
                for op in sorted(w.prefetches):
                    w.prefetch_done(op)
            self.complete_shared()
            for t in self.shared_ops("timers"):
                self.each("fire_timer", t)
            for rid in self.running():
                self.each("finish", rid)
            self.tick()
            self.compare(f"settling, round {i}")
            idle = [w.core.idle for w in self.worlds]
            assert all(x == idle[0] for x in idle), f"ranks disagree on being idle: {idle}"
            if idle[0]:
                break
        else:
            raise AssertionError("the ranks did not come to rest")
        for w in self.worlds:
            w.core.check()
            assert w.core.audit()["locks"] == 0 and w.core.audit()["pins"] == 0
        outcomes = [w.outcomes for w in self.worlds]
        assert all(o == outcomes[0] for o in outcomes)
