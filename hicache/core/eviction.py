"""Eviction priorities, chosen by name.

A policy maps a tree node to a sort key; the node with the smallest key is evicted first.
Keys end with the node's creation sequence number so that ties break deterministically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.core.errors import PolicyError

if TYPE_CHECKING:
    from hicache.core.node import TreeNode

EvictionKey = tuple[float, ...]
EvictionPolicy = Callable[["TreeNode"], EvictionKey]


def lru(node: TreeNode) -> EvictionKey:
    """Least recently used first."""
    return (node.last_access, node.created)


def mru(node: TreeNode) -> EvictionKey:
    """Most recently used first (scan-resistant for one-shot long prompts)."""
    return (-node.last_access, node.created)


def lfu(node: TreeNode) -> EvictionKey:
    """Least frequently used first, least recently used among equals."""
    return (node.hit_count, node.last_access, node.created)


def fifo(node: TreeNode) -> EvictionKey:
    """Oldest first, whatever its use."""
    return (node.created,)


def priority(node: TreeNode) -> EvictionKey:
    """Lowest request priority first, then least recently used."""
    return (node.priority, node.last_access, node.created)


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": lru,
    "mru": mru,
    "lfu": lfu,
    "fifo": fifo,
    "priority": priority,
}

RISE_ON_USE: frozenset[str] = frozenset({"lru", "lfu", "fifo", "priority"})
"""Policies whose key never falls when a node is used again later (a use raises `last_access`,
`hit_count` or `priority`, or leaves the key as it is). Under them a heap entry keeps a lower
bound of its node's key, so the tree need not push a node on every use: it re-keys the entry
when it surfaces. `mru`'s key falls on every use, so it is pushed each time."""


def eviction_policy(name: str) -> EvictionPolicy:
    """The policy called `name`, or a PolicyError listing the known names."""
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise PolicyError(f"unknown eviction policy {name!r}; expected one of: {known}") from None
