"""The lockstep of a tensor-parallel decode node: every rank feeds its core the same shared events.

The core's TP model (`hicache/core/events.py`: `SHARED`, `RANK_LOCAL`) asks the driver for the
same shared events, in the same order, with the same content on every rank. Ranks run rounds in
step, paced by rank 0 (every tick interval while there is work, a heartbeat otherwise, so a
waiting rank never nears the collective timeout). One round:

1. **exchange** (one `all_gather_object`): rank 0 sends its clock and the external events its
   clients caused (arrivals, with the request's data; aborts, evictions, forgets); every rank
   sends the completions of its own I/O since the last round (transfers, backups, stores), and
   ranks 1.. their per-request verification reports and any answers rank 0 asked for;
2. every rank feeds its rank-local events (L3 answers, prefetch and load-back outcomes: they make
   no commands), then rank 0's external events in order, then each completion that every rank
   has now reported, in the order the exchange listed them, merged (a transfer arrived only if
   it arrived everywhere; failed pages are the union), then the timers due at rank 0's clock;
3. a `Tick`; then each `Agree` the core opened, in order, as one all_reduce MIN per kind
   (`agree(l3_hits)`, `agree(prefetch)`, `agree(load)`), whose answers are fed back;
4. one decode step for the running requests (every rank steps the same batch; the model's
   all-reduces make the logits, and so the tokens, equal), fed back as `Decoded` / `Finished`.

Every event is stamped with rank 0's clock of the round, so the cores' times agree too.

The decode node hands `Rounds` its feed (whose events for the core wait here for the next round,
`feed`), its live-request table, its decode step and its local answers; nothing here knows the
decode node's classes (`Feeds`, `Table`: what a round uses of them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import attrs
import trio

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError
from hicache.runtime.tp.tp_group import TPFailure, TPGroup

EXTERNAL = (ev.RequestArrived, ev.AbortRequested, ev.EvictRequested, ev.ForgetRequested)
COMPLETIONS = (ev.KVArrived, ev.KVFailed, ev.KVAbandoned, ev.BackupDone, ev.StoreDone)
LIVE_FIELDS = ("prompt", "max_new", "seed", "verify", "arrival", "sampling", "stop_ids")
HEARTBEAT_S = 0.05


def keys_digest(kind: str, keys: list[object]) -> int:
    """A digest of an agreement's keys, the same on every rank that holds the same keys."""
    text = repr((kind, keys)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "little")


class Feeds(Protocol):
    """The decode node's feed to its core, as a round uses it."""

    def put_now(self, event: ev.Event, *, refuse: bool = False) -> None: ...

    def tick_now(self, at: float) -> None: ...


class Table(Protocol):
    """The decode node's live requests (`Live`: a round reads and sets their fields by name)."""

    def get(self, rid: str) -> Any: ...

    def remove(self, rid: str) -> Any: ...

    def values(self) -> Iterable[Any]: ...

    def new(self, rid: str, fields: dict[str, Any]) -> Any: ...

    def __len__(self) -> int: ...


