"""L3 backends: the file store (real files) and the in-memory store, against one contract."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
import trio
from builders import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage import FileStore, MemoryStore, StorageBackend, key_name, key_value
from hicache.runtime.storage.file_recovery import temp_name
from hicache.runtime.storage.file_store import KEY_FILE
from hicache.runtime.storage.page_file import AAD, HEADER, HEADER_SIZE, MAGIC

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")  # 512-byte pages
KEYS = [0x0123456789ABCDEF, 7, 2**64 - 1, 0xFEDCBA9876543210, 42]


def filled_pool(num_pages: int = 8, seed: int = 0) -> KVPool:
    pool = KVPool(LAYOUT, num_pages, name="l2")
    data = np.random.default_rng(seed).integers(0, 256, size=(num_pages, LAYOUT.page_bytes), dtype=np.uint8)
    pool.bytes_view().copy_(torch.from_numpy(data))
    return pool


def rows(pool: KVPool) -> np.ndarray:
    return pool.bytes_view().numpy().copy()


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(params=["file", "memory"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StorageBackend]:
    backend: StorageBackend = (
        FileStore(tmp_path / "l3", LAYOUT) if request.param == "file" else MemoryStore(LAYOUT)
    )
    assert isinstance(backend, StorageBackend)
    yield backend
    await backend.aclose()


# --------------------------------------------------------------------------------------- keys


def test_key_names() -> None:
    assert key_name(0) == "0" * 16
    assert key_name(2**64 - 1) == "f" * 16
    assert key_name("ABCDEF0123456789") == "abcdef0123456789"
    assert key_value("00000000000000ff") == 255
    assert key_name(np.uint64(2**63)) == "8000000000000000"


@pytest.mark.parametrize(
    "bad",
    ["../x", "/etc/passwd", -1, 2**64, True, False, np.bool_(True), "abc", "0123456789abcdeg", 1.0, None],
)
def test_invalid_keys_are_named(bad: object) -> None:
    with pytest.raises(ValueError, match="page key"):
        key_name(bad)


# ----------------------------------------------------------------------------------- contract


async def test_round_trip_is_bit_exact(store: StorageBackend) -> None:
    src = filled_pool(seed=1)
    await store.put(KEYS, src, [3, 0, 7, 1, 5])
    dst = KVPool(LAYOUT, 8)
    assert await store.get(KEYS, dst, [0, 1, 2, 3, 4]) == 5
    assert np.array_equal(rows(dst)[:5], rows(src)[[3, 0, 7, 1, 5]])
    assert not rows(dst)[5:].any()
    assert store.stats.hits == 5 and store.stats.written == 5
    assert store.stats.bytes_read == store.stats.bytes_written == 5 * LAYOUT.page_bytes


async def test_exists_counts_consecutive_hits_only(store: StorageBackend) -> None:
    src = filled_pool()
    await store.put([KEYS[0], KEYS[1], KEYS[3]], src, [0, 1, 2])
    assert await store.exists(KEYS) == 2
    assert await store.exists(KEYS[2:]) == 0
    assert await store.exists([KEYS[3], KEYS[0]]) == 2
    assert await store.exists([]) == 0
    assert await store.exists([key_name(KEYS[0])]) == 1  # hex spelling of the same key


async def test_get_stops_at_the_first_miss(store: StorageBackend) -> None:
    src = filled_pool(seed=2)
    await store.put([KEYS[0], KEYS[1], KEYS[3]], src, [0, 1, 2])
    dst = KVPool(LAYOUT, 8)
    dst.bytes_view().fill_(0xAB)
    assert await store.get(KEYS, dst, [4, 5, 6, 7, 0]) == 2
    after = rows(dst)
    assert np.array_equal(after[[4, 5]], rows(src)[[0, 1]])
    assert (after[[6, 7, 0]] == 0xAB).all()  # nothing after the miss was read, KEYS[3] included
    assert store.stats.misses == 1


async def test_existing_keys_are_skipped(store: StorageBackend) -> None:
    first, second = filled_pool(seed=3), filled_pool(seed=4)
    await store.put(KEYS[:2], first, [0, 1])
    await store.put(KEYS[:3], second, [0, 1, 2])
    assert store.stats.skipped == 2 and store.stats.written == 3
    dst = KVPool(LAYOUT, 8)
    assert await store.get(KEYS[:3], dst, [0, 1, 2]) == 3
    assert np.array_equal(rows(dst)[:2], rows(first)[:2])
    assert np.array_equal(rows(dst)[2], rows(second)[2])


async def test_batch_validation(store: StorageBackend) -> None:
    pool = filled_pool()
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        await store.put(KEYS[:2], pool, [0])
    with pytest.raises(ValueError, match="repeats page 1"):
        await store.get(KEYS[:2], pool, [1, 1])
    with pytest.raises(IndexError, match="out of range"):
        await store.get(KEYS[:1], pool, [8])
    other = KVPool(KVLayout(2, 2, 8, 4, "float32"), 2)
    with pytest.raises(ValueError, match="has layout"):
        await store.put(KEYS[:1], other, [0])
    with pytest.raises(ValueError, match="single value"):
        await store.exists("0123456789abcdef")


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", -1, 2**64, True, "abc"])
async def test_invalid_keys_touch_nothing(bad: object, tmp_path: Path) -> None:
    root = tmp_path / "l3"
    stores: list[StorageBackend] = [FileStore(root, LAYOUT), MemoryStore(LAYOUT)]
    pool = filled_pool()
    before = tree(tmp_path)
    for backend in stores:
        for call in (
            backend.exists([KEYS[0], bad]),
            backend.get([KEYS[0], bad], pool, [0, 1]),
            backend.put([KEYS[0], bad], pool, [0, 1]),
        ):
            with pytest.raises(ValueError, match="page key"):
                await call
    assert tree(tmp_path) == before
    assert not (tmp_path / "x").exists()
    assert len(stores[1]) == 0  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- file store


HEADER_INTS = {
    "version": 1,
    "header_size": 2,
    "shard_rank": 3,
    "shard_count": 4,
    "key": 5,
    "shape": 8,
    "length": 12,
}
HEADER_BYTES = {
    "magic": (0, b"HICKVPG1"),
    "dtype": (11, b"float16"),
    "nonce": (13, bytes(12)),
    "tag": (14, bytes(16)),
}
RESIZED = {"truncated": -1, "header_only": -LAYOUT.page_bytes, "extra_byte": +1}


def damage(path: Path, how: str) -> None:
    """Damage one page file: resize it, flip a payload bit, or change one header field (the tag
    is left as it was, except for "tag", which is zeroed)."""
    data = bytearray(path.read_bytes())
    header = list(HEADER.unpack(bytes(data[:HEADER_SIZE])))
    if how in RESIZED:
        data = data + b"\0" if RESIZED[how] > 0 else data[: len(data) + RESIZED[how]]
    elif how == "payload_bit":
        data[HEADER_SIZE + 100] ^= 0x10
    elif how in HEADER_INTS:
        header[HEADER_INTS[how]] ^= 1
    else:
        index, value = HEADER_BYTES[how]
        header[index] = value
    if how in HEADER_INTS or how in HEADER_BYTES:
        data[:HEADER_SIZE] = HEADER.pack(*header)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", [*RESIZED, "payload_bit", *HEADER_INTS, *HEADER_BYTES])
@pytest.mark.parametrize("delete", [False, True])
async def test_a_damaged_page_reads_as_a_miss(how: str, delete: bool, tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT, delete_corrupt=delete)
    src = filled_pool(seed=5)
    await store.put(KEYS, src, [0, 1, 2, 3, 4])
    damage(store.path(KEYS[2]), how)

    # `exists` only looks at file sizes; `get` verifies, so exists-then-get never yields bad data
    assert await store.exists(KEYS) == (2 if how in RESIZED else 5)
    dst = KVPool(LAYOUT, 8)
    dst.bytes_view().fill_(0x5A)
    assert await store.get(KEYS, dst, range(5)) == 2
    assert np.array_equal(rows(dst)[:2], rows(src)[:2])
    assert (rows(dst)[3:5] == 0x5A).all()  # nothing past the damaged page was read
    assert store.stats.corrupt == 1 and store.stats.misses == 0 and store.stats.hits == 2
    assert store.path(KEYS[2]).exists() is not delete


async def test_a_page_file_under_another_key_is_rejected(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT)
    src = filled_pool(seed=6)
    await store.put(KEYS[:2], src, [0, 1])
    target = store.path(KEYS[2])
    target.parent.mkdir(exist_ok=True)
    shutil.copy(store.path(KEYS[1]), target)  # a valid page, but not this key's
    dst = KVPool(LAYOUT, 8)
    assert await store.exists(KEYS[:3]) == 3
    assert await store.get(KEYS[:3], dst, [0, 1, 2]) == 2
    assert store.stats.corrupt == 1


async def test_layout_of_another_model_is_rejected(tmp_path: Path) -> None:
    await FileStore(tmp_path, LAYOUT).put(KEYS[:1], filled_pool(), [0])
    other = KVLayout(layers=1, kv_heads=4, head_dim=8, page_size=4, dtype="bfloat16")  # same page bytes
    assert other.page_bytes == LAYOUT.page_bytes
    store = FileStore(tmp_path, other)
    assert await store.get(KEYS[:1], KVPool(other, 1), [0]) == 0
    assert store.stats.corrupt == 1


async def test_file_format(tmp_path: Path) -> None:
    """The format page_file.py documents, opened here with the documented derivation alone."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

    store = FileStore(tmp_path, LAYOUT, secret=b"cluster-secret-of-tests")
    src = filled_pool(seed=8)
    await store.put([KEYS[0]], src, [3])
    path = store.path(KEYS[0])
    assert path == tmp_path / "01" / "0123456789abcdef.kvpage"
    data = path.read_bytes()
    assert len(data) == HEADER_SIZE + LAYOUT.page_bytes
    payload = rows(src)[3]
    magic, version, size, rank, count, key, *rest = HEADER.unpack(data[:HEADER_SIZE])
    assert (magic, version, size, rank, count, key) == (MAGIC, 3, 128, 0, 0, KEYS[0])  # unsharded
    assert tuple(rest[:5]) == LAYOUT.page_shape and rest[5].rstrip(b"\0") == b"bfloat16"
    assert rest[6] == LAYOUT.page_bytes
    nonce, tag = rest[7], rest[8]
    assert data[80:96] == bytes(16) and data[112:128] == bytes(16)  # reserved
    assert data[HEADER_SIZE:] != payload.tobytes()  # sealed, not the KV itself
    root = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"hicache-l3-pages", info=b"hicache l3 page encryption v3"
    ).derive(b"cluster-secret-of-tests")
    info = b"hicache-l3-page" + struct.pack("<QHH", KEYS[0], 0, 0)
    page_key = HKDFExpand(algorithm=hashes.SHA256(), length=32, info=info).derive(root)
    plain = AESGCM(page_key).decrypt(nonce, data[HEADER_SIZE:] + tag, data[: AAD.size])
    assert plain == payload.tobytes()


