"""Events a driver feeds the decode-node core: something happened, at time `at` (seconds).

Events about a request name it by `req`; completions of I/O name the command's `op`.
"""

from __future__ import annotations

import attrs


def _tuple(x: object) -> tuple:
    return tuple(x)  # type: ignore[arg-type]


@attrs.frozen(slots=True)
class RequestArrived:
    """A request whose prefill is to run elsewhere; `keys` are the chained page keys of its
    prompt's full pages (`prompt_len // page_size` of them)."""

    at: float
    req: str
    prompt_len: int
    keys: tuple[int, ...] = attrs.field(converter=_tuple)
    priority: int = 0


@attrs.frozen(slots=True)
class Tick:
    """One scheduler iteration: the core does all its batched work here."""

    at: float


@attrs.frozen(slots=True)
class StorageQueried:
    """Answer to `QueryStorage`: per request, consecutive L3 hits from the first candidate."""

    at: float
    op: int
    hits: tuple[tuple[str, int], ...] = attrs.field(converter=_tuple)


@attrs.frozen(slots=True)
class PrefetchProgress:
    """Pages [0, pages) of a `Prefetch` are complete in L2 and will not be written again."""

    at: float
    op: int
    pages: int


@attrs.frozen(slots=True)
class PrefetchDone:
    """A `Prefetch` ended (completed, cancelled or failed): pages [0, pages) arrived intact; the
    op no longer writes to any of its host slots."""

    at: float
    op: int
    pages: int


@attrs.frozen(slots=True)
class LoadDone:
    """A `LoadBack` ended; `failed` names requests whose pages did not arrive."""

    at: float
    op: int
    failed: tuple[str, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(slots=True)
class BackupDone:
    at: float
    op: int


@attrs.frozen(slots=True)
class StoreDone:
    at: float
    op: int


@attrs.frozen(slots=True)
class KVArrived:
    """The KV of a `RequestKV` transfer is in its destination slots."""

    at: float
    req: str
    transfer: int


@attrs.frozen(slots=True)
class KVFailed:
    """A `RequestKV` transfer failed; nothing more will be written to its slots."""

    at: float
    req: str
    transfer: int
    reason: str = "transfer failed"


@attrs.frozen(slots=True)
class KVAbandoned:
    """The driver gave up on a `RequestKV` transfer that it could not stop: its bytes may still
    land. The request fails; the transfer's slots stay claimed until its `KVArrived` or
    `KVFailed` says nothing more will be written, so no other request can be handed them."""

    at: float
    req: str
    transfer: int
    reason: str = "transfer abandoned"


@attrs.frozen(slots=True)
class TimerFired:
    at: float
    timer: int


@attrs.frozen(slots=True)
class Decoded:
    """A running request generated `tokens` more tokens; `new_keys` are the keys of the full
    pages those tokens completed (chained from the sequence so far)."""

    at: float
    req: str
    tokens: int
    new_keys: tuple[int, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(slots=True)
class Finished:
    at: float
    req: str


@attrs.frozen(slots=True)
class AbortRequested:
    at: float
    req: str
    reason: str = "aborted"


@attrs.frozen(slots=True)
class Agreed:
    """The answer to an `Agree`: the minimum over ranks of each value."""

    at: float
    agreement: int
    values: tuple[tuple[object, int], ...] = attrs.field(converter=_tuple)


Event = (
    RequestArrived
    | Tick
    | StorageQueried
    | PrefetchProgress
    | PrefetchDone
    | LoadDone
    | BackupDone
    | StoreDone
    | KVArrived
    | KVFailed
    | KVAbandoned
    | TimerFired
    | Decoded
    | Finished
    | AbortRequested
    | Agreed
)
