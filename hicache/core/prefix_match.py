"""The result of matching a prompt's pages against the tiers of one decode node."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.core.node import TreeNode


class DecodePrefixMatch:
    """How much of a prompt each tier holds, in pages, with the anchors to act on it.

    The device (L1) hit is a prefix of the prompt; the host (L2) hit follows it; the pages
    from `l3_start` on are candidates for a storage (L3) query. `device_node` is the deepest
    matched node on L1 (lock it to keep the L1 hit); `host_node` is the deepest matched node
    (pin it to keep the L2 hit until it is loaded back).

    A value, never changed once made; a plain class rather than attrs, so that the compiled
    build constructs it natively (one per match).
    """

    __slots__ = (
        "query_pages",
        "device_pages",
        "host_pages",
        "device_slots",
        "host_slots",
        "device_node",
        "host_node",
    )

    def __init__(
        self,
        query_pages: int,
        device_pages: int,
        host_pages: int,
        device_slots: list[int],
        host_slots: list[int],
        device_node: TreeNode,
        host_node: TreeNode,
    ) -> None:
        self.query_pages = query_pages
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.device_slots = device_slots
        self.host_slots = host_slots
        self.device_node = device_node
        self.host_node = host_node

    def __repr__(self) -> str:
        return (
            f"DecodePrefixMatch(query_pages={self.query_pages}, device_pages={self.device_pages},"
            f" host_pages={self.host_pages}, device_node={self.device_node!r}, host_node={self.host_node!r})"
        )

    @property
    def l3_start(self) -> int:
        """Index of the first page that neither L1 nor L2 holds."""
        return self.device_pages + self.host_pages

    @property
    def l3_candidate_pages(self) -> int:
        return self.query_pages - self.l3_start
