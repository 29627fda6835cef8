"""Stores from the tiered radix tree to L3: L2 pages copied to storage, and what their ends
mark. A node's `in_l3` is exact: a store that fails for some pages splits the nodes where
success changes."""

from __future__ import annotations

from hicache.core.commands import Store
from hicache.core.errors import CoreError
from hicache.core.failed_pages import failed_pages
from hicache.core.node import TreeNode
from hicache.core.tree_eviction import TreeEviction
from hicache.core.tree_structure import ops_without


class TreeStores(TreeEviction):
    """L2 -> L3 copies (`Store`), capped by the store backlog, and their ends."""

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
            n.ops = ops_without(n.ops, op)
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
