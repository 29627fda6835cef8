"""The bounded L3 file store: capacity in bytes with segmented-LRU eviction shared by every
process on a directory, per-rank shards for tensor parallelism, and OS errors while evicting.

The stateful test runs the store against a plain-Python SLRU model: after every operation the
files on disk, the index's eviction order and the bytes accounted are the model's, and the
capacity holds.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from builders import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_runtime_storage import LAYOUT, filled_pool, rows

from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage import FileStore, StorageBackend, file_recovery
from hicache.runtime.storage import file_store as fs
from hicache.runtime.storage.page_index import INDEX_FILE
from hicache.runtime.storage.sizes import parse_size

LOGGER = "hicache.runtime.storage"
FILE = fs.HEADER_SIZE + LAYOUT.page_bytes  # bytes of one page file
SECRET = b"capacity-tests"


@pytest.fixture(autouse=True)
def _no_cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_CLUSTER_SECRET", raising=False)


def page_files(root: Path) -> dict[str, int]:
    """Page files directly under `root` (not its shards): key name -> size."""
    return {p.name.removesuffix(fs.SUFFIX): p.stat().st_size for p in root.glob(f"??/*{fs.SUFFIX}")}


def bounded(root: Path, pages: int, **kw: object) -> FileStore:
    return FileStore(root, LAYOUT, secret=SECRET, capacity_bytes=pages * FILE, **kw)


# -------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("64GiB", 64 << 30),
        ("512 MiB", 512 << 20),
        ("1.5TB", 1_500_000_000_000),
        ("2kb", 2000),
    ],
)
def test_sizes_take_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "12 parsecs", "1e9", "64 GiB!"])
def test_a_bad_size_says_what_was_expected(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size in bytes"):
        parse_size(text)


def test_the_node_flag_takes_units_and_is_passed_on() -> None:
    import argparse

    from hicache.runtime import cache_flags

    parser = argparse.ArgumentParser(exit_on_error=False)
    cache_flags.add_flags(parser)
    args = parser.parse_args(["--storage-dir", "l3", "--storage-capacity", "64GiB"])
    assert args.storage_capacity == 64 << 30
    out = cache_flags.forwarded(args)  # what `hicache serve` gives the decode node it starts
    assert out[out.index("--storage-capacity") + 1] == str(64 << 30)
    assert parser.parse_args([]).storage_capacity == 0  # unbounded, as before
    with pytest.raises(argparse.ArgumentError, match="--storage-capacity.*expected a size in bytes"):
        parser.parse_args(["--storage-capacity", "lots"])


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"capacity_bytes": 1.5}, "capacity_bytes"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "rank": 2}, "rank"),
        ({"rank": 1}, "rank"),
    ],
)
def test_bad_store_settings_are_named(tmp_path: Path, kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"FileStore.{field}: expected"):
        FileStore(tmp_path, LAYOUT, **kw)


async def test_zero_capacity_is_unbounded_and_keeps_no_index(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=0)
    assert await store.put(list(range(8)), filled_pool(8), range(8)) == []
    assert len(page_files(tmp_path)) == 8 and not (tmp_path / INDEX_FILE).exists()
    await store.aclose()


# ------------------------------------------------------------------------------ the SLRU model


class SLRU:
    """The policy as written in `page_index.py`, on keys of one page size."""

    def __init__(self, pages: int, protected_fraction: float) -> None:
        self.capacity = pages * FILE
        self.protected_capacity = int(self.capacity * protected_fraction)
        self.probation: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.protected: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.probation or key in self.protected

    def order(self) -> list[int]:
        return [*self.probation, *self.protected]

    def put(self, keys: list[int]) -> list[int]:
        evicted: list[int] = []
        for key in keys:
            if key in self:
                continue
            while (len(self.probation) + len(self.protected) + 1) * FILE > self.capacity:
                victim = self.probation if self.probation else self.protected
                evicted.append(victim.popitem(last=False)[0])
            self.probation[key] = None
        return [i for i, key in enumerate(keys) if key not in self]

    def use(self, keys: list[int]) -> None:
        for key in keys:
            if key in self.probation:
                del self.probation[key]
            if key in self:
                self.protected.move_to_end(key)
            else:
                self.protected[key] = None
        while len(self.protected) * FILE > self.protected_capacity:
            self.probation[self.protected.popitem(last=False)[0]] = None

    def prefix(self, keys: list[int]) -> int:
        for i, key in enumerate(keys):
            if key not in self:
                return i
        return len(keys)


POOL_PAGES = 6
KEY_SPACE = list(range(0x100, 0x100 + 14))


def content(key: int) -> np.ndarray:
    """The bytes every writer stores under `key`."""
    return np.random.default_rng(key).integers(0, 256, size=LAYOUT.page_bytes, dtype=np.uint8)


def pool_of(keys: list[int]) -> KVPool:
    pool = KVPool(LAYOUT, max(1, len(keys)))
    if keys:
        pool.bytes_view()[: len(keys)].copy_(torch.from_numpy(np.stack([content(k) for k in keys])))
    return pool


class BoundedStoreMachine(RuleBasedStateMachine):
    """Puts, gets and existence queries on a bounded store and on the model side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-l3-cap-"))
        self.store: FileStore | None = None
        self.next_scan = 0x10000  # keys no other rule uses

    def teardown(self) -> None:
        if self.store is not None:
            trio.run(self.store.aclose)
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(pages=st.integers(1, 7), fraction=st.sampled_from([0.0, 0.5, 0.8]))
    def open(self, pages: int, fraction: float) -> None:
        self.store = bounded(self.dir, pages, protected_fraction=fraction)
        self.model = SLRU(pages, fraction)

    @rule(keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=POOL_PAGES))
    def put(self, keys: list[int]) -> None:
        assert self.store is not None
        missing = trio.run(self.store.put, keys, pool_of(keys), range(len(keys)))
        assert missing == self.model.put(keys)

    @rule(keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=POOL_PAGES, unique=True))
    def get(self, keys: list[int]) -> None:
        assert self.store is not None
        pool = KVPool(LAYOUT, POOL_PAGES)
        got = trio.run(self.store.get, keys, pool, range(len(keys)))
        want = self.model.prefix(keys)
        assert got == want
        for i in range(got):
            assert np.array_equal(rows(pool)[i], content(keys[i]))
        self.model.use(keys[:got])

    @rule(keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=POOL_PAGES, unique=True))
    def exists(self, keys: list[int]) -> None:
        assert self.store is not None
        got = trio.run(self.store.exists, keys)
        assert got == self.model.prefix(keys)
        self.model.use(keys[:got])

    @rule(length=st.integers(1, 3 * POOL_PAGES))
    def scan(self, length: int) -> None:
        """New pages written once: the pages read since they were written (protected) stay."""
        assert self.store is not None
        reused = list(self.model.protected)
        keys = list(range(self.next_scan, self.next_scan + length))
        self.next_scan += length
        for start in range(0, length, POOL_PAGES):
            batch = keys[start : start + POOL_PAGES]
            missing = trio.run(self.store.put, batch, pool_of(batch), range(len(batch)))
            assert missing == self.model.put(batch)
        assert all(self.store.path(k).exists() for k in reused)

    @invariant()
    def disk_index_and_model_agree(self) -> None:
        if self.store is None:
            return
        on_disk = page_files(self.dir)
        assert sum(on_disk.values()) <= self.store.capacity_bytes
        assert sorted(on_disk) == sorted(f"{k:016x}" for k in self.model.order())
        assert self.store.used_bytes() == sum(on_disk.values())
        entries = self.store._index.entries()
        assert [int(name, 16) for name, _, _ in entries] == self.model.order()
        assert [p for _, _, p in entries] == [k in self.model.protected for k in self.model.order()]


BoundedStoreMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)
test_bounded_store_follows_the_slru_model = pytest.mark.slow(BoundedStoreMachine.TestCase)


# ------------------------------------------------------------------------------- the policy


async def test_a_one_off_scan_does_not_flush_reused_pages(tmp_path: Path) -> None:
    store = bounded(tmp_path, 10)
    hot = list(range(1, 5))
    assert await store.put(hot, pool_of(hot), range(4)) == []
    assert await store.get(hot, KVPool(LAYOUT, 4), range(4)) == 4  # used again: protected
    for start in range(100, 160, 6):  # a scan of 60 new pages, written once, never read
        scan = list(range(start, start + 6))
        await store.put(scan, pool_of(scan), range(6))
        assert sum(page_files(tmp_path).values()) <= store.capacity_bytes
    assert await store.exists(hot) == 4
    assert store.stats.evicted == 4 + 60 - 10
    plain = FileStore(
        tmp_path / "lru", LAYOUT, secret=SECRET, capacity_bytes=10 * FILE, protected_fraction=0.0
    )
    await plain.put(hot, pool_of(hot), range(4))
    await plain.get(hot, KVPool(LAYOUT, 4), range(4))
    for start in range(100, 160, 6):
        scan = list(range(start, start + 6))
        await plain.put(scan, pool_of(scan), range(6))
    assert await plain.exists(hot[:1]) == 0  # without a protected segment, plain LRU: flushed
    await store.aclose()
    await plain.aclose()


