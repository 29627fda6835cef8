"""A FIFO channel: a link or a storage device that serves one transfer at a time per lane.

Contention is modelled by queueing: a transfer starts when the channel is free and holds it
for bytes / bandwidth; the fixed latency (propagation, per-operation setup) delays its
completion without holding the channel, so back-to-back transfers pipeline as they do on
RDMA, PCIe DMA engines or a striped storage service.

A link whose every transfer runs on its own connection with a rate ceiling c (one RDMA queue
pair per transfer) is `lanes` = ceil(B / c) FIFO lanes of B / lanes each: several transfers
move in parallel, each below the ceiling, and together never above B. One lane is the plain
FIFO. A transfer takes the lane that frees first.

A streamed transfer (`stream`) sends data that its producer computes while it is on the wire:
prefill writes a prompt's KV layer group by layer group, and each group leaves as soon as it
exists. Its lane is held from the reservation until the last group has landed. A caller that
reserves it at `gapless_start` (the latest moment from which it can go out without a pause)
leaves the lane to other transfers until then, so a long prefill does not block the link.
"""

from __future__ import annotations

import math

MAX_LANES = 65536  # far beyond any NIC's queue pairs; bounds the memory a rate ceiling takes


class Transfer:
    """One transfer's reservation: data moves during [start, busy_until).

    A plain class, not attrs: a replay makes one per transfer, and the compiled build then
    constructs it natively (an attrs-generated `__init__` stays interpreted)."""

    __slots__ = ("start", "busy_until", "done", "nbytes", "lane")

    def __init__(self, start: float, busy_until: float, done: float, nbytes: float, lane: int = 0) -> None:
        self.start = start
        self.busy_until = busy_until
        self.done = done
        self.nbytes = nbytes
        self.lane = lane

    def __repr__(self) -> str:
        return (
            f"Transfer(start={self.start!r}, busy_until={self.busy_until!r}, done={self.done!r},"
            f" nbytes={self.nbytes!r}, lane={self.lane!r})"
        )

    def fraction_at(self, t: float) -> float:
        """Share of the bytes moved by time t (the data flows at a constant rate)."""
        if t >= self.busy_until:
            return 1.0
        if t <= self.start or self.busy_until <= self.start:
            return 0.0
        return (t - self.start) / (self.busy_until - self.start)


def lanes_for(bandwidth: float, ceiling: float | None) -> int:
    """Lanes of a link of `bandwidth` whose transfers each run at most at `ceiling` bytes/s."""
    if ceiling is None or ceiling >= bandwidth:
        return 1
    if not ceiling > 0:
        raise ValueError(f"a per-transfer rate must be > 0, got {ceiling}")
    lanes = max(1, math.ceil(bandwidth / ceiling * (1 - 1e-12)))
    if lanes > MAX_LANES:
        raise ValueError(
            f"{ceiling:g} bytes/s per transfer on a {bandwidth:g} bytes/s link needs {lanes} parallel "
            f"transfers; at most {MAX_LANES}, so at least {bandwidth / MAX_LANES:g} bytes/s"
        )
    return lanes


def streamed_end(
    s0: float, ps: float, pe: float, groups: int, head: float, body: float, share: float = 1.0
) -> float:
    """When the last byte of a streamed transfer has crossed a FIFO link that is free from s0.

    `head` seconds of wire time are ready at `ps` (KV the producer had before computing: its
    own cache); `body` seconds are computed over [ps, pe] in `groups` equal groups, group g
    ready at a_g = ps + (g+1)(pe-ps)/groups, and sent in order after the head. Of a FIFO
    queue the last item ends at max over items i of (max(s0, ready_i) + wire of items i..),
    and with equal groups at an even pace that maximum is at the head, the first group or the
    last group sent. A whole transfer is complete no earlier than prefill's end, even if all
    it carries was cached (prefill's last token yields the first output token). `share` < 1:
    only that leading share of the bytes goes (a transfer cut short); the result is when its
    last byte lands."""
    b = body / groups
    total = (head + body) * share
    end = max(s0, ps) + total
    if share >= 1.0:
        end = max(end, s0, pe)  # whole, it is complete only once prefill is (its first token)
    rest = total - head  # wire time of the groups sent
    # Nothing of the groups goes, or a remainder under 1e-9 of a group (waits for nothing); the
    # first test also covers a subnormal group, whose 1e-9 share underflows to zero.
    if b <= 0.0 or rest <= 0.0 or rest < 1e-9 * b:
        return end
    step = (pe - ps) / groups
    # the group holding the last byte sent
    last = groups - 1 if share >= 1.0 else min(groups - 1, max(0, math.ceil(rest / b - 1e-9) - 1))
    end = max(end, max(s0, ps + step) + rest)
    return max(end, max(s0, ps + (last + 1) * step) + rest - last * b)