class Rounds:
    """Runs the rounds of one rank: `group` carries the collectives, `feed` reaches the core,
    `live` holds the requests; `attach` gives it the decode step and the local answers."""

    def __init__(
        self, group: TPGroup, feed: Feeds, live: Table, core: DecodeNodeCore, *, tick_interval: float
    ) -> None:
        self.g = group
        self.f = feed
        self.live = live
        self.core = core
        self.tick_interval = tick_interval
        self._step: Callable[[float], Awaitable[None]] | None = None
        self._local_answer: Callable[[str], Any] | None = None
        self.now = 0.0  # rank 0's clock of the current round
        self._external: list[tuple[str, Any]] = []  # rank 0: what its clients caused
        self._local: list[ev.Event] = []  # rank-local events of this rank
        self._done: list[tuple[tuple[str, int], tuple]] = []  # this rank's completions
        self._reports: list[tuple[str, dict[str, Any]]] = []  # ranks 1..: per responded request
        self._pending: dict[tuple[str, int], dict[int, list[tuple]]] = {}
        self._abandoned: dict[tuple[str, int], set[int]] = {}  # transfers fed KVAbandoned
        self._timers: dict[int, float] = {}
        self._agrees: list[cmd.Agree] = []
        self._seq = 0
        self.rank_reports: dict[str, dict[int, dict[str, Any]]] = {}  # rank 0: rid -> rank -> report
        self._asks: list[str] = []
        self._replies: list[tuple[str, Any]] = []  # ranks 1..: answers to rank 0's asks
        self._answers: dict[str, dict[int, Any]] = {}
        self._answered: dict[str, trio.Event] = {}
        self._wake = trio.Event()

    def attach(self, step: Callable[[float], Awaitable[None]], answer: Callable[[str], Any]) -> None:
        """`step(now)` runs a round's decode step; `answer(what)` is this rank's answer to rank
        0's `stats` ("gauges") or `audit`."""
        self._step, self._local_answer = step, answer

    # ------------------------------------------------------------------ what the node hands in

    def feed(self, event: ev.Event) -> bool:
        """Take `event` for the next round; False if it is to be fed at once (a decode step's)."""
        if isinstance(event, ev.RANK_LOCAL):
            self._local.append(event)
        elif isinstance(event, EXTERNAL):
            self._external.append(("event", event))
            self._wake.set()
        elif isinstance(event, COMPLETIONS):
            self._done.append(self._completion(event))
        elif isinstance(event, ev.TimerFired):
            raise AssertionError("timers of a TP node fire in rounds")
        else:
            return False
        return True

    def arrive(self, live: Any, keys: list[int]) -> None:
        """Rank 0: a client's request, to reach every rank with its data."""
        fields = {name: getattr(live, name) for name in LIVE_FIELDS}
        self._external.append(("arrive", (live.rid, fields, keys)))
        self._wake.set()

    def set_timer(self, c: cmd.SetTimer) -> None:
        self._timers[c.timer] = c.at

    def agree(self, c: cmd.Agree) -> None:
        self._agrees.append(c)

    def responded(self, live: Any) -> None:
        """The core responded to `live`: rank 0 answers its client once every rank reported;
        ranks 1.. report what rank 0's reply needs of them."""
        if self.g.rank == 0:
            self.release(live.rid)
        else:
            info = {"start_pages": live.start_pages, "final_pages": live.final_pages, "kv": live.start_kv}
            self._reports.append((live.rid, info))

    async def ask(self, what: str) -> dict[int, Any]:
        """Rank 0: every other rank's answer to `what` ("gauges", "audit"), by rank."""
        if what not in self._answered:
            self._answered[what] = trio.Event()
            self._answers[what] = {}
            self._asks.append(what)
            self._wake.set()
        done, answers = self._answered[what], self._answers[what]
        await done.wait()
        return answers

    @staticmethod
    def _completion(e: ev.Event) -> tuple[tuple[str, int], tuple]:
        if isinstance(e, ev.KVArrived):
            return ("kv", e.transfer), ("arrived", e.req)
        if isinstance(e, ev.KVFailed):
            return ("kv", e.transfer), ("failed", e.req, e.reason, e.retry)
        if isinstance(e, ev.KVAbandoned):
            return ("kv", e.transfer), ("abandoned", e.req, e.reason)
        if isinstance(e, ev.BackupDone):
            return ("backup", e.op), ("done", tuple(e.failed))
        assert isinstance(e, ev.StoreDone)
        return ("store", e.op), ("done", tuple(e.failed))

    # ------------------------------------------------------------------ the loop

    def _busy(self) -> bool:
        return bool(len(self.live) or self._pending or self._timers or not self.core.idle or self._asks)

    async def run(self) -> None:
        try:
            while True:
                if self.g.rank == 0:  # paces the rounds: at once while decoding, a tick
                    # interval with other work, else on news (or a heartbeat)
                    if any(live.running for live in self.live.values()):
                        await trio.lowlevel.checkpoint()
                    elif self._busy():
                        await trio.sleep(self.tick_interval)
                    else:
                        with trio.move_on_after(min(HEARTBEAT_S, self.g.timeout / 4)):
                            await self._wake.wait()
                    self._wake = trio.Event()
                await self.round()
        except TPFailure as exc:
            self.g.fail(str(exc))

    async def round(self) -> None:
        g, f = self.g, self.f
        assert self._step is not None and self._local_answer is not None, "Rounds.attach first"
        g.next_round()
        mine: dict[str, Any] = {"done": self._done}
        self._done = []
        if g.rank == 0:
            mine.update(now=trio.current_time(), ext=self._external, asks=self._asks)
            self._external, self._asks = [], []
        else:
            mine["reports"], self._reports = self._reports, []
            mine["answers"], self._replies = self._replies, []
        payloads = await g.exchange(mine)
        lead = payloads[0]
        self.now = lead["now"]
        local, self._local = self._local, []
        for e in local:
            f.put_now(ev_at(e, self.now))
        for kind, item in lead["ext"]:
            self._external_event(kind, item)
        for rank, p in enumerate(payloads):
            for key, outcome in p["done"]:
                self._pending.setdefault(key, {}).setdefault(rank, []).append(outcome)
        self._merge()
        for timer, at in sorted(self._timers.items(), key=lambda x: (x[1], x[0])):
            if at <= self.now:
                del self._timers[timer]
                f.put_now(ev.TimerFired(self.now, timer))
        f.tick_now(self.now)
        agrees, self._agrees = self._agrees, []
        for a in agrees:
            keys = [k for k, _ in a.values]
            got = await g.agree_min(a.kind, keys_digest(a.kind, keys), [v for _, v in a.values])
            f.put_now(ev.Agreed(self.now, a.agreement, tuple(zip(keys, got, strict=True))))
        if g.rank == 0:
            self._collect(payloads)
        else:
            self._replies += [(what, self._local_answer(what)) for what in lead["asks"]]
        await self._step(self.now)

    def _external_event(self, kind: str, item: Any) -> None:
        f = self.f
        if kind == "arrive":
            rid, fields, keys = item
            live = self.live.get(rid) if self.g.rank == 0 else None
            if live is None:
                live = self.live.new(rid, fields)
            live.seq = self._seq
            self._seq += 1
            try:
                f.put_now(ev.RequestArrived(self.now, rid, len(live.prompt), keys), refuse=True)
            except CoreError:  # the core still keeps an ended request of that id
                live.outcome, live.reason, live.duplicate = "failed", "duplicate request id", True
                if self.g.rank != 0:
                    self.live.remove(rid)
                live.answer.set()
            return
        event = ev_at(item, self.now)
        if isinstance(event, ev.ForgetRequested) and self.g.rank != 0:
            self.live.remove(event.req)
        f.put_now(event)

    def _merge(self) -> None:
        """Feed each completion every rank has reported, merged, in the exchange's order."""
        n = self.g.size
        for key in list(self._pending):
            by_rank = self._pending[key]
            if len(by_rank) < n:
                continue
            if key[0] != "kv":
                failed = sorted({i for outs in by_rank.values() for i in outs[0][1]})
                del self._pending[key]
                kind = ev.BackupDone if key[0] == "backup" else ev.StoreDone
                self.f.put_now(kind(self.now, key[1], tuple(failed)))
                continue
            req, tid = by_rank[0][0][1], key[1]
            if key not in self._abandoned:
                firsts = {r: outs[0] for r, outs in sorted(by_rank.items())}
                gone = {r for r, o in firsts.items() if o[0] == "abandoned"}
                failed = [(r, o) for r, o in firsts.items() if o[0] == "failed"]
                if gone:
                    self._abandoned[key] = gone
                    r = min(gone)
                    self.f.put_now(ev.KVAbandoned(self.now, req, tid, f"rank {r}: {firsts[r][2]}"))
                else:
                    del self._pending[key]
                    if failed:
                        r, o = failed[0]
                        retry = all(x[3] for _, x in failed if len(x) > 3)  # refused by one: by all
                        self.f.put_now(ev.KVFailed(self.now, req, tid, f"rank {r}: {o[2]}", retry))
                    else:
                        self.f.put_now(ev.KVArrived(self.now, req, tid))
                    continue
            # Fed KVAbandoned: over once every abandoning rank's transfer settled.
            if all(len(by_rank[r]) > 1 for r in self._abandoned[key]):
                del self._pending[key], self._abandoned[key]
                self.f.put_now(ev.KVFailed(self.now, req, tid, "abandoned transfer settled"))

    def _collect(self, payloads: list[dict[str, Any]]) -> None:
        """Rank 0: the other ranks' reports and answers; a request is answered once all are in."""
        for rank, p in enumerate(payloads[1:], start=1):
            for what, answer in p["answers"]:
                self._answers[what][rank] = answer
                if len(self._answers[what]) == self.g.size - 1:
                    self._answered.pop(what).set()
            for rid, info in p["reports"]:
                self.rank_reports.setdefault(rid, {})[rank] = info
                self.release(rid)

    def release(self, rid: str) -> None:
        """Rank 0: answer `rid`'s client once it responded here and every rank reported."""
        live = self.live.get(rid)
        got = self.rank_reports.get(rid, {})
        if live is not None and live.outcome and len(got) == self.g.size - 1:
            live.ranks = [got[r] for r in range(1, self.g.size)]
            del self.rank_reports[rid]
            live.answer.set()


def ev_at(e: Any, now: float) -> Any:
    """`e` stamped with the round's time."""
    return attrs.evolve(e, at=now)
