"""The tiered radix tree's data, and the bookkeeping every part of it shares: nodes, splits,
eviction queues, the operations in flight over nodes, retired L2 slots.

The parts of `TieredRadixTree` stack on this class in the order they call one another (`tree`
lists them)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from hicache.core.commands import Command
from hicache.core.eviction import RISE_ON_USE, EvictionPolicy, eviction_policy
from hicache.core.node import TreeNode
from hicache.core.pool import Owner, SlotPool
from hicache.core.receipts import HostPin, LockReceipt
from hicache.core.tree_results import TreeStats
from hicache.core.write_policy import WritePolicy

TREE: Owner = "tree"
"""The pool owner of every slot held by a tree node."""

_tree_ids = itertools.count(1)


class TreeStructure:
    """The nodes of a tree over an L1 (device) pool and an L2 (host) pool, and what keeps them
    in order: splits, eviction queues, the operations in flight over them."""

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

    # ------------------------------------------------- operations in flight, retired L2 slots

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


def ops_without(ops: tuple[int, ...], op: int) -> tuple[int, ...]:
    """`ops` less `op` (a node is covered by a few operations at most)."""
    return tuple(o for o in ops if o != op) if op in ops else ops
