"""Compact exact sets of 64-bit page keys for the shared L3, which may hold every page a trace
of millions of requests ever wrote: a dict of Python ints costs about 100 bytes a key, these
cost 11-21 (`KeySet`) or 21-43 with recency (`LruKeySet`).

Both are open-addressing hash tables with linear probing over numpy arrays, run by numba
kernels. Keys are any value in [0, 2**64); a home slot is a bijective mix of the key (the
splitmix64 finaliser), so keys that differ only in their high bits spread too. Callers pass
batches; a query looks its first key up alone, then walks the batch in growing chunks, so that
a miss near its start costs a little conversion, not the whole batch's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numba
import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_MAX_LOAD = 0.75  # entries per slot before the table doubles
_FIRST_CHUNK = 16  # keys converted after a query's first hit; doubled while all of them hit


def as_keys(keys: Iterable[int]) -> np.ndarray:
    """`keys` as a uint64 array; OverflowError for a key outside [0, 2**64)."""
    if isinstance(keys, np.ndarray):
        return keys.astype(np.uint64, copy=False)
    if isinstance(keys, (list, tuple)):
        # np.array inspects every element of a long list of big ints before converting; the
        # counted fromiter does not (2.4x faster at 1,000 keys)
        if len(keys) < 64:
            return np.array(keys, dtype=np.uint64)
        return np.fromiter(keys, dtype=np.uint64, count=len(keys))
    return np.fromiter(keys, dtype=np.uint64)


@numba.njit(cache=True, nogil=True, inline="always")
def _home(key: np.uint64, mask: np.uint64) -> int:  # pragma: no cover - compiled
    x = key
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    x = x ^ (x >> _S31)
    return np.int64(x & mask)  # type: ignore[return-value]  # numba: an int64 is an int


def _table_size(entries: int) -> int:
    size = 16
    while entries > size * _MAX_LOAD:
        size *= 2
    return size


# ---- KeySet: a plain set; slot value 0 is empty, so the key 0 is held by a flag -------------
# state: [0] keys held, [1] the key 0 is held


@numba.njit(cache=True, nogil=True)
def _set_find(table: np.ndarray, key: np.uint64) -> int:  # pragma: no cover - compiled
    mask = np.uint64(table.size - 1)
    i = _home(key, mask)
    while True:
        v = table[i]
        if v == key:
            return i
        if v == 0:
            return -1 - i
        i = (i + 1) & (table.size - 1)


@numba.njit(cache=True, nogil=True)
def _set_has(table: np.ndarray, state: np.ndarray, key: np.uint64) -> bool:  # pragma: no cover
    if key == 0:
        return state[1] != 0
    return _set_find(table, key) >= 0


@numba.njit(cache=True, nogil=True)
def _set_prefix(table: np.ndarray, state: np.ndarray, keys: np.ndarray) -> int:  # pragma: no cover
    for n in range(keys.size):
        k = keys[n]
        if k == 0:
            if state[1] == 0:
                return n
        elif _set_find(table, k) < 0:
            return n
    return keys.size


@numba.njit(cache=True, nogil=True)
def _set_add(table: np.ndarray, state: np.ndarray, keys: np.ndarray) -> None:  # pragma: no cover
    for n in range(keys.size):
        k = keys[n]
        if k == 0:
            if state[1] == 0:
                state[1] = 1
                state[0] += 1
            continue
        i = _set_find(table, k)
        if i < 0:
            table[-1 - i] = k
            state[0] += 1


@numba.njit(cache=True, nogil=True)
def _set_rehash(old: np.ndarray, new: np.ndarray) -> None:  # pragma: no cover - compiled
    for k in old:
        if k != 0:
            new[-1 - _set_find(new, k)] = k


class KeySet:
    """Which keys are held, and nothing else: 8 bytes a slot, 0.375-0.75 of slots used."""

    def __init__(self) -> None:
        self._table = np.zeros(16, dtype=np.uint64)
        self._state = np.zeros(2, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._state[0])

    def __contains__(self, key: int) -> bool:
        return bool(_set_has(self._table, self._state, _key(key)))

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def prefix(self, keys: np.ndarray) -> int:
        """How many of `keys`, from the first, are held."""
        return int(_set_prefix(self._table, self._state, keys))

    def add(self, keys: np.ndarray) -> None:
        need = int(self._state[0]) + keys.size
        if need > self._table.size * _MAX_LOAD:
            new = np.zeros(_table_size(need), dtype=np.uint64)
            _set_rehash(self._table, new)
            self._table = new
        _set_add(self._table, self._state, keys)


# ---- LruKeySet: entries in a doubly linked recency list, the table holds entry index + 1 ----
# state: [0] keys held, [1] least recent entry, [2] most recent, [3] first free entry,
# [4] entries ever handed out; -1 is "none".
_COUNT, _HEAD, _TAIL, _FREE, _USED = range(5)


@numba.njit(cache=True, nogil=True)
def _lru_find(slots: np.ndarray, ekeys: np.ndarray, key: np.uint64) -> int:  # pragma: no cover
    """The slot holding `key`, or -1 - the empty slot where it would go."""
    mask = slots.size - 1
    i = _home(key, np.uint64(mask))
    while True:
        e = slots[i]
        if e == 0:
            return -1 - i
        if ekeys[e - 1] == key:
            return i
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True)
def _lru_unlink(prev: np.ndarray, nxt: np.ndarray, state: np.ndarray, e: int) -> None:  # pragma: no cover
    p, q = prev[e], nxt[e]
    if p >= 0:
        nxt[p] = q
    else:
        state[_HEAD] = q
    if q >= 0:
        prev[q] = p
    else:
        state[_TAIL] = p


@numba.njit(cache=True, nogil=True)
def _lru_append(prev: np.ndarray, nxt: np.ndarray, state: np.ndarray, e: int) -> None:  # pragma: no cover
    t = state[_TAIL]
    prev[e] = t
    nxt[e] = -1
    if t >= 0:
        nxt[t] = e
    else:
        state[_HEAD] = e
    state[_TAIL] = e


@numba.njit(cache=True, nogil=True)
def _lru_has(slots: np.ndarray, ekeys: np.ndarray, key: np.uint64) -> bool:  # pragma: no cover
    return _lru_find(slots, ekeys, key) >= 0


@numba.njit(cache=True, nogil=True)
def _lru_prefix(slots: np.ndarray, ekeys: np.ndarray, keys: np.ndarray) -> int:  # pragma: no cover
    for n in range(keys.size):
        if _lru_find(slots, ekeys, keys[n]) < 0:
            return n
    return keys.size


@numba.njit(cache=True, nogil=True)
def _lru_touch(
    slots: np.ndarray,
    ekeys: np.ndarray,
    prev: np.ndarray,
    nxt: np.ndarray,
    state: np.ndarray,
    keys: np.ndarray,
) -> None:  # pragma: no cover - compiled
    for n in range(keys.size):
        i = _lru_find(slots, ekeys, keys[n])
        if i >= 0:
            e = slots[i] - 1
            if e != state[_TAIL]:
                _lru_unlink(prev, nxt, state, e)
                _lru_append(prev, nxt, state, e)


@numba.njit(cache=True, nogil=True)
def _lru_add(
    slots: np.ndarray,
    ekeys: np.ndarray,
    prev: np.ndarray,
    nxt: np.ndarray,
    state: np.ndarray,
    keys: np.ndarray,
    capacity: int,
) -> int:  # pragma: no cover - compiled
    """Add (or refresh) every key, then drop the least recent beyond `capacity`: the number
    dropped. The caller has made room for every key in the arrays."""
    for n in range(keys.size):
        k = keys[n]
        i = _lru_find(slots, ekeys, k)
        if i >= 0:
            e = slots[i] - 1
            if e != state[_TAIL]:
                _lru_unlink(prev, nxt, state, e)
                _lru_append(prev, nxt, state, e)
            continue
        e = state[_FREE]
        if e >= 0:
            state[_FREE] = nxt[e]
        else:
            e = state[_USED]
            state[_USED] += 1
        ekeys[e] = k
        slots[-1 - i] = e + 1
        _lru_append(prev, nxt, state, e)
        state[_COUNT] += 1
    dropped = 0
    mask = slots.size - 1
    while state[_COUNT] > capacity:
        e = state[_HEAD]
        _lru_unlink(prev, nxt, state, e)
        nxt[e] = state[_FREE]
        state[_FREE] = e
        state[_COUNT] -= 1
        dropped += 1
        # Take its slot out and shift later entries of the probe run back (no tombstones).
        i = _lru_find(slots, ekeys, ekeys[e])
        slots[i] = 0
        j = i
        while True:
            j = (j + 1) & mask
            f = slots[j]
            if f == 0:
                break
            h = _home(ekeys[f - 1], np.uint64(mask))
            # Move it unless its home lies cyclically in (i, j].
            if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
                slots[i] = f
                slots[j] = 0
                i = j
    return dropped


@numba.njit(cache=True, nogil=True)
def _lru_rehash(
    ekeys: np.ndarray, prev: np.ndarray, nxt: np.ndarray, state: np.ndarray, slots: np.ndarray
) -> None:  # pragma: no cover - compiled
    e = state[_HEAD]
    while e >= 0:
        slots[-1 - _lru_find(slots, ekeys, ekeys[e])] = e + 1
        e = nxt[e]


class LruKeySet:
    """At most `capacity` keys (beyond it the least recently added or touched go), like a dict
    used in insertion order: entries of 16 bytes (key, links) and 4-byte slots."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: expected a positive number of keys, got {capacity}")
        self.capacity = capacity
        self.evicted = 0
        self._slots = np.zeros(16, dtype=np.int32)
        self._ekeys = np.zeros(8, dtype=np.uint64)
        self._prev = np.full(8, -1, dtype=np.int32)
        self._nxt = np.full(8, -1, dtype=np.int32)
        self._state = np.array([0, -1, -1, -1, 0], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._state[_COUNT])

    def __contains__(self, key: int) -> bool:
        return bool(_lru_has(self._slots, self._ekeys, _key(key)))

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + self._ekeys.nbytes + self._prev.nbytes + self._nxt.nbytes

    def order(self) -> list[int]:
        """The keys from least to most recent (for tests and debugging)."""
        out, e = [], int(self._state[_HEAD])
        while e >= 0:
            out.append(int(self._ekeys[e]))
            e = int(self._nxt[e])
        return out

    def prefix(self, keys: np.ndarray) -> int:
        return int(_lru_prefix(self._slots, self._ekeys, keys))

    def touch(self, keys: np.ndarray) -> None:
        _lru_touch(self._slots, self._ekeys, self._prev, self._nxt, self._state, keys)

    def add(self, keys: np.ndarray) -> None:
        self._room(int(self._state[_COUNT]) + keys.size)
        self.evicted += int(
            _lru_add(self._slots, self._ekeys, self._prev, self._nxt, self._state, keys, self.capacity)
        )

    def _room(self, need: int) -> None:
        if need >= 2**31 - 1:
            raise ValueError(f"an L3 of {need:,} pages: more than this store's 2**31 entries")
        if need > self._ekeys.size:
            # Entries past the high-water mark are unused, so they grow by plain copying.
            size = max(need, min(2 * self._ekeys.size, self.capacity + need - len(self)))
            grow = size - self._ekeys.size
            self._ekeys = np.concatenate([self._ekeys, np.zeros(grow, dtype=np.uint64)])
            self._prev = np.concatenate([self._prev, np.full(grow, -1, dtype=np.int32)])
            self._nxt = np.concatenate([self._nxt, np.full(grow, -1, dtype=np.int32)])
        if need > self._slots.size * _MAX_LOAD:
            self._slots = np.zeros(_table_size(need), dtype=np.int32)
            _lru_rehash(self._ekeys, self._prev, self._nxt, self._state, self._slots)


def _key(key: int) -> np.uint64:
    """A key for the scalar kernels (numba cannot take a Python int of 2**63 or more);
    OverflowError outside [0, 2**64), as `as_keys` gives."""
    return np.uint64(key)


def prefix_hits(held: KeySet | LruKeySet, keys: Sequence[int], start: int = 0) -> int:
    """Consecutive keys from `keys[start]` that `held` holds. Most queries of a replay miss at
    their first key (94% on Mooncake's conversation trace), so that one is looked up alone;
    after it `keys` is converted a chunk at a time, each twice the one before."""
    end = len(keys)
    if start >= end or keys[start] not in held:
        return 0
    n = start + 1
    chunk = _FIRST_CHUNK
    while n < end:
        part = as_keys(keys[n : n + chunk])
        got = held.prefix(part)
        n += got
        if got < part.size:
            break
        chunk *= 2
    return n - start
