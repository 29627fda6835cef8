"""Fixed-capacity slot allocators for one cache tier (L1 device pages, L2 host pages).

Every slot is either free or owned by exactly one owner (the tree, a request, an in-flight
operation); ownership moves explicitly with `transfer`, so a leak or a double use is an error
at the point it happens rather than corrupted KV later.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from operator import itemgetter, length_hint

from hicache.core.errors import PoolError

Owner = Hashable


class SlotPool:
    """A pool of `capacity` page slots numbered 0..capacity-1."""

    __slots__ = ("name", "capacity", "_free", "_owner")

    def __init__(self, name: str, capacity: object) -> None:
        # `object`, checked here: a float or a bool is refused with the field's name (a compiled
        # `int` parameter would take a bool and meet a float with a bare TypeError).
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{name} pool: capacity must be an integer >= 0 pages, got {capacity!r}")
        self.name = name
        self.capacity: int = capacity
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
        self._assign(slots, owner)
        return slots

    def free(self, slots: Iterable[int], owner: Owner, *, checked: bool = False) -> None:
        """Return `owner`'s slots to the pool; all are checked before any is freed.

        `checked=True` skips the check, for a caller whose own invariants already guarantee
        that `owner` holds exactly these distinct slots (the tree freeing a node's slots)."""
        if checked and isinstance(slots, tuple):  # a tree node's own slots: no copy
            self._release(slots)
            return
        slots = list(slots)
        if checked:
            self._assign(slots, None)
        elif not self._move(slots, owner, None):
            self._check_owned(slots, owner, "free")
        self._free.extend(slots[::-1])

    def transfer(self, slots: Iterable[int], src: Owner, dst: Owner, *, checked: bool = False) -> None:
        """Move ownership of `slots` from `src` to `dst` (e.g. a request's KV adopted by the tree).

        `checked=True`: as for `free`, the caller guarantees that `src` holds these slots."""
        if dst is None:
            raise PoolError(f"{self.name} pool: transfer needs a destination owner")
        slots = list(slots)
        if checked:
            self._assign(slots, dst)
        elif not self._move(slots, src, dst):
            self._check_owned(slots, src, "transfer")

    def adopt(self, slots: list[int], release: list[int], owner: Owner, dst: Owner) -> bool:
        """All or nothing: `slots` pass from `owner` to `dst` and `release` returns to the pool,
        if together they are distinct slots held by `owner`. Otherwise nothing changes and the
        result is False (`free` / `transfer` then name the culprit). An insert validates and
        moves its slots in this one call."""
        if owner is None or dst is None or dst == owner:
            return False
        if not self._move_each(slots, owner, dst):
            return False
        if not self._move_each(release, owner, None):  # also a slot named in both batches
            self._assign(slots, owner)
            return False
        self._free.extend(release[::-1])
        return True

    def _move(self, slots: list[int], owner: Owner, new: Owner | None) -> bool:
        """Give each of `slots` to `new` if all are distinct slots of the pool held by `owner`;
        otherwise change nothing and return False."""
        if new == owner:  # a no-op move: check only
            if not self._holds(slots, owner):
                return False
            self._assign(slots, new)
            return True
        return self._move_each(slots, owner, new)

    def _move_each(self, slots: list[int], owner: Owner, new: Owner | None) -> bool:
        """`_move` for `new` other than `owner`, one slot at a time (compiled, a plain loop is
        faster than finding runs of consecutive slots and writing them as slices).

        Checking and writing share one loop: a slot named twice is caught because its first
        visit already gave it to `new`; a failure undoes the slots written so far."""
        own = self._owner
        it = iter(slots)
        try:
            for s in it:
                if s < 0:
                    break
                if own[s] is not owner and own[s] != owner:
                    break
                own[s] = new
            else:
                return True
        except (IndexError, TypeError):  # a slot past the end, or not an integer
            pass
        # The iterator knows how far it got: the slots before the one that failed were written.
        for s in slots[: len(slots) - 1 - length_hint(it)]:
            own[s] = owner
        return False

    def _release(self, slots: tuple[int, ...]) -> None:
        own = self._owner
        for s in slots:
            own[s] = None
        self._free.extend(slots[::-1])

    def _assign(self, slots: list[int], owner: Owner | None) -> None:
        """Set the owner of every slot in `slots` (valid and distinct)."""
        own = self._owner
        for s in slots:
            own[s] = owner

    def _holds(self, slots: list[int], owner: Owner) -> bool:
        """Whether `slots` are distinct slots of this pool, all owned by `owner` (no change)."""
        n = len(slots)
        if n <= 1:
            return not slots or (0 <= slots[0] < self.capacity and self._owner[slots[0]] == owner)
        ordered = sorted(slots)
        if ordered[0] < 0 or ordered[-1] >= self.capacity:
            return False
        return itemgetter(*slots)(self._owner).count(owner) == n and len(set(ordered)) == n

    def owner_of(self, slot: int) -> Owner | None:
        return self._owner[slot]

    def owned_by(self, owner: Owner) -> list[int]:
        """All slots of `owner` (a scan: for checks and tests, not the hot path)."""
        return [s for s, o in enumerate(self._owner) if o == owner]

    def owns_exactly(self, owner: Owner, slots: set[int]) -> bool:
        """Whether `owner` holds `slots` and no other slot (a check, at C speed per slot)."""
        own = self._owner
        cap = self.capacity
        return own.count(owner) == len(slots) and all(0 <= s < cap and own[s] == owner for s in slots)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def _check_owned(self, slots: list[int], owner: Owner, what: str) -> None:
        """Raise a PoolError naming the first slot of `slots` that `owner` cannot give up."""
        own = self._owner
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
        own = self._owner
        if len(set(free)) != len(free):
            raise PoolError(f"{self.name} pool: a slot is on the free list twice")
        for s in free:
            if own[s] is not None:
                raise PoolError(f"{self.name} pool: slot {s} is free and owned by {own[s]!r}")
        owned = self.capacity - own.count(None)
        if owned + len(free) != self.capacity:
            lost = self.capacity - owned - len(free)
            raise PoolError(f"{self.name} pool: {lost} slots are neither free nor owned")
