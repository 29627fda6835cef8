"""What every L3 backend offers the decode node, and the key rules they all share.

L3 holds whole pages under their 64-bit chained page keys. Reads are prefix-shaped: a prefix is
only useful up to its first missing page, so `exists` and `get` count consecutive pages from the
first and `get` reads nothing past a miss. A page that fails verification is a miss: a backend
never reports a page it cannot vouch for, so a shortfall degrades the restore instead of
corrupting the KV. Nor does a backend raise for what it meets in storage: an error there (a full
or read-only disk, a file in the way) is a miss, or a page `put` reports as not written, since a
cache fault must never cost a request or stop a node. Only bad arguments and calls on a closed
store raise.

Reads can be cancelled (a decode node stops a prefetch its policy gave up on): a `get` reports
the pages that landed through its `progress` callback as they land, and once it returns or
raises no byte of it can still land in the pool, so a caller knows exactly which pages it may
use and when the rest of its pages are free again.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs
import numpy as np

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool, PageIndices

KEY_LIMIT = 1 << 64
_HEX_KEY = re.compile(r"[0-9a-fA-F]{16}")


def key_value(key: object) -> int:
    """A page key as an int in [0, 2**64): an int in that range, or exactly 16 hex digits.

    Anything else (negative or too large ints, bools, paths such as "../x") raises ValueError:
    key names become file names, so nothing else may reach a backend.
    """
    if isinstance(key, numbers.Integral) and not isinstance(key, bool | np.bool_):
        value = int(key)
        if 0 <= value < KEY_LIMIT:
            return value
        raise ValueError(f"page key {key!r}: expected an int in [0, 2**64)")
    if isinstance(key, str) and _HEX_KEY.fullmatch(key):
        return int(key, 16)
    raise ValueError(f"page key {key!r}: expected an int in [0, 2**64) or a string of exactly 16 hex digits")


def key_name(key: object) -> str:
    """The canonical name of a page key: 16 lower-case hex digits (see `key_value`)."""
    return f"{key_value(key):016x}"


def key_values(keys: Sequence[object]) -> list[int]:
    """All keys validated before any of them is used."""
    if isinstance(keys, str | bytes):
        raise ValueError(f"page keys: expected a sequence of keys, got the single value {keys!r}")
    return [key_value(k) for k in keys]


def check_batch(
    backend: str,
    layout: KVLayout,
    keys: Sequence[object],
    pool: KVPool,
    pages: PageIndices,
    *,
    into_pool: bool,
) -> tuple[list[int], list[int]]:
    """Validate a get/put batch: keys, pool layout and device, one page per key, and (for reads
    into the pool) no page twice."""
    values = key_values(keys)
    if pool.layout != layout:
        raise ValueError(f"{backend}: pool {pool.name} has layout {pool.layout}, the store holds {layout}")
    if pool.is_cuda:
        raise ValueError(
            f"{backend}: pool {pool.name} is on {pool.device}; L3 reads and writes host pools only"
        )
    idx = pool.indices(pages, what="pages", distinct=into_pool).tolist()
    if len(idx) != len(values):
        raise ValueError(f"{backend}: {len(values)} keys but {len(idx)} pages")
    return values, idx


Progress = Callable[[int], None]
"""Called with n once pages [0, n) of a `get` have landed intact."""


@attrs.define
class StoreStats:
    """Counters of one backend; pages, not calls."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    written: int = 0
    skipped: int = 0
    evicted: int = 0
    errors: int = 0  # pages an OS error turned into a miss or a page not written
    bytes_read: int = 0
    bytes_written: int = 0


@runtime_checkable
class StorageBackend(Protocol):
    """An L3 page store. All methods validate every key first (`key_value`)."""

    stats: StoreStats

    async def exists(self, keys: Sequence[object]) -> int:
        """How many consecutive keys, from the first, the store holds (a hint: `get` verifies)."""
        ...

    async def get(
        self, keys: Sequence[object], pool: KVPool, pages: PageIndices, *, progress: Progress | None = None
    ) -> int:
        """Read `keys[i]` into `pool` page `pages[i]`, in order, stopping at the first missing,
        truncated or corrupt page; return how many pages were read intact. Pages from the one
        that failed on may have been overwritten and must not be used.

        `progress(n)` is called whenever pages [0, n) have landed intact. A cancelled `get`
        raises `trio.Cancelled` only once nothing it started can still write to `pool` (a
        read in a worker thread is waited for); its pages are then those last reported."""
        ...

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        """Write `pool` page `pages[i]` under `keys[i]`; a key already present may be skipped.
        Return the positions (into `keys`) of the pages the store does not hold afterwards, so a
        caller never counts a page as stored that is not."""
        ...

    async def aclose(self) -> None: ...
