"""A prefill node's cache decisions, in pages: what of a prompt is cached, what is computed, what
enters its tree and what leaves it.

The simulator's prefill node and the runtime's both make these decisions here and only carry
them out: the runtime moves KV between its L1, L2 and L3 pages and runs the model, the simulator
turns the same pages into time on its channels. One prompt at a time holds the tree, in order:

1. `match`: the tree's L1 prefix (locked) and the L2 prefix after it (pinned: it is copied back
   into L1);
2. `take_l3`: of the pages after those that L3 holds, all when reading them is not slower than
   computing them (`restore_pays`), else none;
3. `reserve`: L1 slots for every full page the tree lacks on L1 (its L2 pages, L3 pages and
   computed pages), plus the pages a driver computes in; room comes from the tree's eviction
   policy, and without room there are no slots;
4. `restored`: the L2 pages are back on L1, so L2 may make room again;
5. `finish`: the prompt's full pages enter the tree (which adopts the new slots and frees
   duplicates), write-through backups are carried out, and what the prompt still holds is let go;
   `finish(insert=False)` lets go without inserting (a prompt that failed or was not cached).

The last prompt token is always computed, since it yields the first output token: at most all
but one token count as cached (`cached_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.core.commands import Backup
from hicache.core.pool import Owner, SlotPool
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.restore_cost import restore_pays
from hicache.core.tree import TieredRadixTree

# Carries out one write-through backup (copies its L1 pages to its L2 slots) and says whether
# they arrived. None: backups complete as they are issued (the simulator does not model them).
BackupCopy = Callable[[Backup], bool]


class PrefillPlan:
    """One prompt's pages while it holds the tree: where its prefix is, and the slots it holds."""

    __slots__ = (
        "owner",
        "keys",
        "prompt_len",
        "page_size",
        "device_pages",
        "host_pages",
        "device_slots",
        "host_slots",
        "l3_pages",
        "l3_declined",
        "slots",
        "lock",
        "pin",
        "done",
    )

    def __init__(
        self,
        owner: Owner,
        keys: Sequence[int],
        prompt_len: int,
        page_size: int,
        device_pages: int,
        host_pages: int,
        device_slots: list[int],
        host_slots: list[int],
        lock: LockReceipt | None,
        pin: HostPin | None,
    ) -> None:
        self.owner = owner
        self.keys = keys  # the prompt's full pages' keys
        self.prompt_len = prompt_len
        self.page_size = page_size
        self.device_pages = device_pages  # leading pages on L1 (locked)
        self.host_pages = host_pages  # the pages after them on L2 (pinned until `restored`)
        self.device_slots = device_slots
        self.host_slots = host_slots
        self.l3_pages = 0  # the pages after those to read from L3 (`take_l3`)
        self.l3_declined = 0  # pages L3 held that are computed instead: reading was slower
        self.slots: list[int] | None = None  # L1 slots it reserved: the tree lacks pages [d, full)
        self.lock = lock
        self.pin = pin
        self.done = False

    @property
    def restore_pages(self) -> int:
        """Leading pages it need not compute, if every restore arrives."""
        return self.device_pages + self.host_pages + self.l3_pages

    def table(self) -> list[int]:
        """Its L1 page table: the L1 prefix's slots, then the reserved ones in page order."""
        return self.device_slots + (self.slots or [])

    def cached_tokens(self, pages: int) -> int:
        """Prompt tokens not computed when its first `pages` pages are here: all but the last."""
        return min(pages * self.page_size, self.prompt_len - 1)


def attribute(start: int, l1: int, l2: int, l3: int) -> tuple[int, int, int]:
    """Tokens before `start` by source, in prompt order (L1, then L2, then L3)."""
    a = min(l1, start)
    b = min(l2, start - a)
    return a, b, min(l3, start - a - b)