def gapless_start(ps: float, pe: float, groups: int, head: float, body: float) -> float:
    """The latest time from which a streamed transfer (as in `streamed_end`) can go out at one
    stretch, never waiting for data: reserving the link then ends it when the closed form says
    for a link free by then, and leaves the link to others until then."""
    b = body / groups
    if b <= 0.0:
        return ps
    step = (pe - ps) / groups
    return max(ps, ps + step - head, pe - head - (groups - 1) * b)


class Channel:
    """One link or device: `lanes` FIFO lanes sharing `bandwidth` (bytes/s), `latency` s per
    transfer. A plain class rather than attrs, so that the compiled simulator compiles it too."""

    __slots__ = (
        "name",
        "bandwidth",
        "latency",
        "free_at",
        "bytes_moved",
        "busy_time",
        "transfers",
        "lanes",
        "_free",
    )

    def __init__(
        self,
        name: str,
        bandwidth: float,
        latency: float,
        *,
        lanes: int = 1,
    ) -> None:
        self.name = name
        self.bandwidth = bandwidth  # all lanes together
        self.latency = latency
        self.lanes = lanes
        # What the link has done so far.
        self.free_at = 0.0  # when the first lane frees
        self.bytes_moved = 0.0
        self.busy_time = 0.0  # seconds of the whole link's capacity spent moving bytes
        self.transfers = 0
        self._free: list[float] = []  # per lane, when lanes > 1
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"channel {self.name!r}: bandwidth must be > 0 and latency >= 0")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ValueError(f"channel {self.name!r}: lanes must be in [1, {MAX_LANES}], got {self.lanes}")
        if self.lanes > 1:
            self._free = [self.free_at] * self.lanes

    def __repr__(self) -> str:
        return (
            f"Channel({self.name!r}, bandwidth={self.bandwidth}, latency={self.latency}, lanes={self.lanes})"
        )

    @property
    def lane_rate(self) -> float:
        """Bytes/s of one transfer: the link's share of one lane."""
        return self.bandwidth / self.lanes

    def _take(self, now: float) -> tuple[int, float]:
        """The lane that frees first (the lowest of equals) and when it can start."""
        if self.lanes == 1:
            return 0, max(now, self.free_at)
        free = self._free
        lane = free.index(min(free))
        return lane, max(now, free[lane])

    def _hold(self, lane: int, until: float, nbytes: float) -> None:
        if self.lanes == 1:
            self.free_at = until
        else:
            self._free[lane] = until
            self.free_at = min(self._free)
        self.bytes_moved += nbytes
        self.busy_time += nbytes / self.bandwidth
        self.transfers += 1

    def reserve(self, now: float, nbytes: float) -> Transfer:
        if self.lanes == 1:  # the plain FIFO, written out: every copy and store comes here
            start = max(now, self.free_at)
            busy = nbytes / self.bandwidth
            self.free_at = start + busy
            self.bytes_moved += nbytes
            self.busy_time += busy
            self.transfers += 1
            return Transfer(start, start + busy, start + busy + self.latency, nbytes)
        lane, start = self._take(now)
        busy = nbytes / self.lane_rate
        self._hold(lane, start + busy, nbytes)
        return Transfer(start, start + busy, start + busy + self.latency, nbytes, lane)

    def stream(
        self,
        now: float,
        head: float,
        body: float,
        ps: float,
        pe: float,
        groups: int,
        share: float = 1.0,
    ) -> Transfer:
        """Reserve a lane for `head` bytes ready at `ps` and `body` bytes computed over
        [ps, pe] in `groups` groups (`streamed_end`); `share` of them are sent. The lane is held
        until the last byte lands."""
        lane, s0 = self._take(now)
        rate = self.lane_rate
        end = streamed_end(s0, ps, pe, groups, head / rate, body / rate, share)
        nbytes = (head + body) * share
        self._hold(lane, end, nbytes)
        return Transfer(max(s0, ps), end, end + self.latency, nbytes, lane)

    def stream_start(self, head: float, body: float, ps: float, pe: float, groups: int) -> float:
        """`gapless_start` of a streamed transfer of these bytes on one lane."""
        rate = self.lane_rate
        return gapless_start(ps, pe, groups, head / rate, body / rate)

    def cut(self, t: Transfer, now: float) -> None:
        """A transfer stopped at `now`: if nothing queued behind it, its lane frees now."""
        free = self.free_at if self.lanes == 1 else self._free[t.lane]
        if free == t.busy_until and now < t.busy_until:
            unused = t.busy_until - max(now, t.start)
            span = max(t.busy_until - t.start, 1e-30)
            if self.lanes == 1:
                self.free_at = max(now, t.start)
                self.busy_time -= unused
            else:
                self._free[t.lane] = max(now, t.start)
                self.free_at = min(self._free)
                self.busy_time -= unused / self.lanes
            self.bytes_moved -= t.nbytes * unused / span
