"""L3 page files keep a tenant's prompts to the node: private files, sealed payloads.

A page's KV gives its tokens back (layer 0's V is a function of the token alone), so a page a
local user or a stolen disk can read is the prompt. These tests read the directory as such an
outsider would: modes, bytes on disk, and pages moved between keys, tenants, shards or secrets.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from builders import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.pages import namespace_seed, page_keys
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage import FileStore

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")  # 512-byte pages
PAGE = LAYOUT.page_bytes
SECRET = b"a cluster secret of the tests, 32+"


def pool_of(pages: list[bytes]) -> KVPool:
    pool = KVPool(LAYOUT, max(1, len(pages)))
    if pages:
        data = np.frombuffer(b"".join(pages), dtype=np.uint8).reshape(len(pages), PAGE)
        pool.bytes_view().copy_(torch.from_numpy(data.copy()))
    return pool


def put(store: FileStore, keys: list[int], pages: list[bytes]) -> list[int]:
    return trio.run(store.put, keys, pool_of(pages), list(range(len(keys))))


def get(store: FileStore, keys: list[int]) -> tuple[int, np.ndarray]:
    dst = KVPool(LAYOUT, max(1, len(keys)))
    got = trio.run(store.get, keys, dst, list(range(len(keys))))
    return got, dst.bytes_view().numpy().copy()


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # the usual umask: what the store must not rely on
    try:
        yield
    finally:
        os.umask(old)


def test_page_files_and_every_folder_the_store_makes_are_the_node_users_alone(
    tmp_path: Path, umask_022: None
) -> None:
    root = tmp_path / "shared" / "l3"
    store = FileStore(root, LAYOUT, secret=SECRET, rank=1, tp_size=2, capacity_bytes=1 << 20)
    assert put(store, [1, 2, 0xAB << 56], [bytes([i]) * PAGE for i in range(3)]) == []
    trio.run(store.aclose)
    made = [tmp_path / "shared", root, root / "tp2", root / "tp2" / "rank1"]
    folders = [*made, *(p for p in (root / "tp2" / "rank1").iterdir() if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(folders) == 6 and any(p.suffix == ".kvpage" for p in files)
    assert any(p.name.startswith(".hicache-index") for p in files)
    for folder in folders:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert f.stat().st_uid == os.geteuid()


def test_no_byte_run_of_a_page_is_on_disk(tmp_path: Path) -> None:
    """The KV itself never reaches the disk: no 32-byte run of any page appears in any file."""
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(4)]
    store = FileStore(tmp_path, LAYOUT, secret=SECRET, capacity_bytes=1 << 20)
    put(store, [11, 12, 13, 14], pages)
    trio.run(store.aclose)
    disk = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for page in pages:
        for start in range(0, PAGE, 32):
            assert page[start : start + 32] not in disk


def test_a_page_of_an_older_unsealed_format_is_written_over_not_kept(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT, secret=SECRET)
    page = bytes(range(256)) * (PAGE // 256)
    path = store.path(5)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = b"HICKVPG\0" + (2).to_bytes(2, "little") + bytes(118)
    path.write_bytes(header + page)  # an old plaintext page, of the right size
    assert put(store, [5], [page]) == []
    assert store.stats.written == 1 and store.stats.skipped == 0
    assert get(store, [5])[0] == 1
    assert page not in path.read_bytes()


@settings(max_examples=examples(60), deadline=None)
@given(
    page=st.binary(min_size=PAGE, max_size=PAGE),
    bit=st.integers(0, (128 + PAGE) * 8 - 1),
)
def test_any_page_round_trips_and_any_single_bit_change_is_a_counted_miss(page: bytes, bit: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="hicache-sealed-"))
    try:
        store = FileStore(root, LAYOUT, secret=SECRET)
        assert put(store, [9], [page]) == []
        got, data = get(store, [9])
        assert got == 1 and data[0].tobytes() == page
        path = store.path(9)
        raw = bytearray(path.read_bytes())
        raw[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(raw))
        assert get(store, [9])[0] == 0
        assert store.stats.corrupt == 1 and store.stats.hits == 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(max_examples=examples(30), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=4 * LAYOUT.page_size, max_size=4 * LAYOUT.page_size),
    tenants=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=2, unique=True),
    moves=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=4),
)
def test_a_page_moved_to_another_key_or_tenant_is_refused_and_counted(
    tokens: list[int], tenants: list[str], moves: list[tuple[int, int]]
) -> None:
    """Two tenants send the same prompt: eight pages, four keys each. Any page copied over
    another's file (same tenant, other page; or the other tenant's page of the same tokens)
    reads as a miss counted corrupt, never as the page it replaced."""
    arr = np.asarray(tokens, dtype=np.int64)
    keys = [k for t in tenants for k in page_keys(arr, LAYOUT.page_size, namespace_seed("m", t)).tolist()]
    assert len(set(keys)) == 8
    pages = [bytes([i]) * PAGE for i in range(8)]
    root = Path(tempfile.mkdtemp(prefix="hicache-sealed-"))
    try:
        store = FileStore(root, LAYOUT, secret=SECRET)
        assert put(store, keys, pages) == []
        origin = list(range(8))  # whose sealed page each key's file holds now
        for src, dst in moves:
            if src == dst:
                continue
            shutil.copyfile(store.path(keys[src]), store.path(keys[dst]))
            origin[dst] = origin[src]
        for i, key in enumerate(keys):
            got, data = get(store, [key])
            assert got == (origin[i] == i)
            if got:
                assert data[0].tobytes() == pages[i]
        assert store.stats.corrupt == sum(o != i for i, o in enumerate(origin))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_another_secret_reads_nothing_and_a_shard_cannot_read_another(tmp_path: Path) -> None:
    page = b"\x5a" * PAGE
    put(FileStore(tmp_path, LAYOUT, secret=SECRET), [3], [page])
    other = FileStore(tmp_path, LAYOUT, secret=b"another cluster's secret, 32 bytes")
    assert get(other, [3])[0] == 0 and other.stats.corrupt == 1
    rank0 = FileStore(tmp_path, LAYOUT, secret=SECRET, rank=0, tp_size=2)
    rank1 = FileStore(tmp_path, LAYOUT, secret=SECRET, rank=1, tp_size=2)
    put(rank0, [3], [page])
    rank1.path(3).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(rank0.path(3), rank1.path(3))
    assert get(rank1, [3])[0] == 0 and rank1.stats.corrupt == 1