def gone_pid() -> int:
    """The pid of a child that has exited and been reaped: no process has it (for now)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


async def test_leftover_temporary_files_are_removed_at_start(tmp_path: Path) -> None:
    await FileStore(tmp_path, LAYOUT).put(KEYS[:1], filled_pool(), [0])
    sub = tmp_path / "01"
    dead = gone_pid()
    leftovers = [sub / temp_name(KEYS[0], pid=dead), tmp_path / "ff" / temp_name(2**64 - 1, pid=dead)]
    (tmp_path / "ff").mkdir()
    keep = [
        sub / "notes.txt",
        sub / f".{key_name(KEYS[0])}.a1b2c3.tmp",  # no writer named: it may be alive
        sub / temp_name(KEYS[0]),  # this process's: alive
        tmp_path / temp_name(0, pid=dead),
        tmp_path / "zz" / temp_name(0, pid=dead),
    ]
    (tmp_path / "zz").mkdir()
    for p in leftovers + keep:
        p.write_bytes(b"partial")
    store = FileStore(tmp_path, LAYOUT)
    assert store.leftovers_removed == 2
    assert not any(p.exists() for p in leftovers)
    assert all(p.exists() for p in keep)  # only files this store could have written are removed
    assert await store.get(KEYS[:1], KVPool(LAYOUT, 1), [0]) == 1


async def test_a_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path, LAYOUT, fsync=True)

    def broken_replace(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "disk failed")

    monkeypatch.setattr(os, "replace", broken_replace)
    assert await store.put(KEYS[:2], filled_pool(), [0, 1]) == [0, 1]  # reported, not raised
    monkeypatch.undo()
    assert store.stats.errors == 2 and store.stats.written == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.name != KEY_FILE] == []
    await store.put(KEYS[:1], filled_pool(), [0])  # and with fsync on, a write works
    assert await store.exists(KEYS[:1]) == 1


async def test_large_batches_go_in_chunks(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT, chunk_bytes=2 * LAYOUT.page_bytes)
    src = filled_pool(seed=9)
    keys = list(range(100, 108))
    await store.put(keys, src, range(8))
    (store.path(keys[5])).unlink()
    dst = KVPool(LAYOUT, 8)
    assert await store.get(keys, dst, range(8)) == 5
    assert np.array_equal(rows(dst)[:5], rows(src)[:5]) and not rows(dst)[5:].any()
    assert await store.get(keys[:4], dst, range(4)) == 4


async def test_closed_stores_refuse_calls(tmp_path: Path) -> None:
    for backend in (FileStore(tmp_path, LAYOUT), MemoryStore(LAYOUT)):
        await backend.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await backend.exists(KEYS)


# ------------------------------------------------------------------------------- memory store


async def test_memory_store_evicts_least_recently_used() -> None:
    store = MemoryStore(LAYOUT, capacity_pages=3)
    pool = filled_pool()
    await store.put([1, 2, 3], pool, [0, 1, 2])
    assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 1  # 1 is now the most recent
    await store.put([4], pool, [3])
    assert len(store) == 3 and store.stats.evicted == 1
    assert 2 not in store and all(k in store for k in (1, 3, 4))
    with pytest.raises(ValueError, match="capacity_pages"):
        MemoryStore(LAYOUT, capacity_pages=-1)


# ---------------------------------------------------------------------------- model-based test

POOL_PAGES = 6
KEY_SPACE = [3, 2**64 - 1, 0xDEADBEEF, 1 << 40, 5]


@attrs.frozen
class Either:
    """A damaged page that a `put` wrote again, or skipped: `written` if it was written."""

    written: bytes


class StoreMachine(RuleBasedStateMachine):
    """Random puts, gets, existence queries and page damage against a dict of key -> bytes.

    A damaged key is remembered as such: `exists` still counts it (its size is right), `get`
    stops there and, with `delete_corrupt`, forgets it so a later `put` writes it again. A `put`
    over a damaged key may be skipped (the contract: "a key already present may be skipped") or
    write it again: the model holds both (`Either`) until a `get` shows which.
    """

    make_store: Callable[[Path], StorageBackend]
    damage = object()

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hicache-l3-"))
        self.store = self.make_store(self.dir)
        self.pool = KVPool(LAYOUT, POOL_PAGES)
        self.model: dict[int, bytes | Either | object] = {}

    def teardown(self) -> None:
        trio.run(self.store.aclose)
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=POOL_PAGES),
        seed=st.integers(0, 2**32 - 1),
        data=st.data(),
    )
    def put(self, keys: list[int], seed: int, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.integers(0, POOL_PAGES - 1), min_size=len(keys), max_size=len(keys)))
        fill = np.random.default_rng(seed).integers(
            0, 256, size=(POOL_PAGES, LAYOUT.page_bytes), dtype=np.uint8
        )
        self.pool.bytes_view().copy_(torch.from_numpy(fill))
        trio.run(self.store.put, keys, self.pool, pages)
        for key, page in zip(keys, pages, strict=True):
            if self.model.get(key) is self.damage:
                self.model[key] = Either(fill[page].tobytes())
            else:
                self.model.setdefault(key, fill[page].tobytes())

    @rule(keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=POOL_PAGES, unique=True))
    def get(self, keys: list[int]) -> None:
        self.pool.bytes_view().fill_(0)
        got = trio.run(self.store.get, keys, self.pool, list(range(len(keys))))
        expected = 0
        for key in keys:
            value = self.model.get(key)
            if isinstance(value, Either):  # rewritten if the store read it, else still damaged
                if got > expected:
                    value = self.model[key] = value.written
                else:
                    value = self.damage
            if value is self.damage:
                del self.model[key]  # the store deletes a damaged page it meets
            if not isinstance(value, bytes):
                break
            expected += 1
        assert got == expected
        for i in range(got):
            assert self.pool.bytes_view()[i].numpy().tobytes() == self.model[keys[i]]

    @rule(keys=st.lists(st.sampled_from(KEY_SPACE), min_size=0, max_size=len(KEY_SPACE)))
    def exists(self, keys: list[int]) -> None:
        expected = 0
        for key in keys:
            if key not in self.model:
                break
            expected += 1
        assert trio.run(self.store.exists, keys) == expected

    def intact(self) -> list[int]:
        return sorted(k for k, v in self.model.items() if isinstance(v, bytes))

    @precondition(lambda self: isinstance(self.store, FileStore) and self.intact())
    @rule(data=st.data(), offset=st.integers(0, HEADER_SIZE + LAYOUT.page_bytes - 1))
    def damage_a_page(self, data: st.DataObject, offset: int) -> None:
        # Only an intact page: flipping the same bit of a damaged one again would mend it.
        key = data.draw(st.sampled_from(self.intact()))
        path = self.store.path(key)  # type: ignore[attr-defined]
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(bytes(raw))
        self.model[key] = self.damage

    @invariant()
    def no_temporary_files_are_left(self) -> None:
        assert not list(self.dir.rglob("*.tmp"))


class FileStoreMachine(StoreMachine):
    make_store = staticmethod(lambda root: FileStore(root, LAYOUT, delete_corrupt=True))


class BoundedShardMachine(StoreMachine):
    """A tensor-parallel shard with a capacity that holds every key: the index and the shard
    change nothing the contract says (a damaged page deleted and written again included)."""

    make_store = staticmethod(
        lambda root: FileStore(
            root,
            LAYOUT,
            delete_corrupt=True,
            capacity_bytes=len(KEY_SPACE) * (HEADER_SIZE + LAYOUT.page_bytes),
            rank=1,
            tp_size=2,
        )
    )


class MemoryStoreMachine(StoreMachine):
    make_store = staticmethod(lambda root: MemoryStore(LAYOUT))


_machine_settings = settings(max_examples=examples(40), stateful_step_count=15, deadline=None)
TestFileStoreModel = FileStoreMachine.TestCase
TestFileStoreModel.settings = _machine_settings
TestBoundedShardModel = BoundedShardMachine.TestCase
TestBoundedShardModel.settings = _machine_settings
TestMemoryStoreModel = MemoryStoreMachine.TestCase
TestMemoryStoreModel.settings = _machine_settings


def test_struct_layout_is_stable() -> None:
    assert HEADER_SIZE == 128 and struct.calcsize(HEADER.format) == 128
