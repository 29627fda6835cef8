"""`CancelPrefetch` in the runtime: a prefetch runs in its own cancel scope, which the command
cancels. The read stops early, `PrefetchDone` names exactly the pages that landed, and it comes
only once no byte of the read can still land in the prefetch's host slots (a page being written
by a worker thread when the cancel comes is waited for). A no-op cancel handler fails these
tests: the read would run on to its last page."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from node_pair import PAGE, assert_nothing_held, node_pair, prompt, turn

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.runtime.decode.decode_node import DecodeService
from hicache.runtime.kv.kv_pool import KVPool, PageIndices
from hicache.runtime.model.llama import TinyConfig, TinyModel
from hicache.runtime.nodes import layout_for
from hicache.runtime.storage.base import Progress, StorageBackend
from hicache.runtime.storage.file_store import FileStore
from hicache.runtime.storage.memory_store import MemoryStore
from hicache.runtime.transfer.tcp import TcpEngine

GUARD_S = 30
PAGES = 6


class SlowStore:
    """A store whose `get` lands one page at a time from a worker thread that first waits (for
    `delay` seconds, or until the page's gate opens when `gated`), like a slow disk. The thread
    is not abandoned on cancel: a page it has begun still lands, and `get` returns after it."""

    def __init__(self, inner: StorageBackend, *, delay: float = 0.0, gated: bool = False) -> None:
        self.inner = inner
        self.stats = inner.stats
        self.delay = delay
        self.gates = [threading.Event() for _ in range(64)] if gated else []
        self.started: list[int] = []  # page positions whose thread began, in order
        self.writes: list[int] = []  # pool pages written, in order

    async def exists(self, keys: Sequence[object]) -> int:
        return await self.inner.exists(keys)

    async def get(
        self, keys: Sequence[object], pool: KVPool, pages: PageIndices, *, progress: Progress | None = None
    ) -> int:
        scratch = KVPool(pool.layout, 1)
        targets = [int(p) for p in pages]
        for i, (key, page) in enumerate(zip(list(keys), targets, strict=True)):
            if await self.inner.get([key], scratch, [0]) != 1:  # a checkpoint between pages
                return i
            await trio.to_thread.run_sync(self._land, i, scratch, pool, page)
            if progress is not None:
                progress(i + 1)
        return len(targets)

    def _land(self, i: int, scratch: KVPool, pool: KVPool, page: int) -> None:
        self.started.append(i)
        if self.gates:
            assert self.gates[i].wait(GUARD_S), f"page {i} was never released"
        else:
            time.sleep(self.delay)
        pool.bytes_view()[page].copy_(scratch.bytes_view()[0])
        self.writes.append(page)

    def release_all(self) -> None:
        for gate in self.gates:
            gate.set()

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        return await self.inner.put(keys, pool, pages)

    async def aclose(self) -> None:
        await self.inner.aclose()


def random_pages(pool: KVPool, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size=(pool.num_pages, pool.layout.page_bytes))
    pool.bytes_view().copy_(torch.from_numpy(data.astype(np.uint8)))
    return data.astype(np.uint8)


async def wait_until(check: Any) -> None:
    with trio.fail_after(GUARD_S):
        while not check():
            await trio.sleep(0.005)


# ------------------------------------------------------------------ the service's executor


async def test_cancel_prefetch_stops_the_read_and_reports_only_pages_that_landed() -> None:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    config = DecodeConfig(l1_pages=16, l2_pages=16, page_size=PAGE)
    inner = MemoryStore(layout)
    source = KVPool(layout, PAGES)
    data = random_pages(source, seed=3)
    keys = tuple(range(1000, 1000 + PAGES))
    await inner.put(list(keys), source, range(PAGES))
    store = SlowStore(inner, gated=True)
    service = DecodeService(config, model, layout, store, TcpEngine())
    fed: list[ev.Event] = []
    service.feed.put = fed.append  # type: ignore[method-assign]  # no core: only the executor runs
    slots = (9, 3, 12, 0, 5, 7)
    l2 = service.l2.bytes_view().numpy()
    try:
        async with trio.open_nursery() as nursery:
            service._nursery = nursery
            execute = service.dispatch.handlers
            execute[cmd.Prefetch](cmd.Prefetch(41, "r", keys, slots))
            store.gates[0].set()
            store.gates[1].set()
            await wait_until(lambda: len(store.started) == 3)  # page 2 is being read
            execute[cmd.CancelPrefetch](cmd.CancelPrefetch(41))
            await trio.sleep(0.1)
            assert fed == []  # page 2's thread may still write: no PrefetchDone yet
            store.gates[2].set()  # it lands whole; the read stops before page 3
            await wait_until(lambda: fed)
            after_done = l2.copy()
            writes = len(store.writes)
            store.release_all()  # any read still going would now write at once
            await trio.sleep(0.2)
            execute[cmd.CancelPrefetch](cmd.CancelPrefetch(41))  # an ended op: ignored
            execute[cmd.CancelPrefetch](cmd.CancelPrefetch(999))  # an unknown one too
    finally:
        store.release_all()
    assert fed == [ev.PrefetchDone(fed[0].at, 41, 3)]
    assert store.started == [0, 1, 2] and len(store.writes) == writes == 3
    assert np.array_equal(l2, after_done)  # not a byte landed after PrefetchDone
    assert np.array_equal(l2[list(slots[:3])], data[:3])
    assert not l2[list(slots[3:])].any()
    assert service.restores.prefetches == {}


async def test_a_cancel_before_the_read_starts_reads_nothing() -> None:
    model = TinyModel(TinyConfig())
    layout = layout_for(model.config, PAGE)
    inner = MemoryStore(layout)
    await inner.put([1, 2], KVPool(layout, 2), [0, 1])
    store = SlowStore(inner)
    config = DecodeConfig(l1_pages=8, l2_pages=8, page_size=PAGE)
    service = DecodeService(config, model, layout, store, TcpEngine())
    fed: list[ev.Event] = []
    service.feed.put = fed.append  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        service.dispatch.handlers[cmd.Prefetch](cmd.Prefetch(5, "r", (1, 2), (0, 1)))
        service.dispatch.handlers[cmd.CancelPrefetch](cmd.CancelPrefetch(5))  # same tick
    assert fed == [ev.PrefetchDone(fed[0].at, 5, 0)] and store.started == store.writes == []


# ------------------------------------------------------------------ the file store


class GatedFileStore(FileStore):
    """Page reads block in the worker thread until their gate opens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gates = [threading.Event() for _ in range(PAGES)]
        self.reading: list[int] = []

    def _read_page(self, key: int, out: np.ndarray) -> str:
        i = key - 1000
        self.reading.append(i)
        assert self.gates[i].wait(GUARD_S)
        return super()._read_page(key, out)


async def test_a_cancelled_file_read_stops_at_a_page_boundary_inside_its_chunk(tmp_path: Path) -> None:
    layout = layout_for(TinyConfig(), PAGE)
    source = KVPool(layout, PAGES)
    data = random_pages(source, seed=5)
    keys = list(range(1000, 1000 + PAGES))
    store = GatedFileStore(tmp_path, layout)  # the default chunk holds every page: one thread call
    await store.put(keys, source, range(PAGES))
    dst = KVPool(layout, PAGES)
    reported: list[int] = []
    scope = trio.CancelScope()

    async def read() -> None:
        with scope:
            await store.get(keys, dst, range(PAGES), progress=reported.append)
            pytest.fail("a cancelled get returned")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            store.gates[0].set()
            await wait_until(lambda: len(store.reading) == 2)  # page 1 is being read
            scope.cancel()
            await trio.sleep(0.05)
            store.gates[1].set()
    finally:
        for gate in store.gates:
            gate.set()
    assert scope.cancelled_caught
    assert store.reading == [0, 1] and reported == [2]  # page 1 finished; page 2 was never begun
    rows = dst.bytes_view().numpy()
    assert np.array_equal(rows[:2], data[:2]) and not rows[2:].any()


# ------------------------------------------------------------------ through the node


@pytest.mark.slow
async def test_the_timeout_policy_cancels_a_slow_prefetch_and_the_node_goes_on(tmp_path: Path) -> None:
    delay = 0.5  # per page: the whole read would take PAGES * delay = 3 s
    async with node_pair(tmp_path, config={"prefetch_timeout_base": 0.2}) as pair:
        service, client = pair.service, pair.client
        first = prompt(1, PAGES * PAGE)
        reply = await turn(client, pair.ledger, "a", first)
        await client.evict(l1=1 << 30, l2=1 << 30)  # only the L3 files keep it
        await client.idle()
        store = service.store = SlowStore(service.store, delay=delay)
        prefetches: list[cmd.Prefetch] = []
        done: list[tuple[ev.PrefetchDone, int]] = []
        execute = service.dispatch.handlers
        start_prefetch = execute[cmd.Prefetch]

        def spy_prefetch(c: cmd.Prefetch) -> None:
            prefetches.append(c)
            start_prefetch(c)

        feed = service.feed.put

        def spy_feed(e: ev.Event, **kw: bool) -> None:
            if isinstance(e, ev.PrefetchDone):
                done.append((e, len(store.writes)))
            feed(e, **kw)

        execute[cmd.Prefetch] = spy_prefetch
        service.feed.put = spy_feed  # type: ignore[method-assign]
        began = trio.current_time()
        second = first + reply["tokens"] + prompt(2, 20)
        reply = await turn(client, pair.ledger, "b", second)  # waits for the node to be idle
        took = trio.current_time() - began
        assert reply["outcome"] == "finished", reply["reason"]
        (c,) = prefetches
        ((end, writes),) = done
        assert end.op == c.op and end.pages < len(c.keys) == PAGES
        assert writes == len(store.writes) == end.pages  # nothing landed after PrefetchDone
        assert took < (PAGES - 1) * delay, took  # the read was cut short
        a = reply["account"]
        held = (len(first) + 2) // PAGE * PAGE
        assert a["l3"] + a["fallback"] == held and a["fallback"] > 0
        await trio.sleep(delay * 2)
        assert len(store.writes) == writes
        await assert_nothing_held(service, client)
