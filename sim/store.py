"""The shared L3: which page keys storage holds, and the one channel all nodes read and write
through. Capacity is in pages; beyond it the least recently used pages go (0 = unbounded).

The keys live in a compact table (`hicache.sim.keyset`: 11-21 bytes a key unbounded, about 30
with a capacity, where a dict of Python ints costs about 100), so that an unbounded L3 holding
every page of a trace of millions of requests stays a few hundred megabytes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hicache.sim.channel import Channel
from hicache.sim.keyset import KeySet, LruKeySet, as_keys, prefix_hits


class SharedStore:
    def __init__(self, channel: Channel, capacity_pages: int = 0) -> None:
        self.channel = channel
        self.capacity = capacity_pages
        self._keys: KeySet | LruKeySet = LruKeySet(capacity_pages) if capacity_pages else KeySet()

    @property
    def evicted(self) -> int:
        """Pages dropped to stay within capacity, so far."""
        return self._keys.evicted if isinstance(self._keys, LruKeySet) else 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def prefix_hits(self, keys: Sequence[int], start: int = 0) -> int:
        """Consecutive keys from `keys[start]` that storage holds."""
        return prefix_hits(self._keys, keys, start)

    def touch(self, keys: Iterable[int]) -> None:
        """Mark keys as just used (only a bounded store keeps recency)."""
        if isinstance(self._keys, LruKeySet):
            self._keys.touch(as_keys(keys))

    def add(self, keys: Iterable[int]) -> None:
        """Hold `keys` (refreshing those already held), then drop the least recently used
        beyond capacity."""
        self._keys.add(as_keys(keys))
