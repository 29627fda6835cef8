"""The one cost rule for restoring cached KV versus producing it again.

Both the decode-node core (the `adaptive` promise: restore a tier locally or receive it from
prefill) and the simulator's prefill node (read an L3 prefix or recompute it) ask the same
question: how long does moving `nbytes` along a tier's path take, and does that beat the
alternative? Keeping the formula here, pure (no clock, no I/O), stops the two from drifting.

A path is one hop (e.g. host memory -> GPU) or two in series (e.g. storage -> host memory ->
GPU); each hop costs a fixed latency plus bytes / bandwidth, and the hops are not pipelined —
a conservative estimate that matches how a restore waits for its read before its copy.
"""

from __future__ import annotations

import attrs


def _positive(inst: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name}: expected a bandwidth > 0, got {value!r}")


def _non_negative(inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name}: expected a latency >= 0, got {value!r}")


@attrs.frozen(slots=True)
class RestorePath:
    """Where restored KV comes from: a first hop and an optional second one in series.

    Latencies are in seconds, bandwidths in bytes/s. `hop_bandwidth=None` means no second hop
    (its latency is then ignored), so a one-hop path adds no terms a two-hop one would not.
    """

    latency: float = attrs.field(validator=_non_negative)
    bandwidth: float = attrs.field(validator=_positive)
    hop_latency: float = attrs.field(default=0.0, validator=_non_negative)
    hop_bandwidth: float | None = attrs.field(default=None, validator=_positive)

    def seconds(self, nbytes: float, queued: float = 0.0) -> float:
        """Time to restore `nbytes`: wait `queued` behind the first hop's backlog, then each hop.

        Summed left to right (queued + latency + bytes/bandwidth [+ hop latency + bytes/hop
        bandwidth]) so callers that used to inline this sum get bit-identical floats.
        """
        t = queued + self.latency + nbytes / self.bandwidth
        if self.hop_bandwidth is not None:
            t = t + self.hop_latency + nbytes / self.hop_bandwidth
        return t


def restore_pays(restore_s: float, alternative_s: float) -> bool:
    """Restore unless it is strictly slower than the alternative (receiving or recomputing).

    A tie goes to the restore: it keeps the work already paid for and spares the shared
    compute and network. Written as `not >` so an undefined (NaN) estimate also restores, as
    both call sites did before this rule was shared.
    """
    return not restore_s > alternative_s
