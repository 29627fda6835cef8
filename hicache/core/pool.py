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

    __slots__ = ("name", "capacity", "_free", "_owner", "_numbers")

    def __init__(self, name: str, capacity: object) -> None:
        # `object`, checked here: a float or a bool is refused with the field's name (a compiled
        # `int` parameter would take a bool and meet a float with a bare TypeError).
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{name} pool: capacity must be an integer >= 0 pages, got {capacity!r}")
        self.name = name
        self.capacity: int = capacity
        # 0..capacity-1, to compare a run of slots against in one C-level comparison. The free
        # list shares its int objects, so those comparisons mostly match by identity. A tuple of
        # ints: the garbage collector scans it once, then no more.
        self._numbers: tuple[int, ...] = tuple(range(capacity))
        # Reversed so that pop() hands out low slot numbers first (deterministic and readable).
        self._free: list[int] = list(reversed(self._numbers))
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
        if n < 32:  # too short for runs (see `_runs`)
            own = self._owner
            for s in slots:
                own[s] = owner
        else:
            self._assign(slots, owner)
        return slots

    def free(self, slots: Iterable[int], owner: Owner, *, checked: bool = False) -> None:
        """Return `owner`'s slots to the pool; all are checked before any is freed.

        `checked=True` skips the check, for a caller whose own invariants already guarantee
        that `owner` holds exactly these distinct slots (the tree freeing a node's slots)."""
        slots = list(slots)
        if checked:
            self._assign(slots, None)
        elif not self._move(slots, owner, None):
            self._check_owned(slots, owner, "free")
        self._free.extend(reversed(slots))

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
        own = self._owner
        taken = self._runs(slots)
        freed = self._runs(release)
        # Batches in runs are checked first and written with slices; a batch without runs goes
        # slot by slot after them, so that a slot named in both batches is caught either way.
        if taken is not None and freed is not None:
            if not self._runs_held(taken + freed, owner):
                return False
        elif not self._runs_held(taken or freed or [], owner):
            return False
        for first, n in taken or ():
            own[first : first + n] = [dst] * n
        for first, n in freed or ():
            own[first : first + n] = [None] * n
        if taken is None and not self._move_each(slots, owner, dst):
            if freed is not None:
                self._assign(release, owner)
            return False
        if freed is None and not self._move_each(release, owner, None):
            self._assign(slots, owner)
            return False
        self._free.extend(reversed(release))
        return True

    def _move(self, slots: list[int], owner: Owner, new: Owner | None) -> bool:
        """Give each of `slots` to `new` if all are distinct slots of the pool held by `owner`;
        otherwise change nothing and return False."""
        if new == owner:  # a no-op move: check only
            if not self._holds(slots, owner):
                return False
            self._assign(slots, new)
            return True
        runs = self._runs(slots)
        if runs is None:
            return self._move_each(slots, owner, new)
        if not self._runs_held(runs, owner):
            return False
        own = self._owner
        for first, n in runs:
            own[first : first + n] = [new] * n
        return True

    def _move_each(self, slots: list[int], owner: Owner, new: Owner | None) -> bool:
        """`_move` one slot at a time, for a batch with no long runs (`new` differs from `owner`).

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

    def _runs(self, slots: list[int]) -> list[tuple[int, int]] | None:
        """`slots` as runs of consecutive slot numbers, (first, length) in order, or None when
        the batch is not one or two long runs (then slot by slot is as cheap: measured, batches
        of more runs lost more to finding them than they saved) or names something that is
        not a slot of this pool.

        A run's end is found by bisecting over single slots (a batch that is one run takes one
        probe), then the whole run is confirmed with one C-level list comparison against
        0..capacity-1, so the cost per slot is a comparison, not a Python loop iteration."""
        n = len(slots)
        if n < 32:
            return [] if n == 0 else None
        numbers = self._numbers
        cap = self.capacity
        runs: list[tuple[int, int]] = []
        a = 0
        try:
            # Quartile probes: a stretch between two probes whose slot numbers differ by other
            # than their distance holds a break, and two such stretches mean three runs or more.
            # Most fragmented batches stop here instead of after finding two runs.
            q1, q2, q3 = n >> 2, n >> 1, (3 * n) >> 2
            x1, x2, x3, x4 = slots[q1], slots[q2], slots[q3], slots[-1]
            if (x1 - slots[0] != q1) + (x2 - x1 != q2 - q1) + (x3 - x2 != q3 - q2) + (
                x4 - x3 != n - 1 - q3
            ) > 1:
                return None
            while a < n:
                first = slots[a]
                if not 0 <= first < cap or len(runs) == 2:
                    return None
                end = a + cap - first  # a run cannot pass the pool's last slot
                if end > n:
                    end = n
                base = first - a  # along the run, slots[j] == base + j
                if a + 32 <= n and (a + 32 > end or slots[a + 31] != base + a + 31):
                    return None  # a short run, and more slots after it
                last, bad = a, end  # slots[last] is on the run; the run ends before `bad`
                if slots[end - 1] == base + end - 1:
                    last = end - 1
                while bad - last > 1:
                    mid = (last + bad) >> 1
                    if slots[mid] == base + mid:
                        last = mid
                    else:
                        bad = mid
                if tuple(slots[a : last + 1]) != numbers[first : base + last + 1]:
                    # A later stretch happened to line up with this run: find its end slot by slot.
                    last = a
                    while last + 1 < end and slots[last + 1] == base + last + 1:
                        last += 1
                runs.append((first, last + 1 - a))
                a = last + 1
        except TypeError:  # not an integer
            return None
        return runs

    def _runs_held(self, runs: list[tuple[int, int]], owner: Owner) -> bool:
        """Whether the runs are disjoint and every slot in them is held by `owner`."""
        own = self._owner
        for first, n in runs:
            if own[first : first + n].count(owner) != n:
                return False
        if len(runs) > 1:
            ordered = sorted(runs)
            end = -1
            for first, n in ordered:
                if first < end:
                    return False
                end = first + n
        return True

    def _assign(self, slots: list[int], owner: Owner | None) -> None:
        """Set the owner of every slot in `slots` (valid and distinct), run by run when they
        come in runs."""
        own = self._owner
        runs = self._runs(slots) if len(slots) >= 32 else None  # shorter batches have no runs
        if runs is None:
            for s in slots:
                own[s] = owner
        else:
            for first, n in runs:
                own[first : first + n] = [owner] * n

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
        if len(set(free)) != len(free):
            raise PoolError(f"{self.name} pool: a slot is on the free list twice")
        for s in free:
            if self._owner[s] is not None:
                raise PoolError(f"{self.name} pool: slot {s} is free and owned by {self._owner[s]!r}")
        owned = sum(1 for o in self._owner if o is not None)
        if owned + len(free) != self.capacity:
            lost = self.capacity - owned - len(free)
            raise PoolError(f"{self.name} pool: {lost} slots are neither free nor owned")
