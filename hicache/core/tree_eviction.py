"""Eviction from the tiered radix tree: free L1 or L2 pages, lowest priority first.

A backed-up L1 leaf is demoted to L2 only; one that is not is dropped, or under `write_back`
backed up first. The eviction queues are lazy heaps (`TreeStructure`): an entry keeps a lower
bound of its node's key and is re-keyed when it surfaces."""

from __future__ import annotations

import heapq

from hicache.core.node import TreeNode
from hicache.core.tree_results import EvictResult
from hicache.core.tree_structure import TREE, TreeStructure
from hicache.core.write_policy import WritePolicy


class TreeEviction(TreeStructure):
    """Freeing L1 and L2 pages, and the node moves it makes (demote, drop, remove)."""

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

    def _backup_path(self, node: TreeNode) -> bool:
        """Back up `node` and its ancestors lacking L2 copies (a write-back victim, before it
        leaves L1); defined by `TreeBackups`. False when L2 cannot make room."""
        raise NotImplementedError
