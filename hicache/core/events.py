"""Events a driver feeds the decode-node core: something happened, at time `at` (seconds).

Events about a request name it by `req`; completions of I/O name the command's id. An event the
core refuses raises a `CoreError` (a `TransitionError` when the state does not take it) and
leaves the core exactly as it was, so a driver may log it and go on.

With several TP ranks, each rank runs its own core. Every rank must be fed the same *shared*
events in the same order: `RequestArrived`, `Tick`, `KVArrived`, `KVFailed`, `KVAbandoned`,
`BackupDone`, `StoreDone`, `TimerFired`, `Decoded`, `Finished`, `AbortRequested`, `Agreed`,
`EvictRequested` and `ForgetRequested`. The *rank-local* events `StorageQueried`,
`PrefetchProgress`, `PrefetchDone` and `LoadDone` may differ between ranks: the core acts on them
only through agreements (`Agree` / `Agreed`), so the ranks keep deciding alike. `SHARED` and
`RANK_LOCAL` at the end of this module list them.
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
    """One scheduler iteration: the core does all its batched work here (admission, one L3
    query, agreements, merged load-backs). Drivers coalesce: one `Tick` some interval after
    any other event (see `hicache.core.dispatch.Dispatcher`)."""

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
    """A `LoadBack` ended: no byte of it can still land. `failed` are the pages (indices into
    the batch's pages in order) that did not arrive intact; an L2 page found bad is dropped
    from the tree (agreed across ranks first)."""

    at: float
    op: int
    failed: tuple[int, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(slots=True)
class BackupDone:
    """A `Backup` ended. `failed` are the pages (indices into the command's slots) whose L2
    copy did not complete: they, and the pages below them in the tree, are not kept on L2."""

    at: float
    op: int
    failed: tuple[int, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(slots=True)
class StoreDone:
    """A `Store` ended. `failed` are the pages (indices into the command's keys) that L3 does
    not hold: the tree does not count them as stored."""

    at: float
    op: int
    failed: tuple[int, ...] = attrs.field(default=(), converter=_tuple)


@attrs.frozen(slots=True)
class KVArrived:
    """The KV of a `RequestKV` transfer is in its destination slots."""

    at: float
    req: str
    transfer: int


@attrs.frozen(slots=True)
class KVFailed:
    """A `RequestKV` transfer failed; nothing more will be written to its slots. `retry` False:
    the failure is deterministic (prefill refused the request as it is, e.g. a prompt larger
    than it can stage), so asking again would fail again: the request ends with `reason`."""

    at: float
    req: str
    transfer: int
    reason: str = "transfer failed"
    retry: bool = True


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
    """A `SetTimer` fired (once per timer)."""

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
    """A running request generated its last token; the KV of all tokens reported with
    `Decoded` is in its pages. Late after an abort: absorbed."""

    at: float
    req: str


@attrs.frozen(slots=True)
class AbortRequested:
    """The client went away (or an operator ends the request): release it wherever it is.
    Absorbed after the request ended."""

    at: float
    req: str
    reason: str = "aborted"


@attrs.frozen(slots=True)
class EvictRequested:
    """An operator frees cache memory: up to `l1_pages` from L1 (demoted to L2 where the write
    policy backs them up) and `l2_pages` from L2, by the eviction policy; locked and pinned
    pages stay."""

    at: float
    l1_pages: int
    l2_pages: int = 0


@attrs.frozen(slots=True)
class ForgetRequested:
    """The driver has read a request's answer: drop it now, or as soon as no I/O refers to it
    any more (a driver that replays a long trace keeps the core's memory flat this way)."""

    at: float
    req: str


@attrs.frozen(slots=True)
class Agreed:
    """The answer to an `Agree`: for every key of the agreement, the minimum over ranks."""

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
    | EvictRequested
    | ForgetRequested
)

SHARED: tuple[type, ...] = (
    RequestArrived,
    Tick,
    KVArrived,
    KVFailed,
    KVAbandoned,
    BackupDone,
    StoreDone,
    TimerFired,
    Decoded,
    Finished,
    AbortRequested,
    Agreed,
    EvictRequested,
    ForgetRequested,
)
"""Events every TP rank must be fed alike and in the same order."""

RANK_LOCAL: tuple[type, ...] = (StorageQueried, PrefetchProgress, PrefetchDone, LoadDone)
"""Events that may differ between ranks: the core acts on them only through agreements."""

# The fields the core finds things by or counts with, per event: "int" for an id or a count
# (never a bool: True == 1 would name command #1), "str" for a request or a reason. The core
# checks them before any handler runs (`DecodeNodeCore.handle`), so a value of another type is
# refused by name, the same way by the compiled build and by plain Python, before anything
# changes; the handlers check the values (ranges, which ids are in flight).
INT, STR = "int", "str"
FIELD_TYPES: dict[type, tuple[tuple[str, str], ...]] = {
    RequestArrived: (("req", STR), ("prompt_len", INT), ("priority", INT)),
    Tick: (),
    StorageQueried: (("op", INT),),
    PrefetchProgress: (("op", INT), ("pages", INT)),
    PrefetchDone: (("op", INT), ("pages", INT)),
    LoadDone: (("op", INT),),
    BackupDone: (("op", INT),),
    StoreDone: (("op", INT),),
    KVArrived: (("req", STR), ("transfer", INT)),
    KVFailed: (("req", STR), ("transfer", INT), ("reason", STR)),
    KVAbandoned: (("req", STR), ("transfer", INT), ("reason", STR)),
    TimerFired: (("timer", INT),),
    Decoded: (("req", STR), ("tokens", INT)),
    Finished: (("req", STR),),
    AbortRequested: (("req", STR), ("reason", STR)),
    Agreed: (("agreement", INT),),
    EvictRequested: (("l1_pages", INT), ("l2_pages", INT)),
    ForgetRequested: (("req", STR),),
}
