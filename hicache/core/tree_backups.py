"""Backups in the tiered radix tree: L1 pages copied to L2, what their ends validate, and the
L2 copies found bad. L2 copies stay root-connected: from a failed or bad page on, nothing below
it is kept on L2 (nodes on L1 stay there, nodes on L2 only leave the tree), and slots that a pin
or an operation still uses are retired until it lets go."""

from __future__ import annotations

from hicache.core.commands import Backup
from hicache.core.errors import CoreError
from hicache.core.failed_pages import first_failed
from hicache.core.node import TreeNode
from hicache.core.tree_results import BackupResult
from hicache.core.tree_stores import TreeStores
from hicache.core.tree_structure import TREE, ops_without


class TreeBackups(TreeStores):
    """L1 -> L2 copies (`Backup`) by the write policy, their ends, and bad L2 copies dropped."""

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
            n.ops = ops_without(n.ops, op)
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
