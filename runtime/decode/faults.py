"""Faults in the runtime, injected for real, and the page checks that keep them from serving wrong
KV.

`RuntimeFaults` decides (with `hicache.faults.decide`) which operations of a decode node suffer a
fault and counts what it injected and what the checks caught. The faults act on real bytes,
files and connections:

- L3 (`FaultyStore`, a `StorageBackend` around the node's real one): `exists` answers 0 or fewer
  hits; `get` reads nothing or a prefix; `put` writes nothing or a prefix; `corrupt` flips a byte
  of a page *file* (before a `get` reads it, or after a `put` wrote it), which the file store's
  keyed MAC then turns into a miss. Storage operations carry no command id, so they are numbered by
  the store's own call sequence.
- Copies (`CheckedCopies`, around the `CopyEngine`): a load-back copies nothing or a prefix, or
  reads an L2 page with a flipped byte; a backup copies nothing or a prefix, or leaves a flipped
  byte in an L2 page after it completed.
- Transfers and timers: `InjectedFaults` (`runtime/decode/injected.py`), hooks the transfer and
  timer code always calls (`FaultHooks` without a spec).

Corruption has to be caught by a layer that saw the bytes before they went bad:

- in L3 files, by the keyed MAC in each page file's header (`FileStore`), checked on every read;
- in L2 (a flipped byte at rest, a backup or a read that did not produce the bytes), by
  `PageGuard`: a checksum of every L2 page taken when the page was written (right after the
  backup's copy, or right after the verified L3 read) and checked on the L1 copy *after* the
  load-back — which covers L2 at rest and the copy itself — and on the L2 page before a store,
  so bad bytes never reach L3. A page that fails is named in `LoadDone.failed`; the core
  re-requests its request's pages from there on from prefill and drops the page from L2;
- on the P->D link, against the digests prefill sends with every transfer: a received page that
  differs fails the transfer (`KVFailed`), which the core retries.

Pages a backup did not copy, or that L3 did not write, are named in `BackupDone.failed` and
`StoreDone.failed`, so the core never counts them as present.

Corruption of L1 after the check (HBM at rest) is outside what this node can see: GPU memory has
ECC for that.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import trio

from hicache.core import commands as cmd
from hicache.faults import Decision, FaultSpec, FaultSpecError, decide
from hicache.runtime.kv.copy_engine import CopyEngine
from hicache.runtime.kv.kv_pool import KVPool, PageIndices
from hicache.runtime.storage.base import Progress, StorageBackend, StoreStats
from hicache.runtime.storage.page_file import HEADER_SIZE

_MIX = 0x9E3779B97F4A7C15  # odd: times an odd number stays odd


class RuntimeFaults:
    """The faults a decode node injects into its own operations (`node` keys the decisions when
    several nodes share one spec); `injected` counts them by `op.kind`, `caught` counts what the
    checks found."""

    def __init__(self, spec: FaultSpec, node: int = 0) -> None:
        self.spec = spec
        self.node = node
        self.injected: Counter[str] = Counter()
        self.caught: Counter[str] = Counter()

    def take(self, op: str, op_id: int, sub: int = 0) -> Decision | None:
        return decide(self.spec, op, op_id, node=self.node, sub=sub)

    def applied(self, d: Decision) -> None:
        self.injected[f"{d.op}.{d.kind}"] += 1

    async def delay(self, d: Decision | None) -> None:
        if d is not None and d.kind == "delay":
            self.applied(d)
            await trio.sleep(d.delay)


def flip_offset(d: Decision, n: int, nbytes: int) -> tuple[int, int]:
    """Which of `n` pages of `nbytes` a `corrupt` hits, and which byte of it."""
    i = d.index(n)
    rest = d.fraction * n - i
    return i, min(int(rest * nbytes), nbytes - 1)


def flip_page_byte(pool: KVPool, page: int, offset: int) -> None:
    """Invert one byte of one page in place (on whatever device the pool lives)."""
    row = pool.bytes_view()[page]
    row[offset] = 255 - row[offset]


def flip_file_byte(path: Path, offset: int) -> bool:
    """Invert one byte of a page file's payload in place; False if there is no such file."""
    try:
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE + offset)
            old = f.read(1)
            if len(old) != 1:
                return False
            f.seek(HEADER_SIZE + offset)
            f.write(bytes([255 - old[0]]))
    except FileNotFoundError:
        return False
    return True


# --------------------------------------------------------------------------------- page checks


