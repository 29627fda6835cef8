"""A deterministic world around one decode-node core, for tests.

It executes the core's commands against a model of the hardware where every L1/L2 slot and
every L3 page holds an identity of the KV it contains: the page's key for a full page, and
("tail", request, length) for a partial one. Prefill writes the true KV; copies move contents;
so when the core hands a request to the decode batch the world can check, slot by slot, that
the KV there is exactly the ground truth. Completions are driven by the test, one at a time,
in any order it likes.

I/O takes time in this world: a command's reads and writes are in flight from the moment it
is executed until its completion is fed (a prefetch's reported pages end early). A command
that reads a slot some I/O in flight still writes, or writes a slot that I/O in flight reads
or writes, is a `Hazard`: real hardware would copy torn bytes. `check_tiers` then asks the
question that matters after every step: does every page the tree holds as valid, on L1, L2
or L3, hold exactly its own key's bytes?
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.account import Account
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.dispatch import Dispatcher
from hicache.core.errors import CoreError
from hicache.core.pages import namespace_seed, page_keys

SEED = namespace_seed("test-model")


class WrongKV(AssertionError):
    """A request reached the decode batch with KV that differs from the ground truth."""


def corrupt(kv: object) -> bool:
    """Whether a slot's contents are an L2 copy found bad (see `World.load_done`)."""
    return isinstance(kv, tuple) and len(kv) == 2 and kv[0] == "corrupt"


class Hazard(AssertionError):
    """A command reads a slot that I/O in flight writes, or writes one that I/O in flight uses."""


class WrongPage(AssertionError):
    """The tree holds a page as valid on a tier whose slot holds other bytes."""


Slot = tuple[str, int]  # ("L1" | "L2", slot)
IO = tuple[str, int]  # (kind, the command's id)


