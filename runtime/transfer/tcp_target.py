"""The target side of the TCP engine: connections peers open to this engine, the WRITEs and
READs they carry, and the fences that stop a transfer given up on from writing here.

- WRITE (name = target region, indices = target pages) carries the pages; the target writes them
  into its region (a staged region: receives them into a staging buffer, then copies them into
  the region and waits for that copy to complete), queues the notification, then answers ACK.
- WRITE_SPAN writes one layer group's share of each page (KV streamed while prefill computes
  it): the notification is queued only when `final` is 1 (the transfer's last span); a
  non-final span's notif still tags it for `fence`.
- READ (name = source region, indices = source pages) is answered by READ_DATA with the pages in
  the requested order (a staged region: gathered into a staging buffer first); once it has them
  all, the initiator sends READ_DONE and the target queues the notification.
- Anything the target rejects (bad magic or version, unknown type or region, a HELLO from an
  engine it does not know, a wrong or missing AUTH, page_bytes that differ from the region's,
  more pages than the region has, an index out of range, a repeated destination page, a name or
  notification over its limit) is answered by ERROR (the message in the notif field) and the
  connection is closed. Every length is checked against its limit before anything is allocated
  or read, so a frame can never make the target allocate more than 4 bytes per page of the
  region it addresses (the indices) plus `MAX_NOTIF_BYTES`, and for a staged region a staging
  buffer of the pages it carries (at most the region's size); pages of a host region are
  received straight into the region.

A connection that breaks mid-WRITE is discarded: no notification is queued, but the destination
pages of a host region may already hold part of the new data, so a receiver must only use pages
a notification vouches for (a staged region drops the staging buffer: nothing lands).

Fences. A target that gives up on a transfer calls `fence(notif)` with the notification the
WRITE carries: a WRITE of it still landing is cut off between two reads of its pages (ERROR,
connection closed), one that arrives later is refused before any page byte is read, and once
`fence` returns not another byte of it reaches the region. A staged WRITE fenced before its last
byte arrived copies nothing into the region; one fenced while its staging buffer is being copied
in ends that copy before `fence` returns, and is refused all the same. Only then may the target
hand its pages to anything else. Fenced notifications are remembered for the engine's lifetime (one
entry per transfer given up on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import attrs
import numpy as np
import trio

from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.transfer.base import NotifQueue, Span
from hicache.runtime.transfer.tcp_handshake import accept
from hicache.runtime.transfer.tcp_wire import (
    INDEX_DTYPE,
    NET_ERRORS,
    SPAN,
    Conn,
    Frame,
    Msg,
    ProtocolError,
    Region,
    encode_header,
)

# How long the target tries to deliver an ERROR before it closes the connection anyway.
ERROR_SEND_S = 1.0


@attrs.define(eq=False)
class _Landing:
    """A WRITE whose pages are being received: `fence` cancels `scope` and waits for `left`."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    left: trio.Event = attrs.field(factory=trio.Event)


