"""Commands the core hands to a driver: I/O to perform, described as data.

The core never copies a byte itself; a driver executes each command and reports its
completion back as an event carrying the command's `op` id.
"""

from __future__ import annotations

import attrs


@attrs.frozen(slots=True)
class Backup:
    """Copy device (L1) pages to host (L2) pages: `device_slots[i]` -> `host_slots[i]`."""

    op: int
    device_slots: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class Store:
    """Write host (L2) pages to shared storage (L3) under their page keys."""

    op: int
    keys: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class QueryStorage:
    """Ask L3, for each request, how many of its candidate pages it holds, counting
    consecutive pages from the first. One command per tick for all newly admitted requests."""

    op: int
    queries: tuple[tuple[str, tuple[int, ...]], ...]


@attrs.frozen(slots=True)
class Prefetch:
    """Read pages from L3 into host slots: `keys[i]` -> `host_slots[i]`, in order."""

    op: int
    req: str
    keys: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class CancelPrefetch:
    """Stop a prefetch early; the driver still answers with `PrefetchDone` (and ignores a
    cancel that reaches a prefetch which has already ended)."""

    op: int


@attrs.frozen(slots=True)
class LoadBack:
    """Copy host pages to device pages (`host_slots[i]` -> `device_slots[i]`) for every request
    whose restore became ready in one tick: one merged batch."""

    op: int
    host_slots: tuple[int, ...]
    device_slots: tuple[int, ...]
    reqs: tuple[str, ...]


@attrs.frozen(slots=True)
class RequestKV:
    """Ask prefill for the KV of tokens [start, end) of a request, written to `dst_slots`
    (one per page, starting at page start // page_size). `start` is page-aligned. A request
    whose whole prompt was restored still gets one with `start == end`: prefill computes the
    first output token either way."""

    transfer: int
    req: str
    start: int
    end: int
    dst_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class SetTimer:
    timer: int
    at: float


@attrs.frozen(slots=True)
class Agree:
    """Collective across TP ranks: answer with `Agreed` holding the minimum of each value."""

    agreement: int
    kind: str
    values: tuple[tuple[object, int], ...]


@attrs.frozen(slots=True)
class StartDecode:
    """The request's KV is complete in `device_slots` (one per page): add it to the batch."""

    req: str
    device_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class Retract:
    """Take the request out of the decode batch; it will be resumed later."""

    req: str


@attrs.frozen(slots=True)
class Respond:
    """The request ended: `outcome` is finished, aborted or failed; `reason` says why."""

    req: str
    outcome: str
    reason: str = ""


Command = (
    Backup
    | Store
    | QueryStorage
    | Prefetch
    | CancelPrefetch
    | LoadBack
    | RequestKV
    | SetTimer
    | Agree
    | StartDecode
    | Retract
    | Respond
)
