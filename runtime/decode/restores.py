"""The decode node's restores and copies: the executors of the core's storage and copy commands
(`QueryStorage`, `Prefetch`/`CancelPrefetch`, `LoadBack`, `Backup`, `Store`) and of its timers.

Each runs as its own task and feeds its outcome back. Each prefetch runs in its own cancel scope,
which `CancelPrefetch` cancels; its `PrefetchDone` names the pages that landed and is fed only
once the L3 read has returned, so no byte can land in the prefetch's host slots after the core
frees them. Copies go through `CheckedCopies`, which checks L2 pages against the checksums taken
when they were written whenever the node checks pages (and injects the copy faults it is given).
"""

from __future__ import annotations

import collections

import trio

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.runtime.decode.faults import CheckedCopies
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.injected import FaultHooks
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage.base import StorageBackend


class Restores:
    """Runs storage and copy commands against `store`, L2 and `checked` copies."""

    def __init__(
        self,
        feed: Feed,
        store: StorageBackend,
        l2: KVPool,
        checked: CheckedCopies,
        moved: collections.Counter[str],
        faults: FaultHooks,
    ) -> None:
        self.feed, self.store, self.l2, self.checked = feed, store, l2, checked
        self.moved = moved
        self.faults = faults  # for timers: the copies' and L3's faults wrap `checked` and `store`
        self.page_bytes = l2.layout.page_bytes
        self.prefetches: dict[int, trio.CancelScope] = {}  # prefetch op -> its scope, until it ends

    async def query(self, c: cmd.QueryStorage) -> None:
        hits = []
        for rid, keys in c.queries:
            hits.append((rid, await self.store.exists(list(keys)) if keys else 0))
        self.feed.put(ev.StorageQueried(self.feed.now(), c.op, tuple(hits)))

    def open_prefetch(self, c: cmd.Prefetch) -> trio.CancelScope:
        """The prefetch's scope, made before its task starts, so a cancel that comes first still
        counts."""
        scope = self.prefetches[c.op] = trio.CancelScope()
        return scope

    def cancel_prefetch(self, c: cmd.CancelPrefetch) -> None:
        """Stop the read; the prefetch still answers, with what landed (an ended op: ignored)."""
        scope = self.prefetches.get(c.op)
        if scope is not None:
            scope.cancel()

    async def prefetch(self, c: cmd.Prefetch, scope: trio.CancelScope) -> None:
        """Read the pages from L3 until done or cancelled; then report the pages that landed.

        `get` returns or raises only once nothing it started can write to the host slots (a
        read in a worker thread is waited for), and reports pages as they land, so
        `PrefetchDone` is exact and comes after the last byte."""
        landed = 0
        self.moved["prefetch_batches"] += 1

        def progress(pages: int) -> None:
            nonlocal landed
            landed = pages

        try:
            with scope:
                landed = await self.store.get(list(c.keys), self.l2, list(c.host_slots), progress=progress)
            with trio.CancelScope(shield=True):  # the guard must learn what landed, whatever comes
                await self.checked.prefetched(c.host_slots, landed)
        finally:
            del self.prefetches[c.op]
        self.moved["prefetch_bytes"] += landed * self.page_bytes
        self.feed.put(ev.PrefetchDone(self.feed.now(), c.op, landed))

    async def load(self, c: cmd.LoadBack) -> None:
        failed = await self.checked.load(c)
        self.moved["restore_batches"] += 1
        self.moved["restore_bytes"] += (len(c.device_slots) - len(failed)) * self.page_bytes
        self.feed.put(ev.LoadDone(self.feed.now(), c.op, failed))

    async def backup(self, c: cmd.Backup) -> None:
        failed = await self.checked.backup(c)
        self.moved["backup_bytes"] += (len(c.device_slots) - len(failed)) * self.page_bytes
        self.feed.put(ev.BackupDone(self.feed.now(), c.op, failed))

    async def put(self, c: cmd.Store) -> None:
        """Write the pages that still check out; report every page L3 does not hold after."""
        keep = await self.checked.storable(c.host_slots)
        missed: list[int] = []
        if keep:
            keys, slots = [c.keys[i] for i in keep], [c.host_slots[i] for i in keep]
            try:
                missed = [keep[i] for i in await self.store.put(keys, self.l2, slots)]
            except Exception:  # noqa: BLE001 - a store that fails holds none of them for sure
                missed = keep
        kept = set(keep) - set(missed)
        failed = tuple(i for i in range(len(c.keys)) if i not in kept)
        self.feed.put(ev.StoreDone(self.feed.now(), c.op, failed))

    async def timer(self, c: cmd.SetTimer) -> None:
        at = self.faults.timer(c)
        if at is not None:
            await trio.sleep_until(at)
        self.feed.put(ev.TimerFired(self.feed.now(), c.timer))
