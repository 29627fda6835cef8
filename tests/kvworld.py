"""A deterministic world around one decode-node core, for tests.

It executes the core's commands against a model of the hardware where every L1/L2 slot and
every L3 page holds an identity of the KV it contains: the page's key for a full page, and
("tail", request, length) for a partial one. Prefill writes the true KV; copies move contents;
so when the core hands a request to the decode batch the world can check, slot by slot, that
the KV there is exactly the ground truth. Completions are driven by the test, one at a time,
in any order it likes.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.pages import namespace_seed, page_keys

SEED = namespace_seed("test-model")


class WrongKV(AssertionError):
    """A request reached the decode batch with KV that differs from the ground truth."""


class World:
    def __init__(self, config: DecodeConfig, *, core: DecodeNodeCore | None = None) -> None:
        self.cfg = config
        self.core = core or DecodeNodeCore(config)
        self.page = config.page_size
        self.l1: list[object] = [None] * config.l1_pages
        self.l2: list[object] = [None] * config.l2_pages
        self.l3: dict[int, object] = {}
        self.now = 0.0
        self.tokens: dict[str, list[int]] = {}
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
        self.outcomes: dict[str, tuple[str, str]] = {}
        self.retracts: list[str] = []
        self.log: list[cmd.Command] = []

    # ------------------------------------------------------------------ ground truth

    def truth(self, rid: str, i: int) -> object:
        r = self.core.requests[rid]
        return r.keys[i] if i < len(r.keys) else ("tail", rid, r.seq_len)

    def keys_of(self, tokens: list[int]) -> list[int]:
        return page_keys(np.asarray(tokens, dtype=np.int64), self.page, SEED).tolist()

    # ------------------------------------------------------------------ feeding

    def feed(self, event: ev.Event) -> list[cmd.Command]:
        out = self.core.handle(event)
        for c in out:
            self.accept(c)
        return out

    def accept(self, c: cmd.Command) -> None:
        self.log.append(c)
        if isinstance(c, cmd.QueryStorage):
            self.queries[c.op] = c
        elif isinstance(c, cmd.Prefetch):
            self.prefetches[c.op] = c
        elif isinstance(c, cmd.CancelPrefetch):
            pass  # the test decides when the prefetch ends
        elif isinstance(c, cmd.LoadBack):
            assert len(c.host_slots) == len(c.device_slots)
            self.loads[c.op] = c
        elif isinstance(c, cmd.RequestKV):
            assert c.start % self.page == 0, c
            assert len(c.dst_slots) == math.ceil(c.end / self.page) - c.start // self.page, c
            self.transfers[c.transfer] = c
        elif isinstance(c, cmd.Backup):
            self.backups[c.op] = c
        elif isinstance(c, cmd.Store):
            self.stores[c.op] = c
        elif isinstance(c, cmd.SetTimer):
            self.timers[c.timer] = c.at
        elif isinstance(c, cmd.Agree):
            self.agrees.append(c)
        elif isinstance(c, cmd.StartDecode):
            self.check_kv(c.req, c.device_slots)
            self.started[c.req] = self.started.get(c.req, 0) + 1
        elif isinstance(c, cmd.Retract):
            self.retracts.append(c.req)
        elif isinstance(c, cmd.Respond):
            assert c.req not in self.outcomes, f"{c.req} answered twice"
            self.outcomes[c.req] = (c.outcome, c.reason)
        else:  # pragma: no cover - a new command kind needs handling here
            raise AssertionError(f"unhandled command {c!r}")

    def check_kv(self, rid: str, slots: tuple[int, ...]) -> None:
        r = self.core.requests[rid]
        want = math.ceil(r.seq_len / self.page)
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

    def load_done(self, op: int, failed: tuple[str, ...] = ()) -> None:
        """Complete a load-back; the pages of `failed` requests arrive as garbage, so a core
        that used them anyway would hand wrong KV to the decode batch."""
        c = self.loads.pop(op)
        for h, d in zip(c.host_slots, c.device_slots, strict=True):
            self.l1[d] = self.l2[h]
        for rid in failed:
            assert rid in c.reqs, f"{rid} is not in load-back #{op}"
            for d in set(self.core.requests[rid].slots) & set(c.device_slots):
                self.l1[d] = ("garbage", op)
        self.feed(ev.LoadDone(self.now, op, failed))

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

    def backup_done(self, op: int) -> None:
        c = self.backups.pop(op)
        for d, h in zip(c.device_slots, c.host_slots, strict=True):
            self.l2[h] = self.l1[d]
        self.feed(ev.BackupDone(self.now, op))

    def store_done(self, op: int) -> None:
        c = self.stores.pop(op)
        for key, h in zip(c.keys, c.host_slots, strict=True):
            assert self.l2[h] == key, f"store of page {key} from L2 slot {h} holding {self.l2[h]!r}"
            self.l3[key] = self.l2[h]
        self.feed(ev.StoreDone(self.now, op))

    def fire_timer(self, timer: int) -> None:
        at = self.timers.pop(timer)
        self.now = max(self.now, at)
        self.feed(ev.TimerFired(self.now, timer))

    def decode(self, rid: str, n: int, seed: int = 0) -> None:
        r = self.core.requests[rid]
        before = r.seq_len
        rng = np.random.default_rng(zlib.crc32(f"{rid}/{before}/{seed}".encode()))
        self.tokens[rid] += rng.integers(0, 50, n).tolist()
        keys = self.keys_of(self.tokens[rid])
        new_keys = keys[before // self.page :]
        self.feed(ev.Decoded(self.now, rid, n, new_keys))
        r = self.core.requests[rid]
        if r.state.name == "RUNNING":  # the decoder writes the KV of the new tokens
            for i in range(before // self.page, len(r.slots)):
                self.l1[r.slots[i]] = self.truth(rid, i)

    def finish(self, rid: str) -> None:
        self.feed(ev.Finished(self.now, rid))

    def abort(self, rid: str) -> None:
        self.feed(ev.AbortRequested(self.now, rid, "client went away"))

    def settle(self, max_rounds: int = 1000) -> None:
        """Complete every outstanding operation (in op order) and tick until nothing is left:
        running requests finish, so the node must come to rest."""
        for _ in range(max_rounds):
            progressed = False
            for op in sorted(self.queries):
                self.answer_query(op)
                progressed = True
            for op in sorted(self.prefetches):
                self.prefetch_done(op)
                progressed = True
            for op in sorted(self.loads):
                self.load_done(op)
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
            for rid, r in list(self.core.requests.items()):
                if r.state.name == "RUNNING":
                    self.finish(rid)
                    progressed = True
            self.tick()
            if not progressed and self.core.idle:
                return
        raise AssertionError("the node did not come to rest")