async def test_a_batch_larger_than_the_capacity_reports_the_pages_it_evicted_again(tmp_path: Path) -> None:
    store = bounded(tmp_path, 3)
    keys = list(range(10, 16))
    assert await store.put(keys, pool_of(keys), range(6)) == [0, 1, 2]
    assert await store.exists(keys[3:]) == 3 and await store.exists(keys[:1]) == 0
    assert store.stats.errors == 0


async def test_a_page_larger_than_the_capacity_is_refused_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=FILE - 1)
    assert await store.put([1, 2], pool_of([1, 2]), range(2)) == [0, 1]
    assert page_files(tmp_path) == {} and store.stats.errors == 0
    assert [r for r in caplog.records if "larger than the capacity" in r.getMessage()]
    await store.aclose()


async def test_reopening_adopts_files_it_did_not_index_and_evicts_down(tmp_path: Path) -> None:
    old = FileStore(tmp_path, LAYOUT, secret=SECRET)  # today's unbounded store: no index
    keys = list(range(1, 9))
    await old.put(keys, pool_of(keys), range(8))
    for i, key in enumerate(keys):  # oldest first by mtime
        os.utime(old.path(key), (1_000_000 + i, 1_000_000 + i))
    store = bounded(tmp_path, 5)
    assert store.stats.evicted == 3 and sorted(page_files(tmp_path)) == [f"{k:016x}" for k in keys[3:]]
    assert store.used_bytes() == 5 * FILE
    assert await store.get(keys[3:], KVPool(LAYOUT, 5), range(5)) == 5  # still readable
    await store.aclose()
    store.path(keys[3]).unlink()  # a file gone behind the index's back: dropped at the next open
    again = bounded(tmp_path, 5)
    assert again.used_bytes() == 4 * FILE
    await again.aclose()


async def test_a_damaged_index_is_rebuilt_from_the_page_files(tmp_path: Path) -> None:
    store = bounded(tmp_path, 4)
    await store.put([1, 2], pool_of([1, 2]), range(2))
    await store.aclose()
    for suffix in ("-wal", "-shm"):
        (tmp_path / (INDEX_FILE + suffix)).unlink(missing_ok=True)
    (tmp_path / INDEX_FILE).write_bytes(b"not a database at all" * 100)
    again = bounded(tmp_path, 4)
    assert again.used_bytes() == 2 * FILE and await again.exists([1, 2]) == 2
    assert await again.put([3], pool_of([3]), range(1)) == []
    await again.aclose()


