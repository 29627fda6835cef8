"""What the tiered radix tree reports: its counters, and the results of an insert, an
eviction and a backup's end.

The results are plain classes with `__slots__` deriving from `Value`, not attrs: one is made
on every request's path, and an attrs-generated `__init__` stays interpreted Python inside a
compiled module, where a plain class's is compiled."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hicache.core.value import Value


@attrs.define(slots=True)
class TreeStats:
    """Counters the tree keeps, in pages; drivers add time."""

    matched_device: int = 0
    matched_host: int = 0
    inserted: int = 0
    demoted: int = 0
    dropped: int = 0
    host_evicted: int = 0
    backed_up: int = 0
    backup_failed: int = 0  # pages whose backup could not start (no L2 room) or did not complete
    store_failed: int = 0  # pages a store did not write
    host_dropped: int = 0  # pages whose L2 copy was found bad (and the L2-only pages below them)
    stored: int = 0
    store_skipped: int = 0  # pages not written to L3 because the store backlog was full
    splits: int = 0


class InsertResult(Value):
    """What an insert did with the caller's slots, in pages."""

    __slots__ = ("cached_pages", "adopted_pages")

    def __init__(self, cached_pages: int, adopted_pages: int) -> None:
        self.cached_pages = cached_pages  # already on L1: the caller's duplicate slots were freed
        self.adopted_pages = adopted_pages  # taken over by the tree (new nodes, host-only nodes on L1)

    def fields(self) -> tuple[tuple[str, object], ...]:
        return (("cached_pages", self.cached_pages), ("adopted_pages", self.adopted_pages))


class EvictResult(Value):
    """Pages freed now, pages that free when a pending backup completes, and the keys affected:
    `demoted_keys` left L1 and stay on L2, `dropped_keys` left the tree.

    The keys are kept as the evicted nodes' own key runs and joined only when read: an
    eviction frees thousands of pages, and its callers seldom ask which."""

    __slots__ = ("freed", "pending", "_demoted", "_dropped")

    def __init__(
        self, freed: int, pending: int, demoted_keys: Sequence[int] = (), dropped_keys: Sequence[int] = ()
    ) -> None:
        self.freed = freed
        self.pending = pending
        self._demoted: list[tuple[int, ...]] = [tuple(demoted_keys)] if demoted_keys else []
        self._dropped: list[tuple[int, ...]] = [tuple(dropped_keys)] if dropped_keys else []

    @staticmethod
    def of_runs(
        freed: int, pending: int, demoted: list[tuple[int, ...]], dropped: list[tuple[int, ...]]
    ) -> EvictResult:
        r = EvictResult(freed, pending)
        r._demoted = demoted
        r._dropped = dropped
        return r

    @property
    def demoted_keys(self) -> list[int]:
        return [k for run in self._demoted for k in run]

    @property
    def dropped_keys(self) -> list[int]:
        return [k for run in self._dropped for k in run]

    def fields(self) -> tuple[tuple[str, object], ...]:
        return (
            ("freed", self.freed),
            ("pending", self.pending),
            ("demoted_keys", self.demoted_keys),
            ("dropped_keys", self.dropped_keys),
        )


class BackupResult(Value):
    """Keys whose L2 copies became valid, and those of them that then left L1 (write-back)."""

    __slots__ = ("backed_keys", "demoted_keys")

    def __init__(self, backed_keys: list[int], demoted_keys: list[int]) -> None:
        self.backed_keys = backed_keys
        self.demoted_keys = demoted_keys

    def fields(self) -> tuple[tuple[str, object], ...]:
        return (("backed_keys", self.backed_keys), ("demoted_keys", self.demoted_keys))
