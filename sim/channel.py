"""A FIFO channel: a link or a storage device that serves one transfer at a time.

Contention is modelled by queueing: a transfer starts when the channel is free and holds it
for bytes / bandwidth; the fixed latency (propagation, per-operation setup) delays its
completion without holding the channel, so back-to-back transfers pipeline as they do on
RDMA, PCIe DMA engines or a striped storage service.
"""

from __future__ import annotations

import attrs


@attrs.define(slots=True, eq=False)
class Transfer:
    """One transfer's reservation: data moves during [start, busy_until)."""

    start: float
    busy_until: float
    done: float
    nbytes: float

    def fraction_at(self, t: float) -> float:
        """Share of the bytes moved by time t (the data flows at a constant rate)."""
        if t >= self.busy_until:
            return 1.0
        if t <= self.start or self.busy_until <= self.start:
            return 0.0
        return (t - self.start) / (self.busy_until - self.start)


@attrs.define(slots=True, eq=False)
class Channel:
    name: str
    bandwidth: float  # bytes/s
    latency: float  # s per transfer
    free_at: float = 0.0
    bytes_moved: float = 0.0
    busy_time: float = 0.0
    transfers: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"channel {self.name!r}: bandwidth must be > 0 and latency >= 0")

    def reserve(self, now: float, nbytes: float) -> Transfer:
        start = max(now, self.free_at)
        busy = nbytes / self.bandwidth
        self.free_at = start + busy
        self.bytes_moved += nbytes
        self.busy_time += busy
        self.transfers += 1
        return Transfer(start, start + busy, start + busy + self.latency, nbytes)

    def cut(self, t: Transfer, now: float) -> None:
        """A transfer stopped at `now`: if nothing queued behind it, the channel frees now."""
        if self.free_at == t.busy_until and now < t.busy_until:
            unused = t.busy_until - max(now, t.start)
            self.free_at = max(now, t.start)
            self.busy_time -= unused
            self.bytes_moved -= t.nbytes * unused / max(t.busy_until - t.start, 1e-30)
