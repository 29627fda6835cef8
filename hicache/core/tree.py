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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from hicache.core.commands import Backup, Command, Store
from hicache.core.errors import CoreError, LockError
from hicache.core.eviction import RISE_ON_USE, EvictionPolicy, eviction_policy
from hicache.core.node import TreeNode
from hicache.core.pool import Owner, SlotPool
from hicache.core.prefix_match import DecodePrefixMatch
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.value import Value
from hicache.core.write_policy import WritePolicy

TREE: Owner = "tree"
"""The pool owner of every slot held by a tree node."""

_tree_ids = itertools.count(1)


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


class TieredRadixTree:
    """A page-granular radix tree over an L1 (device) pool and an L2 (host) pool."""

    def __init__(
        self,
        device_pool: SlotPool,
        host_pool: SlotPool,
        *,
        eviction: str = "lru",
        write_policy: str | WritePolicy = "write_through",
        store_to_l3: bool = False,
        store_backlog_pages: int | None = None,
        on_host_evict: Callable[[list[int]], None] | None = None,
        ids: Iterator[int] | None = None,
    ) -> None:
        """`ids` hands out the ids of the tree's commands; a decode node passes the counter its
        own commands use, so no two commands in flight share an id."""
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.eviction_name = eviction
        self._priority: EvictionPolicy = eviction_policy(eviction)
        # Whether a use may leave a node's heap entry in place (its key only rises; see RISE_ON_USE).
        self._lazy = eviction in RISE_ON_USE
        self.write_policy = WritePolicy.parse(write_policy)
        self.store_to_l3 = store_to_l3
        # L2 pages a Store is reading cannot be evicted; when storage falls behind, capping
        # the backlog keeps L2 usable (the pages are simply not written to L3). None: no cap.
        self.store_backlog_pages = store_backlog_pages
        self.store_pending = 0
        self.on_host_evict = on_host_evict  # told the keys of every page that leaves L2
        self.id = next(_tree_ids)
        self._node_ids = itertools.count(1)
        self._created = itertools.count()
        self.root = TreeNode(0, (), None, next(self._created))
        self.num_nodes = 0
        self.outbox: list[Command] = []
        self.stats = TreeStats()
        # Eviction heaps of (*key, version, node id), flat: comparing two entries then compares
        # numbers, not nested tuples (a third of an eviction's time went to that). No node in an
        # entry, so the garbage collector stops scanning an entry after its first collection;
        # `_by_id` finds the node (every node in the tree, not the root; an entry whose node
        # left is skipped).
        self._l1_heap: list[tuple[Any, ...]] = []
        self._l2_heap: list[tuple[Any, ...]] = []
        self._by_id: dict[int, TreeNode] = {}
        self._ops = ids if ids is not None else itertools.count(1)
        # Slots whose nodes gave them up while a pin or an op still used them; freed when it ends.
        self._retired: dict[TreeNode, list[tuple[int, ...]]] = {}
        self._op_nodes: dict[int, list[TreeNode]] = {}
        self._store_ops: set[int] = set()
        self._serials = itertools.count(1)
        self._locks: dict[int, LockReceipt] = {}
        self._pins: dict[int, HostPin] = {}

    # ------------------------------------------------------------------ commands

    def drain(self) -> list[Command]:
        """Take the commands emitted so far."""
        out, self.outbox = self.outbox, []
        return out

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

    # ------------------------------------------------------------------ eviction

    def evict_device(self, pages: int) -> EvictResult:
        """Free at least `pages` L1 pages if the unlocked leaves allow, lowest priority first.

        A backed-up leaf is demoted to L2 only; one that is not is dropped, or under
        `write_back` backed up first (its slots then free when the backup completes)."""
        freed = pending = 0
        demoted: list[tuple[int, ...]] = []
        dropped: list[tuple[int, ...]] = []
        # Read the heap attribute each time: a push below may rebuild it into a new list.
        by_id = self._by_id
        while freed + pending < pages and self._l1_heap:
            entry = heapq.heappop(self._l1_heap)
            node = by_id.get(entry[-1])  # type: ignore[assignment]
            if node is None or entry[-2] != node.l1_ver:
                continue
            node.l1_queued = False
            if not self._l1_evictable(node):
                continue  # pushed again when it becomes evictable
            if self._priority(node) != entry[:-2]:  # used since it was queued: back in line at its key
                self._push_l1(node)
                continue
            size = len(node.keys)
            if node.host is not None:
                self._demote(node)
                demoted.append(node.keys)
                freed += size
            elif (
                self.write_policy is WritePolicy.WRITE_BACK
                and not node.write_back_failed
                and self._backup_path(node)
            ):
                node.evict_after_backup = True
                pending += size
            else:
                dropped.append(node.keys)
                self._drop(node)
                freed += size
        return EvictResult.of_runs(freed, pending, demoted, dropped)

    def evict_host(self, pages: int) -> EvictResult:
        """Free at least `pages` L2 pages from unpinned host-only leaves, lowest priority first."""
        freed = 0
        dropped: list[tuple[int, ...]] = []
        by_id = self._by_id
        while freed < pages and self._l2_heap:
            entry = heapq.heappop(self._l2_heap)
            node = by_id.get(entry[-1])  # type: ignore[assignment]
            if node is None or entry[-2] != node.l2_ver:
                continue
            node.l2_queued = False
            if not self._l2_evictable(node):
                continue
            if self._priority(node) != entry[:-2]:
                self._push_l2(node)
                continue
            freed += len(node.keys)
            dropped.append(node.keys)
            self.host_pool.free(node.host, TREE, checked=True)  # type: ignore[arg-type]
            node.host = None
            self.stats.host_evicted += len(node.keys)
            self._remove(node)
        result = EvictResult.of_runs(freed, 0, [], dropped)
        if dropped and self.on_host_evict is not None:
            self.on_host_evict(result.dropped_keys)
        return result

    def _l1_evictable(self, node: TreeNode) -> bool:
        return (
            node.device is not None
            and node.lock_ref == 0
            and node.dev_children == 0
            and node.host_op == 0
            and node.parent is not None
            # Dropping it would take it out of the tree under an operation (a store still
            # reading its retired L2 copy): it waits for the operation to end.
            and not (node.host is None and node.ops)
        )

    def _l2_evictable(self, node: TreeNode) -> bool:
        return (
            node.device is None
            and node.host is not None
            and node.host_ref == 0
            and not node.children
            and not node.ops
            and node.parent is not None
            and not node.detached
        )

    def _demote(self, node: TreeNode) -> None:
        self.device_pool.free(node.device, TREE, checked=True)  # type: ignore[arg-type]
        node.device = None
        node.evict_after_backup = False
        self.stats.demoted += len(node.keys)
        parent = node.parent
        assert parent is not None
        parent.dev_children -= 1
        if parent is not self.root:
            self._queue_l1(parent)
        if not node.children:
            self._queue_l2(node)

    def _drop(self, node: TreeNode) -> None:
        self.device_pool.free(node.device, TREE, checked=True)  # type: ignore[arg-type]
        node.device = None
        parent = node.parent
        assert parent is not None
        parent.dev_children -= 1
        self.stats.dropped += len(node.keys)
        self._remove(node)

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.keys[0]]
        del self._by_id[node.id]
        if node.host_ref:
            # A pin on a node cut out below it (`_cut_out`) still walks up through it to the
            # root when it lets go: like that node, it keeps its parent link, detached.
            node.detached = True
        else:
            node.parent = None
        self.num_nodes -= 1
        if parent is not self.root:
            self._queue_l1(parent)
            self._queue_l2(parent)

    # ------------------------------------------------------------------ backup and store

    def _backup_hot(self, node: TreeNode) -> None:
        """Under `write_through_selective`: back up the deepest node on the path used twice."""
        threshold = self.write_policy.hit_threshold
        assert threshold is not None
        while node is not self.root and node.hit_count < threshold:
            node = node.parent  # type: ignore[assignment]
        if node is not self.root:
            self._backup_path(node)

    def _backup_path(self, node: TreeNode) -> bool:
        """Back up `node` and its ancestors lacking L2 copies, in one command, keeping the
        host-backed nodes root-connected. False when L2 cannot make room."""
        chain: list[TreeNode] = []
        while node is not self.root and node.host is None:
            chain.append(node)
            node = node.parent  # type: ignore[assignment]
        if not chain:
            return True
        chain.reverse()
        total = sum(len(n.keys) for n in chain)
        host = self.host_pool.alloc(total, TREE)
        if host is None:
            self.evict_host(total - self.host_pool.num_free)
            host = self.host_pool.alloc(total, TREE)
            if host is None:
                self.stats.backup_failed += total
                return False
        op = next(self._ops)
        device: list[int] = []
        start = 0
        host_slots = tuple(host)
        for n in chain:
            size = len(n.keys)
            n.host = host_slots[start : start + size]
            start += size
            n.host_op = op
            n.ops += (op,)
            device.extend(n.device)  # type: ignore[arg-type]  # unbacked nodes are on L1
        self._op_nodes[op] = chain
        self.outbox.append(Backup(op, tuple(device), host_slots))
        return True

    def backup_done(self, op: int, failed: object = ()) -> BackupResult:
        """A `Backup` ended: its L2 copies are valid, and write-back victims leave L1. From the
        first failed page on (`failed`: indices into the command's pages) nothing of it is kept
        on L2, nor anything below it in the tree: L2 copies must stay root-connected.

        Only the slots this backup wrote are its to validate or give up: a node whose copy was
        given up while it ran (a failure above it) and then backed up anew holds another
        backup's slots, which this end says nothing about."""
        nodes = self._op_nodes.get(op)
        if op in self._store_ops or nodes is None:
            raise CoreError(f"backup_done: no backup #{op} is in flight")
        nodes = self._path_order(nodes)
        total = sum(len(n.keys) for n in nodes)
        first_bad = first_failed(failed, total, f"backup_done #{op}")
        del self._op_nodes[op]
        keys: list[int] = []
        good: list[TreeNode] = []
        mine: list[TreeNode] = []  # the nodes whose slots this backup wrote, root side first
        start = 0
        for n in nodes:
            n.ops = _without(n.ops, op)
            if self._retired:
                self._free_retired_if_idle(n)  # an earlier L2 copy given up while this op ran
            size = len(n.keys)
            if n.host is None or n.host_op != op:  # its copy from this op was given up meanwhile
                self._queue_l1(n)  # it may have waited for this op to end
            elif start + size <= first_bad:
                n.host_op = 0
                keys.extend(n.keys)
                good.append(n)
                mine.append(n)
                self._queue_l1(n)
            elif start < first_bad:  # the failure falls inside this node: keep its upper part
                upper = self._split(n, first_bad - start)
                upper.host_op = 0
                keys.extend(upper.keys)
                good.append(upper)
                mine += (upper, n)
                self._queue_l1(upper)
            else:
                mine.append(n)
            start += size
        for n in good:
            n.write_back_failed = False
        self.stats.backed_up += len(keys)
        if first_bad < total:
            for n in mine:
                if n.host is not None and n.host_op == op:  # not dropped with a node above it
                    self.stats.backup_failed += self._drop_host_below(n)
        demoted: list[int] = []
        for n in reversed(mine):  # deepest first: a parent is a leaf once its child is demoted
            if not n.evict_after_backup:
                continue
            n.evict_after_backup = False
            if n.host is not None and self._l1_evictable(n):
                self._demote(n)
                demoted.extend(n.keys)
        if self.store_to_l3:
            self._store([n for n in good if not n.in_l3])
        return BackupResult(keys, demoted)

    def _drop_host_below(self, node: TreeNode) -> int:
        """Give up the L2 copy of `node` and of every node below it (L2 copies stay
        root-connected): nodes on L1 stay there, nodes on L2 only leave the tree. Returns pages."""
        pages = 0
        gone: list[int] = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host is None:
                continue  # nothing below it is on L2 either
            pages += len(n.keys)
            if n.device is not None:
                stack.extend(n.children.values())
                self._retire_host(n)
                if n.evict_after_backup:  # its write-back copy is gone: dropped when evicted again
                    n.evict_after_backup = False
                    n.write_back_failed = True
                self._queue_l1(n)  # no backup in flight any more: evictable again (by dropping)
            else:
                gone += self._cut_out(n)
        if gone and self.on_host_evict is not None:
            self.on_host_evict(gone)
        return pages

    def _cut_out(self, node: TreeNode) -> list[int]:
        """Remove an L2-only node and everything below it (all L2-only) from the tree at once.
        Nodes a pin or an operation still uses keep their parent link and their slots (retired)
        until it lets go; no match, insert or eviction sees them again. Returns their keys."""
        parent = node.parent
        assert parent is not None and node.device is None
        del parent.children[node.keys[0]]
        if parent is not self.root and not parent.detached:
            self._queue_l2(parent)
        keys: list[int] = []
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            x.children = {}
            x.detached = True
            del self._by_id[x.id]
            self.num_nodes -= 1
            keys.extend(x.keys)
            self._retire_host(x)
        return keys

    def _retire_host(self, node: TreeNode) -> None:
        """The node no longer holds its L2 slots; free them now, or once nothing uses them."""
        slots = node.host
        assert slots is not None
        node.host = None
        node.host_op = 0
        if node.ops or node.host_ref:  # a copy or a load may still use them
            self._retired.setdefault(node, []).append(slots)
        else:
            self.host_pool.free(slots, TREE, checked=True)

    def _free_retired_if_idle(self, node: TreeNode) -> None:
        if node in self._retired and not node.ops and node.host_ref == 0:
            self._free_retired(node)

    def _free_retired(self, node: TreeNode) -> None:
        if node.ops:
            return
        for slots in self._retired.pop(node):
            self.host_pool.free(slots, TREE, checked=True)

    def drop_host(self, node: TreeNode, page: int, slot: int = -1) -> int:
        """The L2 copy of page `page` (counted from the root) on the path to `node` is bad: the
        tree stops holding it, and every L2 copy below it, so no match reads it again. Nodes on
        L2 only leave the tree; slots that pins or operations still use are freed when they let
        go. With `slot` (the L2 slot the bad copy was read from), a page whose copy has been
        given up and made anew in another slot keeps the new one. Returns the pages whose L2
        copy was dropped (0 if it was dropped already).

        `node` may have been cut out since it was pinned (a bad page above it, reported
        earlier): its path still leads to the root through the parent links that its pin keeps,
        and the pages above the cut are still in the tree."""
        path: list[TreeNode] = []
        n = node
        while n is not self.root:
            if n.parent is None:
                return 0  # left the tree with nothing holding it: nothing of it is on L2
            path.append(n)
            n = n.parent
        start = 0
        for n in reversed(path):
            size = len(n.keys)
            if start + size > page:
                break
            start += size
        else:
            raise CoreError(f"drop_host: page {page} lies below {node!r}")
        if n.detached or n.host is None:
            return 0  # cut out, or its L2 copy given up, already
        if slot >= 0 and n.host[page - start] != slot:
            return 0  # the copy read was given up; this one was made anew since
        if page > start:
            self._split(n, page - start)  # the upper part keeps its copy; `n` is the lower one
        dropped = self._drop_host_below(n)
        self.stats.host_dropped += dropped
        return dropped

    def _store(self, nodes: list[TreeNode]) -> None:
        if not nodes:
            return
        pages = sum(len(n.keys) for n in nodes)
        cap = self.store_backlog_pages
        if cap is not None and self.store_pending + pages > cap:
            self.stats.store_skipped += pages
            return
        self.store_pending += pages
        op = next(self._ops)
        keys: list[int] = []
        host: list[int] = []
        for n in nodes:
            n.ops += (op,)
            keys.extend(n.keys)
            host.extend(n.host)  # type: ignore[arg-type]
        self._op_nodes[op] = nodes
        self._store_ops.add(op)
        self.outbox.append(Store(op, tuple(keys), tuple(host)))

    def store_done(self, op: int, failed: object = ()) -> list[int]:
        """A `Store` ended: its pages are in L3 except `failed` (indices into the command's
        pages). Returns the keys now in L3."""
        if op not in self._store_ops:
            raise CoreError(f"store_done: no store #{op} is in flight")
        nodes = self._path_order(self._op_nodes[op])
        total = sum(len(n.keys) for n in nodes)
        bad = set(failed_pages(failed, total, f"store_done #{op}"))
        self._store_ops.discard(op)
        del self._op_nodes[op]
        keys: list[int] = []
        start = 0
        for n in nodes:
            size = len(n.keys)
            n.ops = _without(n.ops, op)
            if n.detached:  # cut out meanwhile: only its retired slots wait for this op
                pass
            elif not bad:
                n.in_l3 = True
                keys.extend(n.keys)
                self._queue_l2(n)
            else:
                self._mark_stored(n, start, bad, keys)
            if n.device is not None:
                self._queue_l1(n)  # may have waited for this op to end
            if self._retired:
                self._free_retired_if_idle(n)
            start += size
        self.stats.stored += len(keys)
        self.stats.store_failed += total - len(keys)
        self.store_pending -= total
        return keys

    def _mark_stored(self, node: TreeNode, start: int, bad: set[int], keys: list[int]) -> None:
        """Mark the pages of `node` (the store's pages from `start`) that are not `bad` as in
        L3, splitting it where success changes so `in_l3` is exact for every node."""
        offset = start
        while True:
            ok = offset not in bad
            cut = next((j for j in range(1, len(node.keys)) if (offset + j not in bad) != ok), 0)
            part = self._split(node, cut) if cut else node
            if ok:
                part.in_l3 = True
                keys.extend(part.keys)
            self._queue_l2(part)
            if not cut:
                return
            offset += cut

    def _path_order(self, nodes: list[TreeNode]) -> list[TreeNode]:
        """`nodes` of one operation in the order of its command's pages (root side first), also
        after a split added the upper half of a node to the end of the list."""
        for i in range(1, len(nodes)):
            if nodes[i].parent is not nodes[i - 1]:
                break
        else:
            return nodes  # already a path, root side first (no split since the command)

        def depth(n: TreeNode) -> int:
            d = 0
            while n.parent is not None:
                d += 1
                n = n.parent
            return d

        return sorted(nodes, key=depth)

    @property
    def ops_in_flight(self) -> list[int]:
        return sorted(self._op_nodes)

    # ------------------------------------------------------------------ structure

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node` after its first `k` pages; return the new node holding them (the parent
        of the rest). The original object stays as the deeper half, so receipts stay valid."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.keys)
        new = TreeNode(next(self._node_ids), node.keys[:k], parent, node.created)
        self._by_id[new.id] = new
        node.keys = node.keys[k:]
        if node.device is not None:
            new.device = node.device[:k]
            node.device = node.device[k:]
            new.dev_children = 1
        if node.host is not None:
            new.host = node.host[:k]
            node.host = node.host[k:]
        new.host_op = node.host_op
        new.in_l3 = node.in_l3
        new.lock_ref = node.lock_ref
        new.host_ref = node.host_ref
        new.hit_count = node.hit_count
        new.last_access = node.last_access
        new.priority = node.priority
        new.evict_after_backup = node.evict_after_backup
        new.write_back_failed = node.write_back_failed
        new.ops = node.ops
        for op in node.ops:
            self._op_nodes[op].append(new)
        parent.children[new.keys[0]] = new
        new.children[node.keys[0]] = node
        node.parent = new
        self.num_nodes += 1
        self.stats.splits += 1
        return new

    def _touch(self, node: TreeNode, now: float) -> None:
        """A use of `node` at `now`. Its eviction entry is pushed again only when its key may
        have fallen (`mru`, or a clock that went back) or it has none queued; otherwise the
        entry keeps a lower bound of the key and is re-keyed when it surfaces in an eviction."""
        lower_bound = self._lazy and now >= node.last_access
        node.last_access = now
        if node.device is not None:
            if not (lower_bound and node.l1_queued):
                self._push_l1(node)
        elif not node.children and not (lower_bound and node.l2_queued):
            self._push_l2(node)
            return
        if not lower_bound:
            # Not evictable from L2 now (still on L1, or not a leaf), and its key may have
            # fallen below its queued L2 entry's: that entry is no lower bound any more, so the
            # node is queued afresh when it becomes evictable there (`_queue_l2`).
            node.l2_queued = False

    def _queue_l1(self, node: TreeNode) -> None:
        """`node` may have become evictable from L1: make sure an entry for it is queued (one
        still queued holds a lower bound of its key, so it is left as it is)."""
        if not node.l1_queued:
            self._push_l1(node)

    def _queue_l2(self, node: TreeNode) -> None:
        if not node.l2_queued:
            self._push_l2(node)

    def _push_l1(self, node: TreeNode) -> None:
        node.l1_ver += 1
        node.l1_queued = True
        heapq.heappush(self._l1_heap, self._priority(node) + (node.l1_ver, node.id))
        if len(self._l1_heap) > 4 * self.num_nodes + 1024:
            self._l1_heap = self._rebuild(self._l1_heap, "l1_ver")

    def _push_l2(self, node: TreeNode) -> None:
        node.l2_ver += 1
        node.l2_queued = True
        heapq.heappush(self._l2_heap, self._priority(node) + (node.l2_ver, node.id))
        if len(self._l2_heap) > 4 * self.num_nodes + 1024:
            self._l2_heap = self._rebuild(self._l2_heap, "l2_ver")

    def _rebuild(self, heap: list, ver: str) -> list:
        """Drop superseded entries so the lazy heap stays proportional to the tree."""
        by_id = self._by_id
        live = [e for e in heap if (n := by_id.get(e[-1])) is not None and e[-2] == getattr(n, ver)]
        heapq.heapify(live)
        return live

    def nodes(self) -> list[TreeNode]:
        """All nodes but the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    @property
    def device_pages(self) -> int:
        return sum(len(n.keys) for n in self.nodes() if n.device is not None)

    @property
    def host_pages(self) -> int:
        return sum(len(n.keys) for n in self.nodes() if n.host is not None)

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


def failed_pages(failed: object, total: int, what: str) -> list[int]:
    """The failed pages of an operation over `total` pages, checked: `CoreError` naming `what`
    unless `failed` is a tuple or list of page indices in [0, total). Typed `object`: a
    completion comes from a driver, and the compiled build must refuse a string, a float or a
    bool exactly as plain Python does, before anything changes."""
    if not isinstance(failed, tuple | list):
        raise CoreError(f"{what}: failed pages must be a tuple of page indices, got {failed!r}")
    pages: list[int] = []
    for x in failed:
        page: object = x
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < total:
            raise CoreError(f"{what}: failed pages {list(failed)!r} outside [0, {total}) or not integers")
        pages.append(page)
    return pages


def first_failed(failed: object, total: int, what: str) -> int:
    """The first failed page (checked as `failed_pages` does), or `total` when none failed."""
    pages = failed_pages(failed, total, what)
    return min(pages) if pages else total


def _without(ops: tuple[int, ...], op: int) -> tuple[int, ...]:
    """`ops` less `op` (a node is covered by a few operations at most)."""
    return tuple(o for o in ops if o != op) if op in ops else ops


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
