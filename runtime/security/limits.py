"""What one node lets its peers hold: connections, bytes of half-received frames, and time.

A node serves many peers at once, and none of them may make it exit or hold its memory or its
connection slots for good. Each listening node (a decode node's client port, a prefill node's
control port) owns one `Gate`, which admits connections up to `Limits.max_connections`, counts
the bytes that frames being received announce against `Limits.frame_bytes_in_flight`, and hands
out `FrameReader`s that cut off a frame not complete within `Limits.frame_timeout_s` of its
first byte and a connection silent for `Limits.idle_timeout_s` between frames. Both nodes
refuse a request of more than `Limits.max_tokens` tokens.

The shared budget is only for peers that proved who they are. Until a connection's peer is
authenticated (the cluster secret on a prefill node's control port, an API key on a decode
node's client port that has `--api-keys`) its reader takes only frames of up to
`Limits.small_frame`, which are not counted; a larger one is refused and ends the connection. So
a process with neither key nor secret cannot hold any of the budget, however many headers it
sends; the handshake's frames are all far below that size. Nor does it hold a connection slot
for long: until authenticated, a connection silent for `Limits.frame_timeout_s` is closed (the
handshake takes a round trip), not after `Limits.idle_timeout_s`.

Nor can silent connections fill the slots: a node that marks its connections' waits between
requests (`Gate.between_requests`, the decode node's client port) makes room for a newcomer at
the cap by closing one that waits, with a `goodbye` (nothing of a next request was read, so a
client sends it again on a new connection): one not authenticated first, else the one idle the
longest. Only when every connection is busy is a newcomer refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import trio

from hicache.runtime.wire import protocol


def _positive(_: Any, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:  # NaN too
        raise ValueError(f"limits.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Limits:
    """A node's bounds on what its peers may hold (the defaults are in docs/reliability.md)."""

    # Connections served at once; one more is answered with an error and closed.
    max_connections: int = attrs.field(default=256, validator=_positive)
    # Sum over connections of the sizes that frames being received announce (JSON + binary);
    # a frame that would go past it is refused and its connection closed.
    frame_bytes_in_flight: int = attrs.field(default=64 << 20, validator=_positive)
    # Frames up to this size are not counted: connections x this is bounded by the connection cap.
    small_frame: int = attrs.field(default=64 << 10, validator=attrs.validators.ge(0))
    # From a frame's first byte to its last (and for a reply to be taken by the peer).
    frame_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    # Between frames, with nothing asked of the node still in progress on the connection.
    idle_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    # Tokens of one request, prompt and output together: the model's compute grows with them
    # (attention quadratically), and one request must not hold the node's compute for hours.
    max_tokens: int = attrs.field(default=32768, validator=_positive)


