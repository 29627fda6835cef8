"""Commands the core hands to a driver: I/O to perform, described as data.

The core never copies a byte itself. A driver executes each command and reports its completion
back as an event naming the command's id (`op`, `transfer`, `timer` or `agreement`; all drawn
from one counter, so no two commands in flight share an id). Every fact a driver needs to
execute a command travels on it: a driver never reads the core's requests.

Each docstring states the command's contract: what the driver must do, and which event must
answer it.
"""

from __future__ import annotations

import enum

import attrs

from hicache.core.account import Account


class Outcome(enum.StrEnum):
    """How a request ended."""

    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class TimerKind(enum.StrEnum):
    """What a timer times."""

    PREFETCH_TIMEOUT = "prefetch_timeout"  # the `timeout` prefetch policy's deadline for one prefetch
    TRANSFER_RETRY = "transfer_retry"  # the end of a failed transfer's backoff; `op`: its retry's id


class AgreeKind(enum.StrEnum):
    """The values TP ranks agree on; one collective per kind at a time."""

    L3_HITS = "l3_hits"  # per query and request: consecutive L3 hits (-1: this rank has no answer yet)
    PREFETCH = "prefetch"  # per prefetch: pages complete, and whether it ended (1) or not (0)
    LOAD = "load"  # per load-back: whether it ended, and per entry its first failed page


@attrs.frozen(slots=True)
class Backup:
    """Copy device (L1) pages to host (L2) pages: `device_slots[i]` -> `host_slots[i]`.

    Answer with `BackupDone(op, failed)`, `failed` naming the pages (indices into these
    tuples) whose copy did not complete. The device slots stay readable until then."""

    op: int
    device_slots: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class Store:
    """Write host (L2) pages to shared storage (L3) under their page keys.

    Answer with `StoreDone(op, failed)`, `failed` naming the pages (indices) that L3 does not
    hold afterwards. The host slots stay readable until then."""

    op: int
    keys: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class QueryStorage:
    """Ask L3, for each request, how many of its candidate pages it holds, counting
    consecutive pages from the first. One command per tick for all newly admitted requests.

    Answer once with `StorageQueried(op, hits)`, one entry per request asked about."""

    op: int
    queries: tuple[tuple[str, tuple[int, ...]], ...]


@attrs.frozen(slots=True)
class Prefetch:
    """Read pages from L3 into host slots: `keys[i]` -> `host_slots[i]`, in order.

    Report progress with `PrefetchProgress(op, pages)` (optional) and the end, once no byte can
    still land in `host_slots`, with `PrefetchDone(op, pages)`: pages [0, pages) arrived intact,
    the rest failed or were not read."""

    op: int
    req: str
    keys: tuple[int, ...]
    host_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class CancelPrefetch:
    """Stop a prefetch early. The driver still answers with `PrefetchDone`, once no byte can
    still land, and ignores a cancel that reaches a prefetch which has already ended."""

    op: int


@attrs.frozen(slots=True)
class LoadEntry:
    """One request's part of a merged load-back: host pages to device pages, in order."""

    req: str
    host_slots: tuple[int, ...]
    device_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class LoadBack:
    """Copy host pages to device pages for every request whose restore became ready in one
    tick: one merged batch of `entries`.

    Answer with `LoadDone(op, failed)`, `failed` naming the pages that did not arrive intact,
    as indices into the batch's pages in order (`host_slots` / `device_slots`)."""

    op: int
    entries: tuple[LoadEntry, ...]

    @property
    def host_slots(self) -> tuple[int, ...]:
        return tuple(s for e in self.entries for s in e.host_slots)

    @property
    def device_slots(self) -> tuple[int, ...]:
        return tuple(s for e in self.entries for s in e.device_slots)

    @property
    def reqs(self) -> tuple[str, ...]:
        return tuple(e.req for e in self.entries)


@attrs.frozen(slots=True)
class RequestKV:
    """Ask prefill for the KV of tokens [start, end) of a request, written to `dst_slots`
    (one per page, starting at page start // page_size). `start` is page-aligned. The prompt
    prefill computes is the request's first `prompt_len` tokens (after a retraction that
    includes output generated so far). A request whose whole prompt was restored still gets one
    with `start == end`: prefill computes the first output token either way. `fallback` marks a
    range first promised for local restore; `attempt` counts retries from 0.

    Answer with `KVArrived` once every byte is in place, `KVFailed` once it failed and no byte
    can still land, or `KVAbandoned` when the driver gives up without being able to stop it
    (followed later by `KVArrived` or `KVFailed` when it does end)."""

    transfer: int
    req: str
    start: int
    end: int
    dst_slots: tuple[int, ...]
    prompt_len: int
    fallback: bool = False
    attempt: int = 0


@attrs.frozen(slots=True)
class SetTimer:
    """Fire `TimerFired(timer)` at time `at` (or as soon after as the driver can). `kind` says
    what it times and `op` the operation it concerns (for `TRANSFER_RETRY`, the id the retry's
    `RequestKV` will carry). Never cancelled: a timer that fires late or after its
    operation ended is absorbed by the core."""

    timer: int
    at: float
    kind: TimerKind
    op: int


@attrs.frozen(slots=True)
class Agree:
    """Collective across TP ranks: every rank enters the same agreements in the same order.

    Answer with `Agreed(agreement, values)` holding, for each key, the minimum over ranks of
    its value. With one rank the core never emits this."""

    agreement: int
    kind: AgreeKind
    values: tuple[tuple[object, int], ...]


@attrs.frozen(slots=True)
class StartDecode:
    """The request's KV is complete in `device_slots` (one per page of its first `prompt_len`
    tokens): add it to the decode batch. `ready_at` is when its KV became complete (its first
    token is out then, even if the batch had no room until now); `promised` is the prefix, in
    tokens, this admission restored locally; `account` says where the prompt's KV came from.

    The driver then reports generated tokens with `Decoded` and the end with `Finished`."""

    req: str
    device_slots: tuple[int, ...]
    prompt_len: int
    ready_at: float
    promised: int
    account: Account


@attrs.frozen(slots=True)
class ExtendKV:
    """A running request's KV continues in `device_slots`, its pages from `first_page` on: the
    driver writes new tokens' KV there. Emitted while handling the `Decoded` that needed them."""

    req: str
    first_page: int
    device_slots: tuple[int, ...]


@attrs.frozen(slots=True)
class Retract:
    """Take the request out of the decode batch; it will be resumed later (a new
    `StartDecode`). KV of tokens not yet reported with `Decoded` is lost."""

    req: str


@attrs.frozen(slots=True)
class Respond:
    """The request ended: `outcome` says how, `reason` why, `account` where its prompt's KV
    came from (for the last admission). The core takes no event about it after this except
    `ForgetRequested` (late completions of its I/O are absorbed)."""

    req: str
    outcome: Outcome
    reason: str = ""
    account: Account = attrs.Factory(Account)


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
    | ExtendKV
    | Retract
    | Respond
)
