"""The tiered radix tree: which pages of which prefixes L1 and L2 hold, and what to evict.

Nodes hold runs of chained page keys; a child is found by the key of its first page in O(1).
The tree decides and records; the copies it needs (backups L1->L2, stores L2->L3) leave it as
commands in `outbox`, and their completions come back through `backup_done` / `store_done`,
each naming the pages that failed: a page is marked present on a tier only once its bytes are
there. An L2 copy found bad (`drop_host`) leaves the tree at once; slots that a pin or an
operation in flight still uses are freed when it lets go ("retired" slots).

Invariants (checked by `check`, property-tested):
- every node except the root holds its pages on L1, on L2, or on both;
- nodes holding L1 slots form a root-connected prefix of every path, and so do nodes
  holding L2 slots;
- `lock_ref > 0` nodes keep their L1 slots; `host_ref > 0` nodes keep their L2 slots;
- every slot the tree holds is owned by the tree in its pool, and by one node only (or is
  retired, waiting for the pins and operations that still use it);
- no node is demoted to L2 only while an ancestor's L2 copy is still being written, so a failed
  backup never strands an L2-only node below a node without an L2 copy.

The tree is one class built in parts, a module each. Each part subclasses the one above it in
this list and calls only what is above it: a chain, not mixins or objects composed, so that the
compiled build reads every field at a fixed offset and calls most methods directly, as when the
tree was one module (mypyc takes several bases only as traits, reached through lookups).

    TreeStructure   tree_structure.py   nodes, splits, eviction queues, operations in flight,
                                        retired L2 slots
    TreeEviction    tree_eviction.py    freeing L1 and L2 pages, lowest priority first
    TreeStores      tree_stores.py      L2 -> L3 copies (`Store`) and their ends
    TreeBackups     tree_backups.py     L1 -> L2 copies (`Backup`), their ends, bad L2 copies
    TieredRadixTree tree.py             match, insert, locks and pins, the invariant check

One call goes the other way: a write-back eviction backs its victim up first
(`TreeEviction._backup_path`, which `TreeBackups` defines). The counters and results are in
`tree_results`, the check of a completion's failed pages in `failed_pages`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache.core.errors import CoreError, LockError
from hicache.core.failed_pages import failed_pages, first_failed
from hicache.core.node import TreeNode
from hicache.core.pool import Owner
from hicache.core.prefix_match import DecodePrefixMatch
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.tree_backups import TreeBackups
from hicache.core.tree_results import BackupResult, EvictResult, InsertResult, TreeStats
from hicache.core.tree_structure import TREE
from hicache.core.write_policy import WritePolicy

__all__ = [
    "TREE",
    "BackupResult",
    "EvictResult",
    "InsertResult",
    "TieredRadixTree",
    "TreeStats",
    "failed_pages",
    "first_failed",
]


class TieredRadixTree(TreeBackups):
    """A page-granular radix tree over an L1 (device) pool and an L2 (host) pool."""

    # ------------------------------------------------------------------ match

    def match(self, keys: Sequence[int] | np.ndarray, now: float) -> DecodePrefixMatch:
        """Match `keys` (chained page keys) against L1 then L2, splitting a node where the
        match ends inside it so the anchors are exact. Counts a use of every matched node."""
        keys = _as_tuple(keys)
        n = len(keys)
        i = 0
        node = self.root
        device_node = self.root
        device_pages = 0
        device_slots: list[int] = []
        host_slots: list[int] = []
        lazy = self._lazy
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.keys
            size = len(ck)
            if not (i + size <= n and ck[-1] == keys[i + size - 1] and ck == keys[i : i + size]):
                size = _common_prefix(ck, keys, i)
                child = self._split(child, size)
            node = child
            i += size
            node.hit_count += 1
            if lazy and now >= node.last_access:
                node.last_access = now  # the queued entry stays a lower bound of the key
                if node.device is not None:
                    if not node.l1_queued:
                        self._push_l1(node)
                elif not node.l2_queued and not node.children:
                    self._push_l2(node)
            else:
                self._touch(node, now)
            if node.device is not None:
                device_slots += node.device
                device_node = node
                device_pages = i
            else:
                host_slots += node.host  # type: ignore[arg-type]  # every node holds a tier
        self.stats.matched_device += device_pages
        self.stats.matched_host += i - device_pages
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._backup_hot(device_node)
        return DecodePrefixMatch(
            query_pages=n,
            device_pages=device_pages,
            host_pages=i - device_pages,
            device_slots=device_slots,
            host_slots=host_slots,
            device_node=device_node,
            host_node=node,
        )

    def peek(self, keys: Sequence[int]) -> int:
        """How many leading pages of `keys` the tree holds (L1 or L2), changing nothing: no
        split, no access counted. A router asks this of every node before choosing one."""
        keys = _as_tuple(keys)
        i, n = 0, len(keys)
        node = self.root
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            size = _common_prefix(child.keys, keys, i)
            i += size
            if size < len(child.keys):
                break
            node = child
        return i

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        keys: Sequence[int] | np.ndarray,
        device_slots: Sequence[int],
        owner: Owner,
        now: float,
        priority: int = 0,
    ) -> InsertResult:
        """Insert a finished sequence whose KV sits in `device_slots` (one per page, owned by
        `owner`). The tree adopts the slots of pages it lacks on L1 and frees the duplicates,
        so `owner` holds none of them afterwards."""
        keys = _as_tuple(keys)
        n = len(keys)
        if len(device_slots) != n:
            raise CoreError(f"insert: {n} page keys but {len(device_slots)} device slots")
        if not isinstance(device_slots, list):
            device_slots = list(device_slots)
        # Find the path first and validate everything before changing anything (not even a split).
        path: list[TreeNode] = []
        held: list[int] = []  # the L1 slots of the path's L1 prefix (L1 nodes are root-connected)
        node = self.root
        i = 0
        cut = 0  # > 0: the walk ends after this many pages of the last node on the path
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.keys
            size = len(ck)
            if not (i + size <= n and ck[-1] == keys[i + size - 1] and ck == keys[i : i + size]):
                cut = size = _common_prefix(ck, keys, i)
            path.append(child)
            if child.device is not None:
                held += child.device[:size] if cut else child.device
            i += size
            if cut:
                break
            node = child
        h = len(held)
        # The pages already on L1 may come as the tree's own slots (the request's locked prefix)
        # or as the caller's duplicates; a slot of `owner` is never one of the tree's.
        duplicates = [] if device_slots[:h] == held else device_slots[:h]
        adopted = device_slots[h:]  # the slots of the pages L1 lacks
        pool = self.device_pool
        # One pass validates and moves at once: the new pages' slots to the tree, duplicates
        # back to the pool. Anything else (a bad slot, or L1 pages given partly as the tree's
        # own slots) takes the per-slot path, which names the first bad slot.
        if owner == TREE or not pool.adopt(adopted, duplicates, owner, TREE):
            duplicates = self._check_insert_slots(device_slots, held, owner)
            pool.transfer(adopted, owner, TREE, checked=True)
            pool.free(duplicates, owner, checked=True)
        if cut:
            path[-1] = self._split(path[-1], cut)
        fresh = tuple(adopted)  # nodes keep tuples (see TreeNode); page i is fresh[i - h]
        lazy = self._lazy
        i = 0
        for node in path:
            size = len(node.keys)
            if node.device is None:  # host-only: back on L1 with the caller's slots
                node.device = fresh[i - h : i - h + size]
                node.parent.dev_children += 1  # type: ignore[union-attr]
                self._queue_l1(node)
            if priority > node.priority:
                node.priority = priority
            if lazy and now >= node.last_access and node.l1_queued:
                node.last_access = now  # on L1 and queued: the entry stays a lower bound
            else:
                self._touch(node, now)
            i += size
        node = path[-1] if path else self.root
        if i < n:
            leaf = TreeNode(next(self._node_ids), keys[i:], node, next(self._created))
            leaf.hit_count = 1
            leaf.priority = priority
            leaf.last_access = now
            node.children[keys[i]] = leaf
            node.dev_children += 1
            self.num_nodes += 1
            self._by_id[leaf.id] = leaf
            leaf.device = fresh[i - h :]
            self._push_l1(leaf)
            node = leaf
        self.stats.inserted += n - h
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._backup_path(node)
        elif self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._backup_hot(node)
        return InsertResult(cached_pages=h, adopted_pages=n - h)

    def _check_insert_slots(self, device_slots: list[int], held: list[int], owner: Owner) -> list[int]:
        """The per-slot check of an insert's slots, naming the first bad one; returns the
        duplicates to free (the slots of L1 pages that are not the tree's own)."""
        own = self.device_pool._owner
        cap = self.device_pool.capacity
        h = len(held)
        for j, s in enumerate(device_slots):
            if j < h and s == held[j]:
                continue
            if not (0 <= s < cap) or own[s] != owner:
                raise CoreError(f"insert: slot {s} for page {j} is not owned by {owner!r}")
        if len(set(device_slots)) != len(device_slots):
            raise CoreError("insert: a device slot is given for two pages")
        return [s for s, t in zip(device_slots[:h], held, strict=True) if s != t]

    # ------------------------------------------------------------------ locks and pins

    def lock(self, node: TreeNode) -> LockReceipt:
        """Protect the L1 slots of `node` and its ancestors until the receipt is unlocked."""
        if node is not self.root and node.device is None:
            raise LockError(f"lock: {node!r} holds no L1 slots")
        receipt = LockReceipt(self.id, next(self._serials), node)
        self._locks[receipt.serial] = receipt
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        return receipt

    def unlock(self, receipt: LockReceipt) -> None:
        if receipt.tree_id != self.id or self._locks.pop(receipt.serial, None) is not receipt:
            raise LockError(f"unlock: lock receipt #{receipt.serial} is not held on this tree")
        node = receipt.node
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._queue_l1(node)
            node = node.parent  # type: ignore[assignment]

    def pin_host(self, node: TreeNode) -> HostPin:
        """Protect the L2 slots of `node` and its ancestors until the pin is released."""
        if node is not self.root and node.host is None:
            raise LockError(f"pin_host: {node!r} holds no L2 slots")
        pin = HostPin(self.id, next(self._serials), node)
        self._pins[pin.serial] = pin
        while node is not self.root:
            node.host_ref += 1
            node = node.parent  # type: ignore[assignment]
        return pin

    def unpin_host(self, pin: HostPin) -> None:
        if pin.tree_id != self.id or self._pins.pop(pin.serial, None) is not pin:
            raise LockError(f"unpin_host: host pin #{pin.serial} is not held on this tree")
        node = pin.node
        while node is not self.root:
            node.host_ref -= 1
            if node.host_ref == 0:
                if node in self._retired:
                    self._free_retired(node)
                if not node.detached:
                    self._queue_l2(node)
            node = node.parent  # type: ignore[assignment]

    @property
    def live_locks(self) -> list[LockReceipt]:
        return list(self._locks.values())

    @property
    def live_pins(self) -> list[HostPin]:
        return list(self._pins.values())

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Verify every structural invariant; raise CoreError naming the first one broken."""
        dev_seen: set[int] = set()
        host_seen: set[int] = set()
        lock_expect: dict[int, int] = {}
        pin_expect: dict[int, int] = {}
        for receipts, expect in ((self._locks, lock_expect), (self._pins, pin_expect)):
            for r in receipts.values():
                n = r.node
                while n is not self.root:
                    if n.parent is None:
                        raise CoreError(f"receipt #{r.serial} holds {n!r}, which left the tree")
                    expect[n.id] = expect.get(n.id, 0) + 1
                    n = n.parent
        count = 0
        stack = [(c, self.root) for c in self.root.children.values()]
        while stack:
            n, parent = stack.pop()
            count += 1
            problem = self._node_problem(n, parent, lock_expect, pin_expect)
            if problem is None:
                for slots, seen, name in ((n.device, dev_seen, "L1"), (n.host, host_seen, "L2")):
                    if slots is not None:
                        problem = _claim(slots, seen, name)
                        if problem is not None:
                            break
            if problem is not None:
                raise CoreError(f"tree check: {n!r}: {problem}")
            stack.extend((c, n) for c in n.children.values())
        if count != self.num_nodes:
            raise CoreError(f"tree check: num_nodes {self.num_nodes}, found {count}")
        if len(self._by_id) != count:
            raise CoreError(f"tree check: {len(self._by_id)} nodes by id, found {count}")
        for node, retired in self._retired.items():
            if not (node.ops or node.host_ref):
                raise CoreError(f"tree check: {node!r} keeps retired L2 slots that nothing uses")
            for slots in retired:
                for s in slots:
                    if s in host_seen:
                        raise CoreError(f"tree check: retired L2 slot {s} also held by a node")
                    host_seen.add(s)
        for pool, seen in ((self.device_pool, dev_seen), (self.host_pool, host_seen)):
            pool.check()
            if not pool.owns_exactly(TREE, seen):
                raise CoreError(
                    f"tree check: {pool.name} pool gives the tree {len(pool.owned_by(TREE))} slots,"
                    f" nodes hold {len(seen)}"
                )

    def _node_problem(
        self, n: TreeNode, parent: TreeNode, lock_expect: dict[int, int], pin_expect: dict[int, int]
    ) -> str | None:
        """The first invariant `n` (a child of `parent`) breaks on its own, or None."""
        if n.parent is not parent or parent.children.get(n.keys[0]) is not n:
            return "parent link broken"
        if self._by_id.get(n.id) is not n:
            return "not found by its id"
        if not n.keys:
            return "holds no pages"
        if n.device is None and n.host is None:
            return "held by no tier"
        for slots, name in ((n.device, "L1"), (n.host, "L2")):
            if slots is not None and len(slots) != len(n.keys):
                return f"{len(slots)} {name} slots for {len(n.keys)} pages"
        if n.device is not None and parent is not self.root and parent.device is None:
            return "on L1 below a parent that is not"
        if n.host is not None and parent is not self.root and parent.host is None:
            return "on L2 below a parent that is not"
        if n.host_op and n.host is None:
            return f"backup #{n.host_op} pending without L2 slots"
        if n.host_op and n.device is None:
            return "backup pending without its L1 source"
        if n.host_op and (n.host_op not in n.ops or n.host_op in self._store_ops):
            return f"backup #{n.host_op} pending but not in flight over it"
        if n.evict_after_backup and not n.host_op:
            return "waits to leave L1 after a backup that is not in flight"
        if n.lock_ref != lock_expect.get(n.id, 0):
            return f"lock_ref {n.lock_ref}, receipts say {lock_expect.get(n.id, 0)}"
        if n.host_ref != pin_expect.get(n.id, 0):
            return f"host_ref {n.host_ref}, pins say {pin_expect.get(n.id, 0)}"
        if n.lock_ref and n.device is None:
            return "locked but not on L1"
        dc = 0
        for c in n.children.values():
            if c.device is not None:
                dc += 1
        if dc != n.dev_children:
            return f"dev_children {n.dev_children}, actual {dc}"
        return None


def _claim(slots: tuple[int, ...], seen: set[int], name: str) -> str | None:
    """Add a node's `slots` to those `seen` so far (at C speed: a tree holds every slot of
    its pools); what is wrong when a slot is held twice."""
    before = len(seen)
    if seen.isdisjoint(slots):
        seen.update(slots)
        if len(seen) - before == len(slots):
            return None
        seen.difference_update(slots)  # one is named twice in this node: find it below
    for s in slots:
        if s in seen:
            return f"{name} slot {s} held by two nodes"
        seen.add(s)
    raise AssertionError("unreachable: a repeated slot was found above")


def _as_tuple(keys: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    """Page keys as the tuple that nodes hold and compare against."""
    if isinstance(keys, tuple):
        return keys
    return tuple(keys.tolist() if isinstance(keys, np.ndarray) else keys)


def _common_prefix(node_keys: tuple[int, ...], keys: tuple[int, ...], start: int) -> int:
    """Pages of `node_keys` equal to `keys[start:]` from the beginning (at least 1: the child
    was found by its first key). Slice comparisons run at C speed: the whole overlap first,
    then galloping probes and a bisection to the first difference."""
    limit = min(len(node_keys), len(keys) - start)
    if node_keys[:limit] == keys[start : start + limit]:
        return limit
    lo, step = 1, 1  # node_keys[:lo] matches; the first difference is below `limit`
    while lo + step < limit and node_keys[lo : lo + step] == keys[start + lo : start + lo + step]:
        lo += step
        step *= 2
    hi = min(lo + step, limit)  # the first difference lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if node_keys[lo:mid] == keys[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo
