"""The shared L3: which page keys storage holds, and the one channel all nodes read and write
through. Capacity is in pages; beyond it the least recently used pages go (0 = unbounded)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hicache.sim.channel import Channel


class SharedStore:
    def __init__(self, channel: Channel, capacity_pages: int = 0) -> None:
        self.channel = channel
        self.capacity = capacity_pages
        self._keys: dict[int, None] = {}  # insertion order is recency order
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def prefix_hits(self, keys: Sequence[int], start: int = 0) -> int:
        """Consecutive keys from `keys[start]` that storage holds."""
        n = start
        held = self._keys
        while n < len(keys) and keys[n] in held:
            n += 1
        return n - start

    def touch(self, keys: Iterable[int]) -> None:
        """Mark keys as just used (only a bounded store keeps recency)."""
        if self.capacity:
            held = self._keys
            for k in keys:
                if k in held:
                    del held[k]
                    held[k] = None

    def add(self, keys: Iterable[int]) -> None:
        held = self._keys
        if not self.capacity:
            held.update(dict.fromkeys(keys))
            return
        for k in keys:
            held.pop(k, None)
            held[k] = None
        while len(held) > self.capacity:
            del held[next(iter(held))]
            self.evicted += 1
