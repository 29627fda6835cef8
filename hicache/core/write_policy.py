"""When the tree backs device pages up to host memory (L1 -> L2)."""

from __future__ import annotations

import enum

from hicache.core.policy_enum import parse_policy


class WritePolicy(enum.StrEnum):
    """`write_through` backs up on first insert, `write_through_selective` once a node has been
    used by a second request, `write_back` only when the node is evicted from L1."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @property
    def hit_threshold(self) -> int | None:
        """Uses after which a node is backed up eagerly; None when only eviction backs up."""
        return {"write_through": 1, "write_through_selective": 2, "write_back": None}[self.value]

    @classmethod
    def parse(cls, name: str | WritePolicy) -> WritePolicy:
        return parse_policy(cls, name, "unknown write policy")