async def test_a_store_opened_without_a_capacity_joins_the_directory_s(tmp_path: Path) -> None:
    owner = bounded(tmp_path, 3)
    await owner.put([1, 2, 3], pool_of([1, 2, 3]), range(3))
    reader = FileStore(tmp_path, LAYOUT, secret=SECRET)  # e.g. a prefill node reading L3
    assert reader.capacity_bytes == 3 * FILE
    assert await reader.get([1], KVPool(LAYOUT, 1), [0]) == 1  # a use: 1 is protected now
    assert await owner.put([4, 5], pool_of([4, 5]), range(2)) == []
    assert await reader.exists([1]) == 1 and await reader.exists([2]) == 0
    assert await reader.put([6], pool_of([6]), range(1)) == []  # its writes evict too
    assert sum(page_files(tmp_path).values()) <= 3 * FILE
    unbounded = FileStore(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=0)
    assert unbounded.capacity_bytes == 0 and unbounded.used_bytes() == 0
    for store in (owner, reader, unbounded):
        await store.aclose()
    empty = FileStore(tmp_path / "new", LAYOUT, secret=SECRET)  # nothing to join: as before
    assert empty.capacity_bytes == 0 and not (tmp_path / "new" / INDEX_FILE).exists()
    await empty.aclose()


async def test_a_tampered_index_neither_stops_the_store_nor_reaches_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    store = bounded(root, 3)
    await store.put([1, 2], pool_of([1, 2]), range(2))
    await store.aclose()
    outside = tmp_path / "precious.kvpage"
    outside.write_bytes(b"not the store's")
    db = sqlite3.connect(root / INDEX_FILE, isolation_level=None)
    db.execute("INSERT INTO pages VALUES ('../../precious', 640, 0, -1)")  # oldest: first victim
    db.execute("INSERT INTO pages VALUES (x'00ff', 'big', 0, -2)")
    db.execute("UPDATE meta SET v = 99999999 WHERE k = 'used'")
    db.close()
    again = bounded(root, 3)
    for key in (3, 4, 5):
        assert await again.put([key], pool_of([key]), range(1)) == []
    assert outside.read_bytes() == b"not the store's"
    assert sum(page_files(root).values()) <= 3 * FILE
    assert await again.get([4, 5], KVPool(LAYOUT, 2), range(2)) == 2
    db = sqlite3.connect(root / INDEX_FILE, isolation_level=None)
    db.execute("DELETE FROM meta WHERE k = 'used'")  # what no version writes
    db.close()
    assert await again.put([6], pool_of([6]), range(1)) == [0]  # an index error: not written
    assert await again.get([5], KVPool(LAYOUT, 1), [0]) == 1  # reads go on
    await again.aclose()


# ------------------------------------------------------------------------------ shards for TP


async def test_each_rank_reads_only_its_own_shard(tmp_path: Path) -> None:
    ranks = [FileStore(tmp_path, LAYOUT, secret=SECRET, rank=r, tp_size=2) for r in range(2)]
    whole = FileStore(tmp_path, LAYOUT, secret=SECRET)  # tp_size 1: today's layout under root
    pools = [filled_pool(2, seed=r) for r in range(3)]
    for store, pool in zip([*ranks, whole], pools, strict=True):
        assert await store.put([7], pool, [0]) == []
    assert ranks[1].path(7) == tmp_path / "tp2" / "rank1" / "00" / f"{7:016x}{fs.SUFFIX}"
    assert whole.path(7) == tmp_path / "00" / f"{7:016x}{fs.SUFFIX}"
    for store, pool in zip([*ranks, whole], pools, strict=True):
        dst = KVPool(LAYOUT, 1)
        assert await store.get([7], dst, [0]) == 1
        assert np.array_equal(rows(dst)[0], rows(pool)[0])
    # One rank's page put where another's belongs reads as a miss: the MAC covers the shard.
    files = {id(store): store.path(7).read_bytes() for store in [*ranks, whole]}
    for src, dst_store in [(ranks[1], ranks[0]), (whole, ranks[0]), (ranks[0], whole)]:
        dst_store.path(7).write_bytes(files[id(src)])
        assert await dst_store.get([7], KVPool(LAYOUT, 1), [0]) == 0
    await whole.aclose()
    for store in ranks:
        await store.aclose()


