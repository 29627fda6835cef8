"""Fixed-capacity slot allocators for one cache tier (L1 device pages, L2 host pages).

Every slot is either free or owned by exactly one owner (the tree, a request, an in-flight
operation); ownership moves explicitly with `transfer`, so a leak or a double use is an error
at the point it happens rather than corrupted KV later.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from hicache.core.errors import PoolError

Owner = Hashable


class SlotPool:
    """A pool of `capacity` page slots numbered 0..capacity-1."""

    __slots__ = ("name", "capacity", "_free", "_owner")

    def __init__(self, name: str, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{name} pool: capacity must be an integer >= 0 pages, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        # Reversed so that pop() hands out low slot numbers first (deterministic and readable).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._owner: list[Owner | None] = [None] * capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int, owner: Owner) -> list[int] | None:
        """Take `n` free slots for `owner`, or None (taking nothing) when fewer are free."""
        if n < 0:
            raise PoolError(f"{self.name} pool: cannot allocate {n} slots")
        if owner is None:
            raise PoolError(f"{self.name} pool: an allocation needs an owner")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        free = self._free
        slots = free[-n:]
        del free[-n:]
        slots.reverse()
        own = self._owner
        for s in slots:
            own[s] = owner
        return slots

    def free(self, slots: Iterable[int], owner: Owner) -> None:
        """Return `owner`'s slots to the pool; all are checked before any is freed."""
        slots = list(slots)
        self._check_owned(slots, owner, "free")
        own = self._owner
        for s in slots:
            own[s] = None
        self._free.extend(reversed(slots))

    def transfer(self, slots: Iterable[int], src: Owner, dst: Owner) -> None:
        """Move ownership of `slots` from `src` to `dst` (e.g. a request's KV adopted by the tree)."""
        if dst is None:
            raise PoolError(f"{self.name} pool: transfer needs a destination owner")
        slots = list(slots)
        self._check_owned(slots, src, "transfer")
        own = self._owner
        for s in slots:
            own[s] = dst

    def owner_of(self, slot: int) -> Owner | None:
        return self._owner[slot]

    def owned_by(self, owner: Owner) -> list[int]:
        """All slots of `owner` (a scan: for checks and tests, not the hot path)."""
        return [s for s, o in enumerate(self._owner) if o == owner]

    def free_slots(self) -> list[int]:
        return list(self._free)

    def _check_owned(self, slots: Sequence[int], owner: Owner, what: str) -> None:
        own = self._owner
        if slots and min(slots) >= 0 and max(slots) < self.capacity:
            # The common case, checked at C speed: distinct slots, all held by `owner`.
            owners = [own[s] for s in slots]
            if owners.count(owner) == len(slots) and len(set(slots)) == len(slots):
                return
        seen: set[int] = set()
        for s in slots:
            if not (0 <= s < self.capacity):
                raise PoolError(f"{self.name} pool: {what} of slot {s} outside 0..{self.capacity - 1}")
            if s in seen:
                raise PoolError(f"{self.name} pool: {what} names slot {s} twice")
            seen.add(s)
            if own[s] != owner:
                held = "free" if own[s] is None else f"owned by {own[s]!r}"
                raise PoolError(f"{self.name} pool: {what} of slot {s} by {owner!r}, but it is {held}")

    def check(self) -> None:
        """Assert the pool's own invariant: free and owned partition the slots, no duplicates."""
        free = self._free
        if len(set(free)) != len(free):
            raise PoolError(f"{self.name} pool: a slot is on the free list twice")
        for s in free:
            if self._owner[s] is not None:
                raise PoolError(f"{self.name} pool: slot {s} is free and owned by {self._owner[s]!r}")
        owned = sum(1 for o in self._owner if o is not None)
        if owned + len(free) != self.capacity:
            lost = self.capacity - owned - len(free)
            raise PoolError(f"{self.name} pool: {lost} slots are neither free nor owned")
