"""Receipts for locks and pins: ownership made explicit.

`lock` and `pin_host` return a receipt; only that receipt can undo them, exactly once. A
receipt names the node it protects, so unlocking "the wrong node" cannot be expressed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from hicache.core.node import TreeNode


@attrs.frozen(slots=True, eq=False)
class LockReceipt:
    """Proof that the L1 path from `node` to the root is locked against eviction."""

    tree_id: int
    serial: int
    node: TreeNode


@attrs.frozen(slots=True, eq=False)
class HostPin:
    """Proof that the L2 path from `node` to the root is pinned against host eviction."""

    tree_id: int
    serial: int
    node: TreeNode