async def test_shards_keep_separate_capacities(tmp_path: Path) -> None:
    ranks = [bounded(tmp_path, 2, rank=r, tp_size=2) for r in range(2)]
    keys = [1, 2, 3]
    for store in ranks:
        assert await store.put(keys, pool_of(keys), range(3)) == [0]  # its own first page evicted
        assert store.stats.evicted == 1 and store.used_bytes() == 2 * FILE
    assert (tmp_path / "tp2" / "rank0" / INDEX_FILE).exists() and not (tmp_path / INDEX_FILE).exists()
    for store in ranks:
        await store.aclose()


# ----------------------------------------------------------------------- errors while evicting


async def test_a_victim_vanishing_under_the_evictor_is_no_error(tmp_path: Path) -> None:
    store = bounded(tmp_path, 2)
    await store.put([1, 2], pool_of([1, 2]), range(2))
    store.path(1).unlink()  # another process, or an operator, removed it
    assert await store.put([3], pool_of([3]), range(1)) == []
    assert store.stats.errors == 0 and store.stats.evicted == 1
    assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 0
    assert sorted(page_files(tmp_path)) == [f"{2:016x}", f"{3:016x}"]
    await store.aclose()


async def test_a_refused_eviction_leaves_the_page_unwritten_and_the_node_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = bounded(tmp_path, 2)
    await store.put([1, 2], pool_of([1, 2]), range(2))

    def refuse(name: str, folder: int) -> None:
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(file_recovery, "_unlink", refuse)
    assert await store.put([3, 4], pool_of([3, 4]), range(2)) == [0, 1]
    assert store.stats.errors == 2 and not list(tmp_path.rglob("*.tmp"))
    assert sum(page_files(tmp_path).values()) <= store.capacity_bytes
    assert len([r for r in caplog.records if "EACCES" in r.getMessage()]) == 1
    dst = KVPool(LAYOUT, 2)
    assert await store.get([1, 2], dst, range(2)) == 2  # what is there still reads
    monkeypatch.undo()
    assert await store.put([3], pool_of([3]), range(1)) == []  # and writes resume
    assert store.used_bytes() == 2 * FILE == sum(page_files(tmp_path).values())
    await store.aclose()


async def test_an_index_that_cannot_be_opened_stops_writes_not_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    plain = FileStore(tmp_path, LAYOUT, secret=SECRET)
    await plain.put([1], pool_of([1]), range(1))
    (tmp_path / INDEX_FILE).symlink_to(tmp_path / "elsewhere")
    store = bounded(tmp_path, 4)
    assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 1
    assert await store.put([2], pool_of([2]), range(1)) == [0]
    assert not (tmp_path / "elsewhere").exists()
    assert [r for r in caplog.records if "ELOOP" in r.getMessage()]
    await store.aclose()


