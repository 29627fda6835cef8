"""The decode node's operations in flight, as the core records them: an L3 query, a prefetch,
a load-back batch and its entries, a transfer from prefill.

An operation may outlive its request: its phase (`lifecycles`) says where it is, and `claims`
hold the slots it may still write or read after the request gave everything else back."""

from __future__ import annotations

import attrs

from hicache.core.lifecycles import (
    LOAD,
    PREFETCH,
    TRANSFER,
    LoadPhase,
    PrefetchPhase,
    Step,
    TransferPhase,
    advance,
)
from hicache.core.node import TreeNode
from hicache.core.receipts import HostPin


@attrs.define(slots=True, eq=False)
class QueryOp:
    """One `QueryStorage` over the requests admitted in a tick."""

    op: int
    reqs: list[str]
    local: dict[str, int] | None = None  # this rank's answer, once it came


@attrs.define(slots=True, eq=False)
class PrefetchOp:
    """One `Prefetch` L3 -> L2 into request-owned host slots."""

    op: int
    req: str  # "" once the request ended (the op still owns its claims)
    planned: int
    slots: list[int]
    phase: PrefetchPhase = PrefetchPhase.OPEN
    progress: int = 0  # rank-local
    timed_out: bool = False  # its timer fired: an input of the stop rule
    claims: list[int] = attrs.Factory(list)  # host slots the op owns until it ends

    def move(self, trigger: type | Step) -> None:
        self.phase = advance(PREFETCH, self.phase, trigger, self.req, f"prefetch #{self.op}")


@attrs.define(slots=True, eq=False)
class LoadOpEntry:
    """One request's part of a merged load-back: an L2 span or prefetched L3 pages."""

    req: str
    from_l2: bool  # the L2 span (tree pages, pinned) or prefetched L3 pages (request-owned)
    first_page: int
    host_slots: list[int]
    device_slots: list[int]
    anchor: TreeNode | None = None  # L2 entries: the deepest node of the pinned span
    orphaned: bool = False  # the request ended; the batch claims what it still copies


@attrs.define(slots=True, eq=False)
class LoadOp:
    """One merged `LoadBack` L2 -> L1, its outcome per entry (rank-local until agreed)."""

    op: int
    entries: list[LoadOpEntry]
    phase: LoadPhase = LoadPhase.IN_FLIGHT
    first_bad: dict[int, int] = attrs.Factory(dict)  # rank-local: entry -> its first bad page
    claims_device: list[int] = attrs.Factory(list)
    claims_host: list[int] = attrs.Factory(list)
    pins: list[HostPin] = attrs.Factory(list)

    def move(self, trigger: type | Step) -> None:
        self.phase = advance(LOAD, self.phase, trigger, "", f"load-back #{self.op}")


@attrs.define(slots=True, eq=False)
class TransferOp:
    """One `RequestKV` from prefill into the request's own slots (or a retry backing off)."""

    tid: int
    req: str
    start: int
    end: int
    dst: list[int]
    attempt: int
    fallback: bool
    phase: TransferPhase = TransferPhase.ACTIVE
    claims: list[int] = attrs.Factory(list)  # orphaned or abandoned: slots it may still write

    def next_phase(self, trigger: type | Step) -> TransferPhase:
        return advance(TRANSFER, self.phase, trigger, self.req, f"transfer #{self.tid}")