class PrefillPlanner:
    """The prefill node's L1 and L2 pages under the core's tiered tree (write-through), and the
    decisions above over them."""

    def __init__(
        self,
        name: str,
        l1_pages: int,
        l2_pages: int,
        page_size: int,
        *,
        eviction: str = "lru",
        copy_backup: BackupCopy | None = None,
    ) -> None:
        self.page_size = page_size
        self.tree = TieredRadixTree(
            SlotPool(f"{name}.L1", l1_pages),
            SlotPool(f"{name}.L2", l2_pages),
            eviction=eviction,
            write_policy="write_through",
        )
        self.copy_backup = copy_backup

    def fits(self, prompt_len: int, work_pages: int = 1) -> bool:
        """Whether a prompt's every page, and `work_pages` more, fit in L1 at once: a driver
        that computes into L1 pages needs them all there (the tree may still lack the room)."""
        return -(-prompt_len // self.page_size) + work_pages <= self.tree.device_pool.capacity

    def match(self, keys: Sequence[int], prompt_len: int, owner: Owner, now: float) -> PrefillPlan:
        """The prompt's cached prefix: its L1 part locked, the L2 part after it pinned."""
        tree = self.tree
        m = tree.match(keys, now)
        self._backups()
        lock = tree.lock(m.device_node)
        pin = tree.pin_host(m.host_node) if m.host_pages else None
        return PrefillPlan(
            owner,
            keys,
            prompt_len,
            self.page_size,
            m.device_pages,
            m.host_pages,
            m.device_slots,
            m.host_slots,
            lock,
            pin,
        )

    def take_l3(
        self,
        plan: PrefillPlan,
        held: int,
        read_seconds: Callable[[int], float],
        compute_seconds: Callable[[int], float],
    ) -> int:
        """Of the `held` pages L3 holds after the tree's prefix, how many to read: all, unless
        reading them (`read_seconds(pages)`) is slower than computing them
        (`compute_seconds(pages)`); then none, and they count as declined."""
        start = plan.device_pages + plan.host_pages
        held = max(0, min(held, len(plan.keys) - start))
        if held and not restore_pays(read_seconds(held), compute_seconds(held)):
            plan.l3_declined = held
            held = 0
        plan.l3_pages = held
        return held

    def reserve(self, plan: PrefillPlan, work_pages: int = 0) -> list[int] | None:
        """L1 slots for the full pages the tree lacks on L1 and `work_pages` more (in that
        order), evicting what the tree's policy gives up; None when even that leaves no room."""
        pool = self.tree.device_pool
        need = len(plan.keys) - plan.device_pages + work_pages
        if need > pool.num_free:
            self.tree.evict_device(need - pool.num_free)
            self._backups()
        plan.slots = pool.alloc(need, plan.owner) if need <= pool.num_free else None
        return plan.slots

    def restored(self, plan: PrefillPlan) -> None:
        """Its L2 pages are back on L1: L2 may evict them again."""
        if plan.pin is not None:
            pin, plan.pin = plan.pin, None
            self.tree.unpin_host(pin)

    def finish(self, plan: PrefillPlan, now: float, insert: bool = True, pages: int | None = None) -> None:
        """Let the prompt go: with `insert` and reserved slots, its full pages (or its first
        `pages` of them: all a prompt stopped part-way computed) enter the tree first. Slots
        the tree did not adopt (work pages, or all of them) are freed. Calling it again does
        nothing, so a driver may also call it on its way out of a failure."""
        if plan.done:
            return
        tree = self.tree
        self.restored(plan)
        if plan.lock is not None:
            lock, plan.lock = plan.lock, None
            tree.unlock(lock)
        slots = plan.slots
        if insert and slots is not None:
            full = len(plan.keys) if pages is None else max(0, min(pages, len(plan.keys)))
            if pages is None or full > plan.device_pages:
                own = slots[: full - plan.device_pages]
                tree.insert(plan.keys[:full], plan.device_slots + own, plan.owner, now)
        self._backups()
        plan.done = True
        if slots:
            pool = tree.device_pool
            left = [s for s in slots if pool.owner_of(s) == plan.owner]
            if left:
                pool.free(left, plan.owner)

    def _backups(self) -> None:
        """Carry out the tree's write-through backups now."""
        tree = self.tree
        copy = self.copy_backup
        for c in tree.drain():
            if isinstance(c, Backup):
                if copy is None or copy(c):
                    tree.backup_done(c.op)
                else:
                    tree.backup_done(c.op, tuple(range(len(c.device_slots))))  # none arrived