async def test_a_busy_index_costs_recency_not_hits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=4 * FILE)
    await store.put([1], pool_of([1]), range(1))
    store._index._db.execute("PRAGMA busy_timeout = 0")
    other = sqlite3.connect(tmp_path / INDEX_FILE, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the lock
    try:
        assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 1
        assert await store.put([2], pool_of([2]), range(1)) == [0]
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [r for r in caplog.records if "recency" in r.getMessage()]
    assert await store.put([2], pool_of([2]), range(1)) == []
    await store.aclose()


# ----------------------------------------------------------------------------- a decode node


@pytest.mark.slow
async def test_a_decode_node_on_a_bounded_folder_serves_every_turn_within_the_capacity(
    tmp_path: Path,
) -> None:
    """The node's store (opened without a capacity) joins the one recorded in the folder; a
    conversation read again survives the new ones written after it, and every turn is exact."""
    from node_pair import PAGE, assert_nothing_held, node_pair, prompt, turn

    from hicache.runtime.model.llama import TinyConfig, TinyModel
    from hicache.runtime.nodes import layout_for

    layout = layout_for(TinyModel(TinyConfig()).config, PAGE)
    page_file = fs.HEADER_SIZE + layout.page_bytes
    capacity = 24 * page_file  # each conversation's first turn writes 6 pages
    await FileStore(tmp_path / "l3", layout, capacity_bytes=capacity).aclose()
    async with node_pair(tmp_path) as pair:
        client, ledger = pair.client, pair.ledger
        assert pair.service.store.capacity_bytes == capacity
        hot = prompt(1)
        reply = await turn(client, ledger, "hot-0", hot)
        for i in range(4):  # more new pages than the capacity between two reads of the hot ones
            await client.evict(l1=1 << 30, l2=1 << 30)
            await client.idle()
            reply = await turn(client, ledger, f"hot-{i + 1}", hot)
            assert reply["outcome"] == "finished" and reply["account"]["l3"] > 0, reply
            for j in range(5):
                cold = await turn(client, ledger, f"cold-{i}-{j}", prompt(100 + 5 * i + j))
                assert cold["outcome"] == "finished", cold
        assert sum(page_files(tmp_path / "l3").values()) <= capacity
        assert pair.service.store.stats.evicted > 0
        await assert_nothing_held(pair.service, client)


# ------------------------------------------------------------------------- two real processes

WORKER = textwrap.dedent(
    """
    import json, pathlib, sys, time
    import numpy as np, torch, trio
    from hicache.runtime.kv.kv_layout import KVLayout
    from hicache.runtime.kv.kv_pool import KVPool
    from hicache.runtime.storage import FileStore

    root, capacity, first, count, shared = sys.argv[1], *map(int, sys.argv[2:6])
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")

    def content(key):
        return np.random.default_rng(key).integers(0, 256, size=layout.page_bytes, dtype=np.uint8)

    async def main():
        store = FileStore(root, layout, secret=b"capacity-tests", capacity_bytes=capacity)
        pathlib.Path(root, f".ready-{first}").touch()  # start together, whatever the import took
        while len(list(pathlib.Path(root).glob(".ready-*"))) < 2:
            time.sleep(0.01)
        src, dst = KVPool(layout, 4), KVPool(layout, 4)
        wrong = 0
        for i in range(count):
            # Own keys, and keys the other process writes too (the same bytes by construction).
            keys = [first + 2 * i, first + 2 * i + 1, shared + i % 16]
            src.bytes_view()[:3].copy_(torch.from_numpy(np.stack([content(k) for k in keys])))
            await store.put(keys, src, range(3))
            # Read pages the other process may be evicting right now: whole or a miss.
            probe = [shared + (i * 7) % 16, (first ^ 0x100000) + 2 * (i // 2)]
            for key in probe:
                if await store.get([key], dst, [0]) == 1:
                    wrong += not np.array_equal(dst.bytes_view().numpy()[0], content(key))
        print(json.dumps({"wrong": wrong, "corrupt": store.stats.corrupt, "errors": store.stats.errors,
                          "hits": store.stats.hits, "evicted": store.stats.evicted}))
        await store.aclose()

    trio.run(main)
    """
)


@pytest.mark.process
def test_two_processes_share_one_directory_and_its_capacity(tmp_path: Path) -> None:
    capacity = 24 * FILE
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(tmp_path), str(capacity), str(first), "150", str(0x900000)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in (0x100000, 0x000000)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        assert result["wrong"] == 0 and result["corrupt"] == 0 and result["errors"] == 0, results
    assert sum(r["hits"] for r in results) > 0 and sum(r["evicted"] for r in results) > 0, results
    on_disk = page_files(tmp_path)
    assert sum(on_disk.values()) <= capacity
    assert not list(tmp_path.rglob("*.tmp"))
    index = sqlite3.connect(tmp_path / INDEX_FILE)
    indexed = dict(index.execute("SELECT name, size FROM pages"))
    used = index.execute("SELECT v FROM meta WHERE k = 'used'").fetchone()[0]
    index.close()
    assert indexed == on_disk and used == sum(on_disk.values())


OPENER = textwrap.dedent(
    """
    import json, pathlib, sys, time
    from hicache.runtime.kv.kv_layout import KVLayout
    from hicache.runtime.storage import FileStore

    root, me, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    indexed = []
    for r in range(rounds):
        where = pathlib.Path(root, f"round-{r}")
        where.mkdir(exist_ok=True)
        (where / f".ready-{me}").touch()
        while len(ready := list(where.glob(".ready-*"))) < 2:
            time.sleep(0.001)
        start = max(f.stat().st_mtime for f in ready) + 0.05  # the same moment for both
        while time.time() < start:
            pass
        store = FileStore(where / "pages", layout, secret=b"capacity-tests", capacity_bytes=1 << 20)
        indexed.append(store._index is not None)
    print(json.dumps(indexed))
    """
)


@pytest.mark.process
def test_two_processes_opening_a_new_directory_at_once_both_keep_its_capacity(tmp_path: Path) -> None:
    """Switching a new index file to WAL answers "database is locked" at once (no busy wait) to
    the second of two processes that open it together; that one must wait and open it, not
    fall back to reading only (it would then write nothing for its whole life)."""
    rounds = 8
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(tmp_path), me, str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in ("a", "b")
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == [True] * rounds, err


# ------------------------------------------------------------------- NIXL's POSIX backend


@pytest.fixture
def nixl_store_class() -> type[FileStore]:
    pytest.importorskip(
        "nixl._api", reason="NixlFileStore needs the nixl package (the `nixl` extra)", exc_type=ImportError
    )
    from hicache.runtime.storage.nixl_store import NixlFileStore

    return NixlFileStore


async def test_nixl_store_keeps_the_file_format_and_the_capacity(
    tmp_path: Path, nixl_store_class: type[FileStore]
) -> None:
    store = nixl_store_class(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=3 * FILE)
    assert isinstance(store, StorageBackend)
    keys = [1, 2, 3, 4]
    assert await store.put(keys, pool_of(keys), range(4)) == [0]  # evicted again for the fourth
    assert store.stats.evicted == 1 and sum(page_files(tmp_path).values()) <= 3 * FILE
    dst = KVPool(LAYOUT, 3)
    assert await store.get(keys[1:], dst, range(3)) == 3
    for i, key in enumerate(keys[1:]):
        assert np.array_equal(rows(dst)[i], content(key))
    plain = FileStore(tmp_path, LAYOUT, secret=SECRET)  # the same files read without NIXL
    assert await plain.get(keys[1:], KVPool(LAYOUT, 3), range(3)) == 3
    await plain.put([9], pool_of([9]), range(1))  # and a page plain wrote reads through NIXL
    assert await store.get([9], dst, [0]) == 1 and np.array_equal(rows(dst)[0], content(9))
    assert await store.exists([2]) == 0  # plain joined the capacity: its page evicted one
    with store.path(4).open("r+b") as f:  # a flipped payload bit is a miss, as for FileStore
        f.seek(fs.HEADER_SIZE + 5)
        byte = f.read(1)
        f.seek(fs.HEADER_SIZE + 5)
        f.write(bytes([byte[0] ^ 1]))
    assert await store.get([4], dst, [0]) == 0 and store.stats.corrupt == 1
    await plain.aclose()
    await store.aclose()


async def test_a_failing_nixl_transfer_is_a_miss_not_a_crash(
    tmp_path: Path, nixl_store_class: type[FileStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = nixl_store_class(tmp_path, LAYOUT, secret=SECRET)
    await store.put([1], pool_of([1]), range(1))

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(store._agent, "initialize_xfer", broken)
    assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 0
    assert await store.put([2], pool_of([2]), range(1)) == [0]
    assert store.stats.errors == 2 and not list(tmp_path.rglob("*.tmp"))
    await store.aclose()