class Target:
    """Serves the connections peers open to engine `name`: only peers `knows` names, once they
    proved they hold `secret` within `handshake_timeout_s`. Pages land in `regions` (shared with
    the engine, which registers them); notifications of completed transfers go to `notifs`."""

    def __init__(
        self,
        name: str,
        secret: ClusterSecret,
        handshake_timeout_s: float,
        knows: Callable[[str], bool],
        regions: dict[str, Region],
    ) -> None:
        self._name = name
        self._name_b = name.encode("utf-8")
        self._secret = secret
        self._handshake_timeout = handshake_timeout_s
        self._knows = knows
        self._regions = regions
        self.notifs = NotifQueue()
        self._inbound: dict[str, set[trio.CancelScope]] = {}  # peer -> its served connections
        self._fenced: set[bytes] = set()
        self._landing: dict[bytes, _Landing] = {}

    def cut_off(self, peer: str) -> None:
        """End every connection `peer` has into this engine (a WRITE landing is discarded)."""
        for scope in self._inbound.pop(peer, ()):
            scope.cancel()

    async def fence(self, notif: bytes) -> bool:
        """Stop every WRITE carrying `notif` from writing here; True once none can (always: the
        target reads every byte itself, so it can refuse them)."""
        if not notif:
            raise ValueError("fence: expected the non-empty notification the transfer carries")
        notif = bytes(notif)
        self._fenced.add(notif)
        landing = self._landing.get(notif)
        if landing is not None:
            landing.scope.cancel()
            await landing.left.wait()
        return True

    async def serve(self, stream: trio.SocketStream) -> None:
        """One connection a peer opened: the handshake, then its requests one at a time until it
        closes; whatever is refused is answered by ERROR and ends the connection."""
        conn = Conn(stream)
        xid = 0
        peer: str | None = None
        scope = trio.CancelScope()  # `remove_peer` cancels it
        try:
            with trio.move_on_after(self._handshake_timeout) as handshake:
                peer = await accept(conn, self._secret, self._name_b, self._name, self._knows)
            if handshake.cancelled_caught:
                return  # no complete handshake in time: drop it (the finally clause closes it)
            assert peer is not None
            self._inbound.setdefault(peer, set()).add(scope)
            with scope:
                while True:
                    f = await conn.recv_frame(boundary=True)
                    xid = f.xid
                    if f.type in (Msg.WRITE, Msg.WRITE_SPAN):
                        await self._serve_write(conn, peer, f)
                    elif f.type is Msg.READ:
                        await self._serve_read(conn, peer, f)
                    else:
                        raise ProtocolError(f"expected WRITE or READ, got {f.type.name}")
        except ProtocolError as e:
            with trio.move_on_after(ERROR_SEND_S), contextlib.suppress(*NET_ERRORS):
                await conn.send_error(xid, str(e))
        except NET_ERRORS:
            pass  # the initiator went away; a partial WRITE is discarded (no notification)
        finally:
            served = self._inbound.get(peer) if peer is not None else None
            if served is not None:
                served.discard(scope)
                if not served:
                    del self._inbound[peer]
            conn.close()

    async def _request(self, conn: Conn, f: Frame) -> tuple[Region, np.ndarray, bytes, Span | None, bool]:
        """Check a WRITE/READ request against the region before reading its indices, span and
        notif; returns the region, the pages, the notif, the span (WRITE_SPAN) and whether the
        notification is to be delivered."""
        try:
            name = f.name.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{f.type.name}: region name is not UTF-8") from None
        reg = self._regions.get(name)
        if reg is None:
            raise ProtocolError(f"{f.type.name}: unknown region {name!r}")
        region = reg.region
        if f.type is Msg.WRITE_SPAN:
            if not 0 < f.page_bytes <= region.page_bytes:
                raise ProtocolError(
                    f"WRITE_SPAN: {f.page_bytes} bytes per page, region {name!r} has pages of "
                    f"{region.page_bytes}"
                )
        elif f.page_bytes != region.page_bytes:
            raise ProtocolError(
                f"{f.type.name}: page_bytes {f.page_bytes}, region {name!r} has {region.page_bytes}"
            )
        if f.count > region.num_pages:
            raise ProtocolError(f"{f.type.name}: {f.count} pages, region {name!r} has {region.num_pages}")
        idx = np.frombuffer(await conn.recv_exactly(f.count * INDEX_DTYPE.itemsize), dtype=INDEX_DTYPE)
        if idx.size:
            top = int(idx.max())
            if top >= region.num_pages:
                raise ProtocolError(
                    f"{f.type.name}: page {top} out of range for region {name!r} of {region.num_pages}"
                )
            if f.type in (Msg.WRITE, Msg.WRITE_SPAN) and len(np.unique(idx)) != len(idx):
                raise ProtocolError(f"{f.type.name}: destination pages repeat in region {name!r}")
        span, final = None, True
        if f.type is Msg.WRITE_SPAN:
            offset, last = SPAN.unpack(await conn.recv_exactly(SPAN.size))
            if last not in (0, 1) or offset + f.page_bytes > region.page_bytes:
                raise ProtocolError(
                    f"WRITE_SPAN: offset {offset} + {f.page_bytes} bytes past the region's pages of "
                    f"{region.page_bytes}, or final {last} not 0 or 1"
                )
            span, final = Span(offset, f.page_bytes), bool(last)
        notif = bytes(await conn.recv_exactly(f.notif_len))
        return reg, idx.astype(np.int64), notif, span, final

    async def _serve_write(self, conn: Conn, peer: str, f: Frame) -> None:
        reg, idx, notif, span, final = await self._request(conn, f)
        # A staged region's pages land only once `arrival.land()` returns (at once for a host
        # region), and never when the WRITE breaks or is fenced before: the staging buffer is
        # dropped on leaving `incoming`.
        with reg.incoming(idx, span) as arrival:
            if not notif:
                await conn.recv_into(arrival.views)
                await arrival.land()
            else:
                if notif in self._fenced:
                    raise ProtocolError(f"WRITE {notif[:64]!r}: fenced (the target gave up on this transfer)")
                if notif in self._landing:
                    raise ProtocolError(f"WRITE {notif[:64]!r}: a WRITE with this notification is landing")
                landing = self._landing[notif] = _Landing()
                try:
                    with landing.scope:
                        await conn.recv_into(arrival.views)
                    fenced = landing.scope.cancelled_caught
                    if not fenced and arrival.staged:
                        await arrival.land()
                        fenced = landing.scope.cancel_called  # that fence waited for the copy
                finally:
                    del self._landing[notif]
                    landing.left.set()
                if fenced:
                    raise ProtocolError(f"WRITE {notif[:64]!r}: fenced while landing")
                if final:
                    self.notifs.put(peer, notif)
        await conn.send([encode_header(Msg.ACK, f.xid)])

    async def _serve_read(self, conn: Conn, peer: str, f: Frame) -> None:
        reg, idx, notif, _, _ = await self._request(conn, f)
        head = encode_header(Msg.READ_DATA, f.xid, count=len(idx), page_bytes=reg.region.page_bytes)
        async with reg.outgoing(idx) as views:
            await conn.send([head, *views])
        done = await conn.recv_frame()
        if done.type is not Msg.READ_DONE or done.xid != f.xid:
            raise ProtocolError(
                f"expected READ_DONE for transfer {f.xid}, got {done.type.name} for {done.xid}"
            )
        if notif:
            self.notifs.put(peer, notif)
