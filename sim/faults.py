"""Faults in the simulator: a `FaultSpec` applied to the commands of one decode node.

The decode driver asks this object, command by command, how the operation goes; what a fault
does is modelled on what the runtime does for real (`hicache.runtime.decode.faults`):

- `l3_exists`: error -> the query answers 0 hits; partial -> fewer hits than storage holds.
- `l3_get`: error -> no page arrives; partial -> a prefix arrives; corrupt -> one stored page goes
  bad and fails its checksum, so it and the pages after it are a miss (reads stop at the first
  bad page).
- `l3_put`: error -> nothing is written; partial -> a prefix is; corrupt -> one page is stored
  damaged. `StoreDone` names the pages not written as failed (a damaged page is written).
- a damaged L3 page stays in storage: queries count it (they check presence, not contents) and
  every read stops at it, as with the runtime's file store, which keeps a file that fails its
  CRC and skips writing a key whose file exists.
- `backup`: the copy (or its tail, or one page) does not produce the bytes its checksum says; the
  L2 page is marked bad, so a later load-back of it fails and a store skips it, as the runtime's
  page checks do. A backup into the slot later makes it good again.
- `load`: error -> every request of the batch fails its load (the core re-requests the pages from
  prefill); partial -> the requests whose pages were not copied fail; corrupt -> one L2 source
  page is damaged at rest and the check after the copy fails its request. A load that reads a
  page marked bad fails that page's request. A failed request's pages (all of its pages in the
  batch) are reported as the `LoadDone`'s failed pages.
- `transfer`: error, partial, peer_death and corrupt end in `KVFailed` (after the bytes that moved
  before the fault: none, a share, a share, all of them); the core retries, then fails the
  request with the reason.
- `timer`: error -> the timer fires at once; delay -> it fires late.
- every `delay` postpones the completion by the drawn seconds (the channel is not held longer).

Draws are keyed by a command's number among this node's commands of its family, counted as they
are issued: the tree's copies and writes (`Backup`, `Store`) apart from the core's other
operations (queries, prefetches, timers, transfers, load-backs). These are the ids the core gave
them before it drew every command id from one counter; keeping them keeps fault runs comparable
across that change, and no later change in how the core numbers commands moves a fault.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import attrs

from hicache.core import commands as cmd
from hicache.faults import Decision, FaultSpec, decide


@attrs.frozen(slots=True)
class TransferFault:
    """How a P->D transfer goes: `share` of its bytes cross the link, then it arrives (`fail`
    False) or fails with `reason`; `delay` postpones either."""

    fail: bool
    share: float = 1.0
    delay: float = 0.0
    reason: str = ""


class SimFaults:
    """The faults one simulated decode node (`node`) suffers; `injected` counts them by
    `op.kind`."""

    def __init__(self, spec: FaultSpec, node: int = 0) -> None:
        self.spec = spec
        self.node = node
        self.injected: Counter[str] = Counter()
        self.bad_host: set[int] = set()  # L2 slots whose bytes fail their checksum
        self.bad_keys: set[int] = set()  # L3 pages stored damaged
        self._core_seq = itertools.count(1)  # the core's own operations, as issued
        self._tree_seq = itertools.count(1)  # the tree's backups and stores, as issued
        self._transfer_keys: dict[int, int] = {}  # transfer id -> its key, until it is sent

    def _decide(self, op: str, key: int, sub: int = 0) -> Decision | None:
        return decide(self.spec, op, key, node=self.node, sub=sub)

    def issue_transfer(self, c: cmd.RequestKV) -> None:
        """Number a `RequestKV` as it is issued: its fault is drawn only once prefill is done,
        when other commands have been numbered meanwhile."""
        self._transfer_keys[c.transfer] = next(self._core_seq)

    def _count(self, d: Decision) -> None:
        self.injected[f"{d.op}.{d.kind}"] += 1

    @staticmethod
    def _delay(d: Decision | None) -> float:
        return d.delay if d is not None and d.kind == "delay" else 0.0

    # ------------------------------------------------------------------ storage

    def query(
        self, c: cmd.QueryStorage, hits: Sequence[tuple[str, int]]
    ) -> tuple[tuple[tuple[str, int], ...], float]:
        """The hits a `QueryStorage` answers, and the delay of its answer."""
        key = next(self._core_seq)
        out, delay = [], 0.0
        for i, (rid, n) in enumerate(hits):
            d = self._decide("l3_exists", key, i)
            if d is not None and (d.kind == "delay" or n > 0):
                self._count(d)
                if d.kind == "error":
                    n = 0
                elif d.kind == "partial":
                    n = d.prefix(n)
                delay = max(delay, self._delay(d))
            out.append((rid, n))
        return tuple(out), delay

    def prefetch(self, c: cmd.Prefetch, avail: int) -> tuple[int, float]:
        """Pages of a `Prefetch` that arrive intact (of `avail` that storage holds), and the
        delay of its completion."""
        d = self._decide("l3_get", next(self._core_seq))
        if d is not None and (d.kind == "delay" or avail > 0):
            self._count(d)
            if d.kind == "error":
                avail = 0
            elif d.kind == "partial":
                avail = d.prefix(avail)
            elif d.kind == "corrupt":
                self.bad_keys.add(c.keys[d.index(avail)])
        if self.bad_keys:  # a read stops at the first page that fails its checksum
            avail = next((i for i, k in enumerate(c.keys[:avail]) if k in self.bad_keys), avail)
        self.bad_host.difference_update(c.host_slots[:avail])
        return avail, self._delay(d)

    def store(self, c: cmd.Store) -> tuple[tuple[int, ...], float]:
        """Keys of a `Store` that storage ends up holding (the driver reports the others
        failed), and the delay of its completion."""
        pairs = [(k, s) for k, s in zip(c.keys, c.host_slots, strict=True) if s not in self.bad_host]
        d = self._decide("l3_put", next(self._tree_seq))
        if d is not None and (d.kind == "delay" or pairs):
            self._count(d)
            if d.kind == "error":
                pairs = []
            elif d.kind == "partial":
                pairs = pairs[: d.prefix(len(pairs))]
            elif d.kind == "corrupt":
                self.bad_keys.add(pairs[d.index(len(pairs))][0])  # written, then damaged
        return tuple(k for k, _ in pairs), self._delay(d)

    # ------------------------------------------------------------------ copies

    def backup(self, c: cmd.Backup) -> tuple[tuple[int, ...], float]:
        """The pages of a `Backup` whose copy reports failure (an `error` or a `partial` copy:
        indices, for `BackupDone`), and the delay of its completion. A `corrupt` copy reports
        success and leaves one L2 page bad, to be caught when a load-back reads it."""
        slots = list(c.host_slots)
        good, bad = slots, []
        failed: tuple[int, ...] = ()
        d = self._decide("backup", next(self._tree_seq))
        if d is not None and (d.kind == "delay" or slots):
            self._count(d)
            if d.kind == "error":
                good, bad = [], slots
                failed = tuple(range(len(slots)))
            elif d.kind == "partial":
                k = d.prefix(len(slots))
                good, bad = slots[:k], slots[k:]
                failed = tuple(range(k, len(slots)))
            elif d.kind == "corrupt":
                i = d.index(len(slots))
                good, bad = slots[:i] + slots[i + 1 :], [slots[i]]
        self.bad_host.difference_update(good)
        self.bad_host.update(bad)  # also those reported: a core that kept them would be caught
        return failed, self._delay(d)

    def load(self, c: cmd.LoadBack) -> tuple[tuple[int, ...], float]:
        """Pages of a `LoadBack` (indices into its pages, in order) that fail to arrive intact,
        and the delay of its completion. A request with any such page loses all of its pages in
        the batch, as when faults named requests: the same draws fail the same requests."""
        host = c.host_slots  # built from the entries on each access: once here
        n = len(host)
        lost: set[int] = set()  # positions in the batch
        d = self._decide("load", next(self._core_seq))
        if d is not None and (d.kind == "delay" or n):
            self._count(d)
            if d.kind == "error":
                lost = set(range(n))
            elif d.kind == "partial":
                lost = set(range(d.prefix(n), n))
            elif d.kind == "corrupt":
                self.bad_host.add(host[d.index(n)])
        lost.update(i for i, s in enumerate(host) if s in self.bad_host)
        spans: list[tuple[str, int, int]] = []  # (request, first, end) per entry, in order
        start = 0
        for entry in c.entries:
            spans.append((entry.req, start, start + len(entry.host_slots)))
            start += len(entry.host_slots)
        hit = {req for req, a, b in spans if any(a <= i < b for i in lost)}
        failed = tuple(i for req, a, b in spans if req in hit for i in range(a, b))
        return failed, self._delay(d)

    # ------------------------------------------------------------------ transfers and timers

    def transfer(self, c: cmd.RequestKV) -> TransferFault | None:
        d = self._decide("transfer", self._transfer_keys.pop(c.transfer))
        if d is None or (d.kind in ("partial", "corrupt") and c.start == c.end):
            return None  # no page to cut short or to damage
        self._count(d)
        if d.kind == "delay":
            return TransferFault(False, delay=d.delay)
        if d.kind == "error":
            return TransferFault(True, 0.0, reason="prefill transfer error")
        if d.kind == "partial":
            return TransferFault(True, d.fraction, reason="prefill transfer ended early")
        if d.kind == "peer_death":
            return TransferFault(True, d.fraction, reason="prefill peer died mid-transfer")
        return TransferFault(True, 1.0, reason="a received page differs from what prefill sent")

    def timer(self, c: cmd.SetTimer, now: float) -> float:
        """When a `SetTimer` fires."""
        d = self._decide("timer", next(self._core_seq))
        if d is None:
            return max(c.at, now)
        self._count(d)
        return now if d.kind == "error" else max(c.at, now) + d.delay
