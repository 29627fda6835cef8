"""Receipts for locks and pins: ownership made explicit.

`lock` and `pin_host` return a receipt; only that receipt can undo them, exactly once. A
receipt names the node it protects, so unlocking "the wrong node" cannot be expressed.

Receipts are plain classes, not attrs, and never change once made: a replay makes one per
lock, and the compiled build constructs a plain class natively.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.core.node import TreeNode


class _Receipt:
    """A receipt: which tree, its serial there, and the node whose path it protects."""

    __slots__ = ("tree_id", "serial", "node")

    def __init__(self, tree_id: int, serial: int, node: TreeNode) -> None:
        self.tree_id = tree_id
        self.serial = serial
        self.node = node

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tree_id={self.tree_id}, serial={self.serial}, node={self.node!r})"


class LockReceipt(_Receipt):
    """Proof that the L1 path from `node` to the root is locked against eviction."""

    __slots__ = ()


class HostPin(_Receipt):
    """Proof that the L2 path from `node` to the root is pinned against host eviction."""

    __slots__ = ()