class Gate:
    """One node's connections and frame bytes in flight, and the readers that respect them."""

    def __init__(self, limits: Limits, log: logging.Logger) -> None:
        self.limits = limits
        self.log = log
        self.connections = 0
        self.in_flight = 0  # bytes announced by frames being received (above `small_frame`)
        self.peak_in_flight = 0
        self.refused_connections = 0
        self.refused_frames = 0
        self.refused_unauthenticated = 0  # of those, frames above `small_frame` before auth
        self.evicted = 0  # connections closed while waiting, to make room for a newcomer
        self._waiting: dict[protocol.FrameReader, float] = {}  # between requests, since when

    # ------------------------------------------------------------------ the frame budget

    @property
    def small(self) -> int:
        return self.limits.small_frame

    def take(self, n: int) -> str:
        """Reserve `n` bytes for a frame being received; why not ("" when reserved)."""
        cap = self.limits.frame_bytes_in_flight
        if self.in_flight + n > cap:
            self.refused_frames += 1
            return f"frame of {n} B refused: {self.in_flight} of {cap} B of frames in flight on this node"
        self.in_flight += n
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return ""

    def give(self, n: int) -> None:
        self.in_flight -= n

    # ------------------------------------------------------------------ connections

    def reader(
        self,
        stream: trio.abc.ReceiveStream,
        *,
        max_binary: int = protocol.MAX_BINARY,
        authenticated: bool = False,
    ) -> protocol.FrameReader:
        """A reader of one connection; until `trust(reader)` (or with `authenticated`: a node
        that authenticates nobody) it takes no frame above `small_frame` and waits for the next
        frame only the frame timeout."""
        idle = self.limits.idle_timeout_s
        return protocol.FrameReader(
            stream,
            max_binary=max_binary,
            frame_timeout=self.limits.frame_timeout_s,
            idle_timeout=idle if authenticated else min(idle, self.limits.frame_timeout_s),
            budget=ConnectionBudget(self, authenticated),
        )

    def trust(self, reader: protocol.FrameReader) -> None:
        """The peer of `reader`'s connection is authenticated: its frames draw on the budget."""
        budget = reader.budget
        if not isinstance(budget, ConnectionBudget) or budget.gate is not self:
            raise ValueError("Gate.trust: the reader was not made by this gate")
        budget.authenticated = True
        reader.idle_timeout = self.limits.idle_timeout_s

    @property
    def waiting(self) -> int:
        """Connections waiting between requests, no byte of the next one read (those that
        could make room now)."""
        return sum(1 for reader in self._waiting if reader.in_idle_wait)

    @contextlib.contextmanager
    def between_requests(self, reader: protocol.FrameReader) -> Iterator[None]:
        """Around a wait for a connection's next request: the connection may be closed then
        to make room for a newcomer (module notes)."""
        self._waiting[reader] = trio.current_time()
        try:
            yield
        finally:
            self._waiting.pop(reader, None)

    def _make_room(self) -> bool:
        """Close a connection that waits between requests (module notes); False if none does."""

        def trusted(reader: protocol.FrameReader) -> bool:
            return isinstance(reader.budget, ConnectionBudget) and reader.budget.authenticated

        order = sorted(self._waiting, key=lambda r: (trusted(r), self._waiting[r]))
        cap = self.limits.max_connections
        for reader in order:
            reason = (
                f"closed to make room for a new connection: this node serves at most {cap} connections "
                "and this one was waiting for a request"
            )
            if reader.end_idle_wait(reason):
                del self._waiting[reader]
                self.evicted += 1
                return True
        return False

    async def enter(self, stream: trio.SocketStream, peer: str) -> bool:
        """Count a new connection in, or answer it with the reason it is refused (False)."""
        if self.connections >= self.limits.max_connections and not self._make_room():
            self.refused_connections += 1
            reason = (
                f"too many connections: this node serves at most {self.limits.max_connections}, "
                "all of them busy with requests"
            )
            self.log.warning("refused a connection from %s: %s", peer, reason)
            await self.send_quietly(stream, {"op": "error", "reason": reason})
            return False
        self.connections += 1
        return True

    def leave(self) -> None:
        self.connections -= 1

    async def send(self, stream: trio.abc.Stream, obj: dict[str, Any], binary: bytes = b"") -> None:
        """Send a frame the peer must take within the frame timeout; a peer that does not is
        cut off (the stream is closed) and this raises `ProtocolError`."""
        with trio.move_on_after(self.limits.frame_timeout_s) as scope:
            await protocol.send(stream, obj, binary)
        if scope.cancelled_caught:
            await stream.aclose()
            raise protocol.ProtocolError(
                f"the peer did not take a reply within {self.limits.frame_timeout_s} s"
            )

    async def send_quietly(self, stream: trio.abc.Stream, obj: dict[str, Any]) -> None:
        """A last word before closing a connection: sent if the peer takes it in time, else not."""
        with (
            trio.move_on_after(self.limits.frame_timeout_s),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError),
        ):
            await protocol.send(stream, obj)


class ConnectionBudget:
    """One connection's share of a `Gate`'s frame budget: none before its peer is
    authenticated (frames above `small` are refused, uncounted), the gate's after."""

    def __init__(self, gate: Gate, authenticated: bool = False) -> None:
        self.gate = gate
        self.authenticated = authenticated

    @property
    def small(self) -> int:
        return self.gate.small

    def take(self, n: int) -> str:
        if not self.authenticated:
            self.gate.refused_frames += 1
            self.gate.refused_unauthenticated += 1
            return (
                f"frame of {n} B refused: the peer is not authenticated yet, and until it is a "
                f"frame may have at most {self.gate.small} B"
            )
        return self.gate.take(n)

    def give(self, n: int) -> None:
        self.gate.give(n)


def peer_name(stream: trio.SocketStream) -> str:
    """host:port of the other end, for the log (or "?" once it is gone)."""
    try:
        host, port, *_ = stream.socket.getpeername()
    except (OSError, ValueError, TypeError):
        return "?"
    return f"{host}:{port}"