class World:
    """Executes one core's commands against slot-identity hardware. Like a real driver it reads
    nothing of the core but what its commands and events say (checked by
    `tests/test_driver_contract.py`)."""

    def __init__(self, config: DecodeConfig, *, core: DecodeNodeCore | None = None) -> None:
        self.cfg = config
        self.core = core or DecodeNodeCore(config)
        self.page = config.page_size
        self.l1: list[object] = [None] * config.l1_pages
        self.l2: list[object] = [None] * config.l2_pages
        self.l3: dict[int, object] = {}
        self.now = 0.0
        self.tokens: dict[str, list[int]] = {}  # every token whose KV the core was told about
        self.keys: dict[str, list[int]] = {}  # the page keys the core was given for them
        self.queries: dict[int, cmd.QueryStorage] = {}
        self.prefetches: dict[int, cmd.Prefetch] = {}
        self.prefetch_done_pages: dict[int, int] = {}
        self.loads: dict[int, cmd.LoadBack] = {}
        self.transfers: dict[int, cmd.RequestKV] = {}
        self.backups: dict[int, cmd.Backup] = {}
        self.stores: dict[int, cmd.Store] = {}
        self.timers: dict[int, float] = {}
        self.agrees: list[cmd.Agree] = []
        self.started: dict[str, int] = {}
        self.slots: dict[str, list[int]] = {}  # a running request's pages (StartDecode, ExtendKV)
        self.running: dict[str, None] = {}
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.accounts: dict[str, Account] = {}
        self.retracts: list[str] = []
        self.log: list[cmd.Command] = []
        self.fed: list[ev.Event] = []  # every event the core took
        self.ids: set[int] = set()  # every command id handed out so far
        self.observe: Callable[[cmd.Command], None] | None = None  # a test's check of each command
        self.writer: dict[Slot, IO] = {}  # slots that I/O in flight writes, and which I/O
        self.readers: dict[Slot, set[IO]] = {}  # slots that I/O in flight reads
        self.flight: dict[IO, tuple[list[Slot], list[Slot]]] = {}  # I/O -> (reads, writes)
        self.l3_lost: set[int] = set()  # keys L3 lost behind the node's back (another node's doing)
        self.dispatcher = Dispatcher(self.core, self.handlers(), "test world")

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """The world's executor table (every command type), each handler shown to `observe` first."""
        return {t: self._observed(h) for t, h in self._handlers().items()}

    def _observed(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(c: cmd.Command) -> None:
            if self.observe is not None:
                self.observe(c)
            handler(c)

        return run

    def _handlers(self) -> dict[type, Callable[[Any], None]]:
        return {
            cmd.QueryStorage: lambda c: self._track(c.op, self.queries, c),
            cmd.Prefetch: self._on_prefetch,
            cmd.CancelPrefetch: self.log.append,  # the test decides when the prefetch ends
            cmd.LoadBack: self._on_load_back,
            cmd.RequestKV: self._on_request_kv,
            cmd.Backup: self._on_backup,
            cmd.Store: self._on_store,
            cmd.SetTimer: self._on_set_timer,
            cmd.Agree: self._on_agree,
            cmd.StartDecode: self._on_start,
            cmd.ExtendKV: self._on_extend,
            cmd.Retract: self._on_retract,
            cmd.Respond: self._on_respond,
        }

    # ------------------------------------------------------------------ ground truth

    def truth(self, rid: str, i: int) -> object:
        toks = self.tokens[rid]
        keys = self.keys[rid]
        return keys[i] if i < len(keys) else ("tail", rid, len(toks))

    def keys_of(self, tokens: list[int]) -> list[int]:
        return page_keys(np.asarray(tokens, dtype=np.int64), self.page, SEED).tolist()

    # ------------------------------------------------------------------ feeding

    def feed(self, event: ev.Event) -> list[cmd.Command]:
        """Feed the core one event (recording the page keys it is given) and execute its commands."""
        mark = len(self.log)
        undo = self._io_ending(event)
        try:
            self._feed(event)
        except CoreError:
            for u in undo:  # refused: that I/O is still in flight
                u()
            raise
        self.fed.append(event)
        return self.log[mark:]

    def _feed(self, event: ev.Event) -> None:
        if isinstance(event, ev.RequestArrived) and event.req not in self.keys:
            self.keys[event.req] = list(event.keys)
            try:
                self.dispatcher.feed(event)
            except CoreError:
                del self.keys[event.req]
                raise
        else:
            self.dispatcher.feed(event)
            if isinstance(event, ev.Decoded):
                self.keys[event.req] += event.new_keys

    # ------------------------------------------------------------------ I/O in flight

    def _begin_io(self, io: IO, reads: list[Slot], writes: list[Slot]) -> None:
        """`io` starts reading `reads` and writing `writes`; a `Hazard` if that races I/O in flight."""
        for s in reads:
            if s in self.writer:
                raise Hazard(f"{io} reads {s} while {self.writer[s]} still writes it")
        for s in writes:
            if s in self.writer:
                raise Hazard(f"{io} writes {s} while {self.writer[s]} still writes it")
            if self.readers.get(s):
                raise Hazard(f"{io} writes {s} while {sorted(self.readers[s])} still read it")
        if len(set(writes)) != len(writes):
            raise Hazard(f"{io} writes one slot twice: {writes}")
        for s in reads:
            self.readers.setdefault(s, set()).add(io)
        for s in writes:
            self.writer[s] = io
        self.flight[io] = (reads, writes)

    def _end_io(self, io: IO) -> Callable[[], None]:
        """`io` ends; returns how to undo that (the core refused the completion)."""
        reads, writes = self.flight.pop(io)
        for s in set(reads):  # two entries of one load-back may read one slot
            self.readers[s].discard(io)
            if not self.readers[s]:
                del self.readers[s]
        for s in writes:
            del self.writer[s]
        return lambda: self._begin_io(io, reads, writes)

    def _stop_writing(self, io: IO, pages: int) -> Callable[[], None]:
        """Prefetch `io` reported its first `pages` complete: those slots are never written again."""
        reads, writes = self.flight[io]
        released = len(self.prefetches[io[1]].host_slots) - len(writes)  # reported before
        stop = writes[: max(0, pages - released)]
        for s in stop:
            del self.writer[s]
        self.flight[io] = (reads, writes[len(stop) :])

        def undo() -> None:
            for s in stop:
                self.writer[s] = io
            self.flight[io] = (reads, stop + self.flight[io][1])

        return undo

    def _io_ending(self, event: ev.Event) -> list[Callable[[], None]]:
        """Release the slots of the I/O that `event` completes before the core hears of it (it
        may hand them out again at once); returns how to undo that if the core refuses it."""
        io: IO | None = None
        if isinstance(event, ev.LoadDone):
            io = ("load", event.op)
        elif isinstance(event, ev.BackupDone):
            io = ("backup", event.op)
        elif isinstance(event, ev.StoreDone):
            io = ("store", event.op)
        elif isinstance(event, ev.PrefetchDone):
            io = ("prefetch", event.op)
        elif isinstance(event, ev.KVArrived | ev.KVFailed):
            io = ("transfer", event.transfer)
        elif isinstance(event, ev.PrefetchProgress):
            io = ("prefetch", event.op)
            if io in self.flight and event.op in self.prefetches and isinstance(event.pages, int):
                return [self._stop_writing(io, event.pages)]
            return []
        if io is None or io not in self.flight:
            return []
        return [self._end_io(io)]

    def check_tiers(self) -> None:
        """Every page the tree holds as valid holds its own key's bytes: on L1, on L2 once its
        backup ended, and in L3 once stored (L3 may lose a page behind the node's back, never
        hold a wrong one under a key). No valid L2 copy is still being written."""
        for n in self.core.tree.nodes():
            if n.device is not None:
                for k, s in zip(n.keys, n.device, strict=True):
                    if self.l1[s] != k:
                        raise WrongPage(f"the tree holds page {k} on L1 slot {s}, which holds {self.l1[s]!r}")
            if n.host is not None and not n.host_pending:
                for k, h in zip(n.keys, n.host, strict=True):
                    if self.l2[h] != k:
                        raise WrongPage(f"the tree holds page {k} on L2 slot {h}, which holds {self.l2[h]!r}")
                    if ("L2", h) in self.writer:
                        by = self.writer["L2", h]
                        raise WrongPage(f"page {k}'s L2 copy in slot {h} is valid while {by} writes it")
            if n.in_l3:
                for k in n.keys:
                    if k not in self.l3 and k not in self.l3_lost:
                        raise WrongPage(f"the tree holds page {k} as stored, but L3 never got it")
        for k, v in self.l3.items():
            if v != k:
                raise WrongPage(f"L3 holds {v!r} under page {k}")

    def _new_id(self, i: int) -> None:
        assert i not in self.ids, f"command id {i} handed out twice"
        self.ids.add(i)

    def _track(self, op: int, where: dict, c: cmd.Command) -> None:
        self.log.append(c)
        self._new_id(op)
        where[op] = c

    def _on_load_back(self, c: cmd.LoadBack) -> None:
        for e in c.entries:
            assert len(e.host_slots) == len(e.device_slots), c
        self._track(c.op, self.loads, c)
        self._begin_io(("load", c.op), [("L2", h) for h in c.host_slots], [("L1", d) for d in c.device_slots])

    def _on_request_kv(self, c: cmd.RequestKV) -> None:
        assert c.start % self.page == 0, c
        assert len(c.dst_slots) == math.ceil(c.end / self.page) - c.start // self.page, c
        assert c.prompt_len == len(self.tokens[c.req]), c
        self._track(c.transfer, self.transfers, c)
        self._begin_io(("transfer", c.transfer), [], [("L1", d) for d in c.dst_slots])

    def _on_prefetch(self, c: cmd.Prefetch) -> None:
        self._track(c.op, self.prefetches, c)
        self._begin_io(("prefetch", c.op), [], [("L2", h) for h in c.host_slots])

    def _on_backup(self, c: cmd.Backup) -> None:
        self._track(c.op, self.backups, c)
        reads = [("L1", d) for d in c.device_slots]
        self._begin_io(("backup", c.op), reads, [("L2", h) for h in c.host_slots])

    def _on_store(self, c: cmd.Store) -> None:
        self._track(c.op, self.stores, c)
        for key, h in zip(c.keys, c.host_slots, strict=True):
            if self.l2[h] != key and ("L2", h) not in self.writer:
                raise WrongPage(f"store #{c.op} reads page {key} from L2 slot {h} holding {self.l2[h]!r}")
        self._begin_io(("store", c.op), [("L2", h) for h in c.host_slots], [])

    def _on_set_timer(self, c: cmd.SetTimer) -> None:
        self.log.append(c)
        self._new_id(c.timer)
        if c.kind is cmd.TimerKind.TRANSFER_RETRY:  # `op`: the id its retry's RequestKV will carry
            assert c.op not in self.ids, c
        else:
            assert c.kind is cmd.TimerKind.PREFETCH_TIMEOUT and c.op in self.prefetches, c
        self.timers[c.timer] = c.at

    def _on_agree(self, c: cmd.Agree) -> None:
        self.log.append(c)
        self._new_id(c.agreement)
        self.agrees.append(c)

    def _on_start(self, c: cmd.StartDecode) -> None:
        self.log.append(c)
        assert c.prompt_len == len(self.tokens[c.req]), c
        for s in c.device_slots:
            if ("L1", s) in self.writer:
                by = self.writer["L1", s]
                raise Hazard(f"{c.req} starts decoding from L1 slot {s} while {by} writes it")
        self.check_kv(c.req, c.device_slots)
        self.started[c.req] = self.started.get(c.req, 0) + 1
        self.slots[c.req] = list(c.device_slots)
        self.running[c.req] = None

    def _on_extend(self, c: cmd.ExtendKV) -> None:
        self.log.append(c)
        for s in c.device_slots:
            if ("L1", s) in self.writer or self.readers.get(("L1", s)):
                raise Hazard(f"{c.req} is given L1 slot {s} to write while I/O in flight uses it")
        assert c.req in self.running and c.first_page == len(self.slots[c.req]), c
        self.slots[c.req] += c.device_slots

    def _on_retract(self, c: cmd.Retract) -> None:
        self.log.append(c)
        self.retracts.append(c.req)
        del self.running[c.req]
        self.slots.pop(c.req, None)

    def _on_respond(self, c: cmd.Respond) -> None:
        self.log.append(c)
        assert c.req not in self.outcomes, f"{c.req} answered twice"
        self.outcomes[c.req] = (c.outcome, c.reason)
        self.accounts[c.req] = c.account
        self.running.pop(c.req, None)
        self.slots.pop(c.req, None)

    def check_kv(self, rid: str, slots: tuple[int, ...]) -> None:
        want = math.ceil(len(self.tokens[rid]) / self.page)
        if len(slots) != want:
            raise WrongKV(f"{rid}: {len(slots)} pages handed to decode, {want} needed")
        for i, s in enumerate(slots):
            if self.l1[s] != self.truth(rid, i):
                raise WrongKV(
                    f"{rid}: page {i} in L1 slot {s} holds {self.l1[s]!r}, truth {self.truth(rid, i)!r}"
                )

    # ------------------------------------------------------------------ the test's moves

    def tick(self, dt: float = 0.001) -> list[cmd.Command]:
        self.now += dt
        return self.feed(ev.Tick(self.now))

    def arrive(self, rid: str, tokens: list[int], priority: int = 0) -> None:
        self.tokens[rid] = list(tokens)
        keys = self.keys_of(tokens)
        self.feed(ev.RequestArrived(self.now, rid, len(tokens), keys, priority))

    def arrive_from_l3(self, rid: str, tokens: list[int]) -> int:
        """Put every full page of `tokens` in L3 (as another node would have), let `rid`
        arrive with them, and answer its L3 query in full; returns the query's op."""
        self.l3.update((k, k) for k in self.keys_of(tokens))
        self.arrive(rid, tokens)
        self.tick()
        (op,) = self.queries
        self.answer_query(op)
        return op

    def answer_query(self, op: int, cap: dict[str, int] | None = None) -> None:
        """Answer with the consecutive L3 hits (optionally capped per request)."""
        q = self.queries.pop(op)
        hits = []
        for rid, keys in q.queries:
            n = 0
            while n < len(keys) and keys[n] in self.l3:
                n += 1
            if cap and rid in cap:
                n = min(n, cap[rid])
            hits.append((rid, n))
        self.feed(ev.StorageQueried(self.now, op, tuple(hits)))

    def prefetch_progress(self, op: int, pages: int) -> None:
        p = self.prefetches[op]
        pages = self._copy_prefetch(p, pages)
        self.feed(ev.PrefetchProgress(self.now, op, pages))

    def prefetch_done(self, op: int, pages: int | None = None) -> None:
        """End a prefetch with `pages` complete (default: every page L3 still holds, in order)."""
        p = self.prefetches.pop(op)
        pages = len(p.keys) if pages is None else pages
        pages = self._copy_prefetch(p, pages)
        self.feed(ev.PrefetchDone(self.now, op, pages))

    def _copy_prefetch(self, p: cmd.Prefetch, pages: int) -> int:
        """Copy pages [copied, pages) of a prefetch; pages reported complete are never written
        again (the core may already have handed their slots to someone else)."""
        done = self.prefetch_done_pages.get(p.op, 0)
        for key, h in zip(p.keys[done:pages], p.host_slots[done:], strict=False):
            if key not in self.l3:
                break
            self.l2[h] = self.l3[key]
            done += 1
        self.prefetch_done_pages[p.op] = done
        return done

    def load_done(self, op: int, failed: tuple[str, ...] = (), *, bad_pages: tuple[int, ...] = ()) -> None:
        """Complete a load-back. The pages of `failed` requests, and the batch's pages
        `bad_pages`, are bad at their source: their L2 copies hold corrupt bytes from now on
        (the tree must stop holding them). Every page read from a corrupt L2 slot, these and
        any other, arrives as garbage in L1 and is reported failed, so a core that used one
        anyway would hand wrong KV to the decode batch."""
        c = self.loads.pop(op)
        for rid in failed:
            assert rid in c.reqs, f"{rid} is not in load-back #{op}"
        bad = set(bad_pages)
        i = 0
        for entry in c.entries:
            if entry.req in failed:
                bad.update(range(i, i + len(entry.device_slots)))
            i += len(entry.device_slots)
        for j in bad:
            self.l2[c.host_slots[j]] = ("corrupt", op)
        reported = []
        for j, (h, d) in enumerate(zip(c.host_slots, c.device_slots, strict=True)):
            if corrupt(self.l2[h]):
                self.l1[d] = ("garbage", op)
                reported.append(j)
            else:
                self.l1[d] = self.l2[h]
        self.feed(ev.LoadDone(self.now, op, tuple(reported)))

    def kv_arrive(self, tid: int) -> None:
        c = self.transfers.pop(tid)
        # Prefill writes its KV whether or not the request has ended meanwhile: a core that
        # reused these slots before the transfer ended would see them overwritten.
        for j, s in enumerate(c.dst_slots):
            self.l1[s] = self.truth(c.req, c.start // self.page + j)
        self.feed(ev.KVArrived(self.now, c.req, tid))

    def kv_fail(self, tid: int, reason: str = "link down") -> None:
        c = self.transfers.pop(tid)
        for s in c.dst_slots:  # a failed transfer may have written anything
            self.l1[s] = ("garbage", "transfer", tid)
        self.feed(ev.KVFailed(self.now, c.req, tid, reason))

    def backup_done(self, op: int, failed: tuple[int, ...] = ()) -> None:
        """Complete a backup; the pages `failed` (indices) land as garbage in L2."""
        c = self.backups.pop(op)
        for j, (d, h) in enumerate(zip(c.device_slots, c.host_slots, strict=True)):
            self.l2[h] = ("garbage", "backup", op) if j in failed else self.l1[d]
        self.feed(ev.BackupDone(self.now, op, failed))

    def store_done(self, op: int, failed: tuple[int, ...] = ()) -> None:
        """Complete a store; the pages `failed` (indices) are not written to L3. A page whose L2
        copy was found bad meanwhile is not written either, and reported failed: the runtime
        checks every L2 page against its checksum before a store, so bad bytes never reach L3."""
        c = self.stores.pop(op)
        bad = set(failed)
        for j, (key, h) in enumerate(zip(c.keys, c.host_slots, strict=True)):
            if corrupt(self.l2[h]):
                bad.add(j)
                continue
            assert self.l2[h] == key, f"store of page {key} from L2 slot {h} holding {self.l2[h]!r}"
            if j not in bad:
                self.l3[key] = self.l2[h]
        self.feed(ev.StoreDone(self.now, op, tuple(sorted(bad))))

    def fire_timer(self, timer: int) -> None:
        at = self.timers.pop(timer)
        self.now = max(self.now, at)
        self.feed(ev.TimerFired(self.now, timer))

    def decode(self, rid: str, n: int, seed: int = 0) -> None:
        before = len(self.tokens[rid])
        rng = np.random.default_rng(zlib.crc32(f"{rid}/{before}/{seed}".encode()))
        self.tokens[rid] += rng.integers(0, 50, n).tolist()
        keys = self.keys_of(self.tokens[rid])
        new_keys = keys[before // self.page :]
        try:
            self.feed(ev.Decoded(self.now, rid, n, new_keys))
        except CoreError:
            del self.tokens[rid][before:]  # refused: the core was not told about them
            raise
        if rid in self.running:  # the decoder writes the KV of the new tokens
            slots = self.slots[rid]
            for i in range(before // self.page, len(slots)):
                self.l1[slots[i]] = self.truth(rid, i)

    def finish(self, rid: str) -> None:
        self.feed(ev.Finished(self.now, rid))

    def abort(self, rid: str) -> None:
        self.feed(ev.AbortRequested(self.now, rid, "client went away"))

    def complete_reads(self) -> bool:
        """Answer every storage query, and complete every prefetch and load-back, in op order;
        whether there was any."""
        any_ = bool(self.queries or self.prefetches or self.loads)
        for op in sorted(self.queries):
            self.answer_query(op)
        for op in sorted(self.prefetches):
            self.prefetch_done(op)
        for op in sorted(self.loads):
            self.load_done(op)
        return any_

    def settle(self, max_rounds: int = 1000, *, collectives: Callable[[], bool] | None = None) -> None:
        """Complete every outstanding operation (in op order) and tick until nothing is left:
        running requests finish, so the node must come to rest. `collectives` answers the
        open `Agree`s of a TP rank (whether there were any)."""
        for _ in range(max_rounds):
            progressed = self.complete_reads()
            if collectives is not None and collectives():
                progressed = True
            for tid in sorted(self.transfers):
                self.kv_arrive(tid)
                progressed = True
            for op in sorted(self.backups):
                self.backup_done(op)
                progressed = True
            for op in sorted(self.stores):
                self.store_done(op)
                progressed = True
            for timer in sorted(self.timers):
                self.fire_timer(timer)
                progressed = True
            for rid in list(self.running):
                self.finish(rid)
                progressed = True
            self.tick()
            if not progressed and self.core.idle:
                return
        live = sorted(set(self.tokens) - set(self.outcomes))
        raise AssertionError(
            f"the node did not come to rest: unanswered {live}, running {list(self.running)}, "
            f"audit {self.core.audit()}"
        )