@functools.cache
def _weights(width: int, device: torch.device) -> torch.Tensor:
    weights = (np.arange(width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(_MIX)
    return torch.from_numpy(weights.view(np.int64)).to(device)


def page_sums(words: torch.Tensor) -> np.ndarray:
    """One 64-bit checksum per page of an int64 `(pages, words)` tensor: the sum of each word
    times a distinct odd weight, wrapping. Any change to one word changes it; computed where the
    pages live (a GPU reads its pages once), returned on the host."""
    w = _weights(words.shape[1], words.device)
    return (words * w).sum(dim=1).cpu().numpy().view(np.uint64)


class PageGuard:
    """Checksums of the pages this node wrote into L2, checked whenever a page leaves L2.

    A slot is trusted only after `record` (a completed backup, or a verified L3 read, wrote it);
    `forget` marks a slot whose write did not happen or did not complete.
    """

    def __init__(self, l2: KVPool) -> None:
        self.l2 = l2
        self.sums = np.zeros(l2.num_pages, dtype=np.uint64)
        self.valid = np.zeros(l2.num_pages, dtype=bool)

    def record(self, slots: Sequence[int]) -> None:
        if len(slots):
            idx = np.asarray(slots, dtype=np.int64)
            self.sums[idx] = page_sums(self.l2.words_view()[torch.from_numpy(idx)])
            self.valid[idx] = True

    def forget(self, slots: Sequence[int]) -> None:
        if len(slots):
            self.valid[np.asarray(slots, dtype=np.int64)] = False

    def matches(self, pool: KVPool, pages: Sequence[int], sources: Sequence[int]) -> np.ndarray:
        """Which of `pool`'s `pages` hold exactly what was recorded for L2 slots `sources`."""
        if not len(pages):
            return np.zeros(0, dtype=bool)
        src = np.asarray(sources, dtype=np.int64)
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=pool.device)
        return self.valid[src] & (page_sums(pool.words_view()[idx]) == self.sums[src])


# --------------------------------------------------------------------------------- L3


class FaultyStore:
    """A `StorageBackend` that injects the spec's `l3_exists`, `l3_get` and `l3_put` faults into
    the calls it passes on to `inner`. `corrupt` needs an inner store that checksums its pages
    in files (`FileStore`): anything else would serve the flipped byte."""

    def __init__(self, inner: StorageBackend, faults: RuntimeFaults) -> None:
        self.check(faults.spec, inner)
        self.inner = inner
        self.faults = faults
        self._calls: Counter[str] = Counter()

    @staticmethod
    def check(spec: FaultSpec, inner: StorageBackend) -> None:
        """Refuse a spec that `inner` cannot carry out (FaultSpecError naming the field)."""
        for op in ("l3_get", "l3_put"):
            if any(f.kind == "corrupt" for f in spec.faults(op)) and not hasattr(inner, "path"):
                raise FaultSpecError(
                    f"faults.{op}",
                    f"corrupt flips bytes in page files, which {type(inner).__name__} does not keep; "
                    "give the decode node a file store (--storage-dir)",
                )

    @property
    def stats(self) -> StoreStats:
        return self.inner.stats

    def _take(self, op: str) -> Decision | None:
        self._calls[op] += 1
        return self.faults.take(op, self._calls[op])

    def _page_bytes(self) -> int:
        return self.inner.layout.page_bytes  # type: ignore[attr-defined]

    async def _flip(self, d: Decision, keys: Sequence[object]) -> None:
        i, offset = flip_offset(d, len(keys), self._page_bytes())
        path = self.inner.path(keys[i])  # type: ignore[attr-defined]
        if await trio.to_thread.run_sync(flip_file_byte, path, offset):
            self.faults.applied(d)

    async def exists(self, keys: Sequence[object]) -> int:
        d = self._take("l3_exists")
        await self.faults.delay(d)
        if d is not None and d.kind == "error" and len(keys):
            self.faults.applied(d)
            return 0
        n = await self.inner.exists(keys)
        if d is not None and d.kind == "partial" and n:
            self.faults.applied(d)
            return d.prefix(n)
        return n

    async def get(
        self, keys: Sequence[object], pool: KVPool, pages: PageIndices, *, progress: Progress | None = None
    ) -> int:
        d = self._take("l3_get")
        await self.faults.delay(d)
        if d is not None and len(keys):
            if d.kind == "error":
                self.faults.applied(d)
                return 0
            if d.kind == "partial":
                self.faults.applied(d)
                k = d.prefix(len(keys))
                if not k:
                    return 0
                return await self.inner.get(list(keys)[:k], pool, list(pages)[:k], progress=progress)
            if d.kind == "corrupt":
                await self._flip(d, keys)
        return await self.inner.get(keys, pool, pages, progress=progress)

    async def put(self, keys: Sequence[object], pool: KVPool, pages: PageIndices) -> list[int]:
        """The inner store's answer, plus every page the fault kept from being written."""
        d = self._take("l3_put")
        await self.faults.delay(d)
        n = len(keys)
        if d is None or not n or d.kind == "delay":
            return await self.inner.put(keys, pool, pages)
        if d.kind == "error":
            self.faults.applied(d)
            return list(range(n))
        if d.kind == "partial":
            self.faults.applied(d)
            k = d.prefix(n)
            missed = await self.inner.put(list(keys)[:k], pool, list(pages)[:k]) if k else []
            return [*missed, *range(k, n)]
        # corrupt: the page is written (so it counts as stored), then goes bad on disk
        missed = await self.inner.put(keys, pool, pages)
        await self._flip(d, keys)
        return missed

    async def aclose(self) -> None:
        await self.inner.aclose()


# --------------------------------------------------------------------------------- copies


class CheckedCopies:
    """Load-backs and backups between a node's L2 and L1 pools, with the page checks (`guard`)
    and injected faults (`faults`) around the copy; without either it is the plain copy."""

    def __init__(
        self,
        copies: CopyEngine,
        l1: KVPool,
        l2: KVPool,
        *,
        guard: PageGuard | None = None,
        faults: RuntimeFaults | None = None,
    ) -> None:
        if faults is not None and guard is None:
            raise ValueError("CheckedCopies: injected faults need a PageGuard, else wrong KV is served")
        self.copies = copies
        self.l1, self.l2 = l1, l2
        self.guard = guard
        self.faults = faults

    def _take(self, op: str, op_id: int) -> Decision | None:
        return self.faults.take(op, op_id) if self.faults is not None else None

    async def load(self, c: cmd.LoadBack) -> tuple[int, ...]:
        """Copy a load-back's pages; return the pages (indices into the batch's pages in order)
        that did not arrive intact: those a fault kept from being copied, and exactly those the
        guard found different from what was written to L2."""
        host, device = list(c.host_slots), list(c.device_slots)
        n = len(host)
        copy = n
        d = self._take("load", c.op)
        if d is not None and self.faults is not None:
            await self.faults.delay(d)
            if n and d.kind in ("error", "partial"):
                self.faults.applied(d)
                copy = 0 if d.kind == "error" else d.prefix(n)
            elif n and d.kind == "corrupt":
                self.faults.applied(d)
                i, offset = flip_offset(d, n, self.l2.layout.page_bytes)
                flip_page_byte(self.l2, host[i], offset)  # the L2 page goes bad at rest
        if copy:
            await self.copies.copy(self.l2, host[:copy], self.l1, device[:copy])
        lost = list(range(copy, n))
        if self.guard is not None and copy:
            ok = await trio.to_thread.run_sync(self.guard.matches, self.l1, device[:copy], host[:copy])
            bad = [int(i) for i in np.flatnonzero(~ok)]
            if bad and self.faults is not None:
                self.faults.caught["l2_page_rejected"] += len(bad)
            lost = bad + lost
        return tuple(sorted(set(lost)))

    async def backup(self, c: cmd.Backup) -> tuple[int, ...]:
        """Copy a backup's pages into L2 and record their checksums; return the pages (indices
        into the command's slots) that were not copied. A byte flipped after the copy (at rest)
        is not a failed copy: the guard catches it when the page leaves L2."""
        device, host = list(c.device_slots), list(c.host_slots)
        n = len(host)
        copy, flip = n, None
        d = self._take("backup", c.op)
        if d is not None and self.faults is not None:
            await self.faults.delay(d)
            if n and d.kind in ("error", "partial"):
                self.faults.applied(d)
                copy = 0 if d.kind == "error" else d.prefix(n)
            elif n and d.kind == "corrupt":
                self.faults.applied(d)
                flip = flip_offset(d, n, self.l2.layout.page_bytes)
        if copy:
            await self.copies.copy(self.l1, device[:copy], self.l2, host[:copy])
        if self.guard is not None:
            await trio.to_thread.run_sync(self.guard.record, host[:copy])
            self.guard.forget(host[copy:])
        if flip is not None:
            flip_page_byte(self.l2, host[flip[0]], flip[1])  # after the checksum: bad at rest
        return tuple(range(copy, n))

    async def prefetched(self, host_slots: Sequence[int], pages: int) -> None:
        """An L3 read filled the first `pages` of `host_slots` (the store verified them)."""
        if self.guard is not None:
            await trio.to_thread.run_sync(self.guard.record, list(host_slots[:pages]))
            self.guard.forget(list(host_slots[pages:]))

    async def storable(self, host_slots: Sequence[int]) -> list[int]:
        """Positions of the L2 pages that may go to L3: those whose bytes still check out."""
        if self.guard is None:
            return list(range(len(host_slots)))
        ok = await trio.to_thread.run_sync(self.guard.matches, self.l2, host_slots, host_slots)
        if self.faults is not None and not ok.all():
            self.faults.caught["l2_page_not_stored"] += int((~ok).sum())
        return [int(i) for i in np.flatnonzero(ok)]
