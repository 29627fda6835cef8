"""L3 in this process's memory: for tests, single-node runs and as the model other backends are
checked against."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import trio

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool, PageIndices
from hicache.runtime.storage.base import Progress, StoreStats, check_batch, key_values


class MemoryStore:
    """Immutable byte copies of pages by key, least recently used evicted beyond `capacity_pages`
    (0 = unbounded). A `get` hit counts as a use; `exists` does not, since a query is not a read.

    Copies run inline on the event loop, after one checkpoint: this store is meant for sizes
    where a memcpy is short, and a cancelled `get` has copied nothing.
    """

    def __init__(self, layout: KVLayout, capacity_pages: int = 0) -> None:
        if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int) or capacity_pages < 0:
            raise ValueError(f"MemoryStore.capacity_pages: expected an int >= 0, got {capacity_pages!r}")
        self.layout = layout
        self.capacity_pages = capacity_pages
        self.stats = StoreStats()
        self._pages: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._closed = False

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key_values([key])[0] in self._pages

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MemoryStore is closed")

    async def exists(self, keys: Sequence[object]) -> int:
        values = key_values(keys)
        self._check_open()
        await trio.lowlevel.checkpoint()
        for i, key in enumerate(values):
            if key not in self._pages:
                return i
        return len(values)

    async def get(
        self, keys: Sequence[object], pool: KVPool, pages: PageIndices, *, progress: Progress | None = None
    ) -> int:
        values, idx = check_batch("MemoryStore.get", self.layout, keys, pool, pages, into_pool=True)
        self._check_open()
        await trio.lowlevel.checkpoint()
        rows = pool.bytes_view().numpy()
        done = len(values)
        for i, (key, page) in enumerate(zip(values, idx, strict=True)):
            data = self._pages.get(key)
            if data is None:
                self.stats.misses += 1
                done = i
                break
            self._pages.move_to_end(key)
            rows[page] = np.frombuffer(data, dtype=np.uint8)
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
        if progress is not None:
            progress(done)
        return done

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        values, idx = check_batch("MemoryStore.put", self.layout, keys, pool, pages, into_pool=False)
        self._check_open()
        await trio.lowlevel.checkpoint()
        rows = pool.bytes_view().numpy()
        for key, page in zip(values, idx, strict=True):
            if key in self._pages:
                self._pages.move_to_end(key)
                self.stats.skipped += 1
                continue
            self._pages[key] = rows[page].tobytes()
            self.stats.written += 1
            self.stats.bytes_written += self.layout.page_bytes
            if self.capacity_pages and len(self._pages) > self.capacity_pages:
                self._pages.popitem(last=False)
                self.stats.evicted += 1
        # A batch larger than the capacity evicts some of its own pages again.
        return [i for i, key in enumerate(values) if key not in self._pages]

    async def aclose(self) -> None:
        self._closed = True
        self._pages.clear()
        await trio.lowlevel.checkpoint()
