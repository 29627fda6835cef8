"""A transfer engine over plain TCP, in pure trio: the engine for hosts without NIXL/UCX.

Each engine listens on `(host, port)`; `local_info()` carries the address, the engine name and
the registered regions. Pages move straight between the socket and the registered tensor's
memory (`sendmsg`/`recvmsg_into` over memoryviews of the pages): no staging copy, and each
syscall moves at most what the socket buffer holds, so the event loop never stalls long.

Wire format. Every message starts with a fixed 32-byte little-endian header

    magic "HCKV" | version u8 | type u8 | name_len u16 | xid u64 | count u32 | page_bytes u64 |
    notif_len u32

followed by `name` (name_len bytes), then, for WRITE and READ, `count` page indices (u32 each),
then `notif` (notif_len bytes), then, for WRITE and READ_DATA, `count * page_bytes` page bytes.

- A connection opens with a mutual challenge–response over the cluster secret
  (`runtime/security/cluster_secret.py`), all of it within the handshake timeout on both sides:

      initiator -> HELLO      name = name_i, notif = nonce_i (16 bytes)
      target    -> HELLO_ACK  name = name_t, notif = nonce_t (16 bytes) | MAC(acceptor, ...)
      initiator -> AUTH       notif = MAC(initiator, ...)

  where both MACs are `secret.mac(role, nonce_i, nonce_t, name_i, name_t)` with the role in
  the personalisation (`b"hicache-kv-acc"`, `b"hicache-kv-init"`), and both nonces fresh per
  connection. The initiator checks the target's MAC before it sends AUTH (a wrong one ends the
  transfer `ERR`: the peer does not hold the cluster secret); the target checks AUTH with
  `hmac.compare_digest` before it reads any request. HELLO, HELLO_ACK and AUTH carry notif
  fields of exactly 16, 48 and 32 bytes, and AUTH no name.
- WRITE (name = target region, indices = target pages) carries the pages; the target writes them
  into its region, queues the notification, then answers ACK.
- WRITE_SPAN is a WRITE of bytes [offset, offset + page_bytes) of each page only (one layer
  group's share: KV streamed while prefill computes it): after the indices come `offset u32 |
  final u32`, and the notification is queued only when `final` is 1 (the transfer's last
  span); a non-final span's notif still tags it for `fence`.
- READ (name = source region, indices = source pages) is answered by READ_DATA with the pages in
  the requested order; once it has them all, the initiator sends READ_DONE and the target queues
  the notification.
- Anything the target rejects (bad magic or version, unknown type or region, a HELLO from an
  engine it does not know, a wrong or missing AUTH, page_bytes that differ from the region's,
  more pages than the region has, an index out of range, a repeated destination page, a name or
  notification over its limit) is answered by ERROR (the message in the notif field) and the
  connection is closed. Every length is checked against its limit before anything is allocated
  or read, so a frame can never make the target allocate more than 4 bytes per page of the
  region it addresses (the indices) plus `MAX_NOTIF_BYTES`; pages are received straight into
  the region.

Peers. An engine serves only the peers it was told about with `add_peer` — a node adds the peer
its authenticated control connection introduced, and `remove_peer`s it once that connection has
ended (which also cuts off the peer's connections into this engine). A connection must name
such a peer in its HELLO and then prove, by AUTH, that it holds the cluster secret; the engine
proves the same in its HELLO_ACK, so an initiator never sends pages to, or takes pages from, an
impostor listening on a peer's address. Proofs cover both fresh nonces, so a recorded AUTH
answers no later connection, and the role, so a proof reflected back is wrong. A known engine
name cannot be rebound: `add_peer` with the same name and another host:port raises
`ValueError` (the same address again updates the peer's regions), or a stranger who reached a
node's control port with a known name could divert that peer's pages to itself.

A connection carries one transfer at a time. Each peer gets up to `streams_per_peer` connections,
opened on demand and kept for reuse; concurrent transfers to one peer use different connections.
An idle connection the peer has closed meanwhile is noticed and replaced before it is used.

Failures. A connection that breaks (the peer died, reset, closed early) turns the transfer into
`ERR` on the initiator. The target discards a partial WRITE: it queues no notification, but the
destination pages may already hold part of the new data, so a receiver must only use pages a
notification (or an initiator's `DONE`) vouches for. A peer that stays connected but silent keeps
the transfer in `PROC`; `wait(timeout=...)` bounds that, and `release` cancels it.

Fences. A target that gives up on a transfer calls `fence(notif)` with the notification the
WRITE carries: a WRITE of it still landing is cut off between two reads of its pages (ERROR,
connection closed), one that arrives later is refused before any page byte is read, and once
`fence` returns not another byte of it reaches the region. Only then may the target hand its
pages to anything else. Fenced notifications are remembered for the engine's lifetime (one
entry per transfer given up on).
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import secrets
import select
import struct
import uuid
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Self

import attrs
import numpy as np
import trio

from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.transfer.base import (
    MAX_NAME_BYTES,
    MAX_NOTIF_BYTES,
    DescList,
    MemoryRegion,
    NotifQueue,
    Op,
    PeerInfo,
    Span,
    XferBook,
    XferHandle,
    XferRecord,
    XferState,
    host_pages,
    open_request,
)

if TYPE_CHECKING:
    import torch

MAGIC = b"HCKV"
# 2: the handshake proves the cluster secret (HELLO nonce, HELLO_ACK proof, AUTH); 3: WRITE_SPAN
VERSION = 3
HEADER = struct.Struct("<4sBBHQIQI")
SPAN = struct.Struct("<II")  # a WRITE_SPAN's offset into each page, and whether it is the last
INDEX_DTYPE = np.dtype("<u4")
# Buffers per sendmsg/recvmsg_into call (Linux IOV_MAX is 1024).
IOV_BATCH = 256
# How long the target tries to deliver an ERROR before it closes the connection anyway.
ERROR_SEND_S = 1.0
NONCE_BYTES = 16
MAC_BYTES = 32
# BLAKE2b personalisations: a proof made in one role is never valid in the other.
INITIATOR_PURPOSE = b"hicache-kv-init"
ACCEPTOR_PURPOSE = b"hicache-kv-acc"


class Msg(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    WRITE = 3
    READ = 4
    ACK = 5
    READ_DATA = 6
    READ_DONE = 7
    ERROR = 8
    AUTH = 9
    WRITE_SPAN = 10


PAGE_MSGS = frozenset({Msg.WRITE, Msg.READ, Msg.READ_DATA, Msg.WRITE_SPAN})
# The handshake messages' notif fields: exactly this many bytes (nonces and proofs).
HANDSHAKE_NOTIF = {
    Msg.HELLO: NONCE_BYTES,
    Msg.HELLO_ACK: NONCE_BYTES + MAC_BYTES,
    Msg.AUTH: MAC_BYTES,
}


def handshake_proof(
    secret: ClusterSecret, purpose: bytes, nonce_i: bytes, nonce_t: bytes, name_i: bytes, name_t: bytes
) -> bytes:
    """The MAC one side of a connection sends: `purpose` is `ACCEPTOR_PURPOSE` in HELLO_ACK and
    `INITIATOR_PURPOSE` in AUTH; the parts are the initiator's and the target's nonces and names."""
    return secret.mac(purpose, nonce_i, nonce_t, name_i, name_t)


class ProtocolError(Exception):
    """The other side sent something this protocol does not allow."""


class PeerClosed(Exception):
    """The connection ended; `clean` when it ended between two messages."""

    def __init__(self, clean: bool) -> None:
        super().__init__("connection closed" + ("" if clean else " in the middle of a message"))
        self.clean = clean


class _HandshakeTimeout(Exception):
    """The peer accepted the connection but did not complete HELLO in time."""


_NET_ERRORS = (OSError, PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError)


@attrs.frozen
class Frame:
    type: Msg
    xid: int
    name: bytes
    count: int
    page_bytes: int
    notif_len: int


def encode_header(
    mtype: int,
    xid: int,
    name: bytes = b"",
    count: int = 0,
    page_bytes: int = 0,
    notif_len: int = 0,
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
) -> bytes:
    """A header followed by `name`: the start of every message."""
    return HEADER.pack(magic, version, mtype, len(name), xid, count, page_bytes, notif_len) + name


class Conn:
    """One TCP connection: exact-length reads and vectored I/O straight to and from page memory."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.sock = stream.socket

    def close(self) -> None:
        self.sock.close()

    def is_stale(self) -> bool:
        """An idle connection has nothing to read: readable means EOF, a reset, or garbage."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))

    async def recv_exactly(self, n: int, *, boundary: bool = False) -> bytearray:
        buf = bytearray(n)
        await self.recv_into([memoryview(buf)], boundary=boundary)
        return buf

    async def recv_into(self, bufs: list[memoryview], *, boundary: bool = False) -> None:
        """Fill every buffer; EOF before the first byte is a clean close when `boundary`."""
        bufs = [b for b in bufs if len(b)]
        i, got = 0, 0
        while i < len(bufs):
            batch = bufs[i : i + IOV_BATCH]
            if len(batch) == 1:
                n = await self.sock.recv_into(batch[0])
            else:
                n = (await self.sock.recvmsg_into(batch))[0]
            if n == 0:
                raise PeerClosed(clean=boundary and got == 0)
            got += n
            while n:
                if n >= len(bufs[i]):
                    n -= len(bufs[i])
                    i += 1
                else:
                    bufs[i] = bufs[i][n:]
                    n = 0

    async def send(self, bufs: list[bytes | memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        i = 0
        while i < len(views):
            n = await self.sock.sendmsg(views[i : i + IOV_BATCH])
            while n:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0

    async def recv_frame(self, *, boundary: bool = False) -> Frame:
        """Read and check a header and its name; indices, notif and pages are left to the caller."""
        raw = await self.recv_exactly(HEADER.size, boundary=boundary)
        magic, version, mtype, name_len, xid, count, page_bytes, notif_len = HEADER.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, expected {VERSION}")
        try:
            t = Msg(mtype)
        except ValueError:
            raise ProtocolError(f"unknown message type {mtype}") from None
        if name_len > MAX_NAME_BYTES:
            raise ProtocolError(f"{t.name}: name of {name_len} bytes, at most {MAX_NAME_BYTES}")
        if notif_len > MAX_NOTIF_BYTES:
            raise ProtocolError(f"{t.name}: notif of {notif_len} bytes, at most {MAX_NOTIF_BYTES}")
        if t not in PAGE_MSGS and (count or page_bytes):
            raise ProtocolError(f"{t.name}: carries no pages, got count={count} page_bytes={page_bytes}")
        if t in HANDSHAKE_NOTIF:
            if notif_len != HANDSHAKE_NOTIF[t]:
                raise ProtocolError(f"{t.name}: notif of {notif_len} bytes, expected {HANDSHAKE_NOTIF[t]}")
            if t is Msg.AUTH and name_len:
                raise ProtocolError(f"AUTH: carries no name, got name_len={name_len}")
        elif t not in (Msg.WRITE, Msg.WRITE_SPAN, Msg.READ, Msg.ERROR) and notif_len:
            raise ProtocolError(f"{t.name}: carries no notif, got notif_len={notif_len}")
        name = bytes(await self.recv_exactly(name_len))
        return Frame(t, xid, name, count, page_bytes, notif_len)

    async def send_error(self, xid: int, message: str) -> None:
        text = message.encode("utf-8")[:MAX_NOTIF_BYTES]
        await self.send([encode_header(Msg.ERROR, xid, notif_len=len(text)), text])


@attrs.define(eq=False)
class _Region:
    region: MemoryRegion
    tensor: torch.Tensor | np.ndarray
    pages: np.ndarray  # uint8 [num_pages, page_bytes] sharing the tensor's memory
    descs: DescList

    def views(self, idx: np.ndarray, span: Span | None = None) -> list[memoryview]:
        pages = self.pages
        if span is None:
            return [memoryview(pages[i]) for i in idx.tolist()]
        lo, hi = span.offset, span.offset + span.length
        return [memoryview(pages[i, lo:hi]) for i in idx.tolist()]


@attrs.define(eq=False)
class _Landing:
    """A WRITE whose pages are being received: `fence` cancels `scope` and waits for `left`."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    left: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Peer:
    info: PeerInfo
    host: str
    port: int
    slots: trio.Semaphore
    idle: list[Conn] = attrs.field(factory=list)


class TcpEngine:
    """The TCP transfer engine; use as `async with TcpEngine() as engine:`.

    `host` is the address it listens on and, unless `advertise` names another (a node bound to
    every interface has to give peers an address they can dial), the one `local_info()` tells
    peers to dial; `port=0` picks a free port and `local_info()` reports the bound one. Regions must be host
    memory (CPU tensors or numpy arrays). `aclose()` (or leaving the `async with`) ends every
    transfer in flight with `ERR`, closes all connections and makes `next_notif()` raise
    `trio.EndOfChannel` once the queued notifications are read.

    Opening a connection (connect, HELLO, HELLO_ACK, AUTH) must finish within
    `handshake_timeout_s`, on both sides: a peer that accepts but never answers fails the
    transfer with `ERR`, and a connection that does not complete its handshake is dropped.
    Transfers themselves have no deadline here.

    `secret` is the cluster secret both ends of every connection prove they hold (None:
    `ClusterSecret.load()`, now). Only peers known through `add_peer` may connect (module notes).
    """

    kind = "tcp"  # how peers name this engine (`hicache.runtime.wire.compat`)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str | None = None,
        streams_per_peer: int = 4,
        handshake_timeout_s: float = 5.0,
        secret: ClusterSecret | None = None,
        advertise: str | None = None,
    ) -> None:
        if streams_per_peer < 1:
            raise ValueError(f"streams_per_peer: expected >= 1, got {streams_per_peer}")
        if not handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s: expected > 0 seconds, got {handshake_timeout_s}")
        self._handshake_timeout = handshake_timeout_s
        self._name = name if name is not None else f"tcp-{uuid.uuid4().hex[:12]}"
        if not self._name or len(self._name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"name: expected 1..{MAX_NAME_BYTES} UTF-8 bytes, got {self._name!r}")
        self._name_b = self._name.encode("utf-8")
        self._secret = secret if secret is not None else ClusterSecret.load()
        self._host = host
        self._advertise = advertise or host
        self._port_wanted = port
        self._port: int | None = None
        self._streams_per_peer = streams_per_peer
        self._regions: dict[str, _Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._inbound: dict[str, set[trio.CancelScope]] = {}  # peer -> its served connections
        self._book = XferBook(self._name)
        self._scopes: dict[int, trio.CancelScope] = {}
        self._runs: dict[int, trio.Event] = {}  # xid -> set when its task has stopped sending
        self._notifs = NotifQueue()
        self._fenced: set[bytes] = set()
        self._landing: dict[bytes, _Landing] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError(f"{self._name}: not started (use `async with engine:`)")
        return self._port

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._stack is not None or self._closed:
            raise RuntimeError(f"{self._name}: an engine starts once")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            serve = partial(
                trio.serve_tcp, self._serve, self._port_wanted, host=self._host, handler_nursery=self._nursery
            )
            listeners = await self._nursery.start(serve)
        except BaseException as e:
            await stack.__aexit__(type(e), e, e.__traceback__)
            raise
        self._port = listeners[0].socket.getsockname()[1]
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._closed = True
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        for peer in self._peers.values():
            for conn in peer.idle:
                conn.close()
            peer.idle.clear()
        for rec in self._book.records():
            rec.finish(XferState.ERR, "engine closed")
        self._notifs.close()
        await stack.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Same as leaving `async with`; call it from the task that started the engine."""
        await self.__aexit__(None, None, None)

    def _started(self) -> trio.Nursery:
        if self._nursery is None or self._closed:
            raise RuntimeError(f"{self._name}: not running (use `async with engine:`)")
        return self._nursery

    # -- regions and peers ---------------------------------------------------------------------

    def register(self, name: str, tensor: torch.Tensor | np.ndarray) -> MemoryRegion:
        """Expose a host page pool `[num_pages, ...]` (CPU tensor or numpy array) under `name`."""
        if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"region name: expected 1..{MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered with {self._name}")
        pages = host_pages(name, tensor)
        region = MemoryRegion(name, 0, pages.shape[1], pages.shape[0])
        self._regions[name] = _Region(region, tensor, pages, DescList.for_region(region))
        return region

    def prepare(self, region: MemoryRegion) -> DescList:
        return self._local(region).descs

    def _local(self, region: MemoryRegion) -> _Region:
        reg = self._regions.get(region.name)
        if reg is None or reg.region != region:
            raise ValueError(f"region {region.name!r} is not registered with {self._name}")
        return reg

    def local_info(self) -> bytes:
        fields = {"host": self._advertise.encode("utf-8"), "port": self.port.to_bytes(2, "little")}
        regions = tuple(r.region for r in self._regions.values())
        return PeerInfo(self.kind, self._name, fields, regions).encode()

    async def add_peer(self, info: bytes) -> str:
        """Learn a peer from its `local_info()`: from now on it may connect here, and transfers may
        be posted to it. Adding a known peer again with the same host:port updates its regions;
        with another one it raises `ValueError` (a known engine name cannot be rebound)."""
        peer = PeerInfo.decode(info)
        if peer.kind != self.kind:
            raise ValueError(
                f"peer info is for a {peer.kind!r} engine; {self._name} is a {self.kind!r} engine"
            )
        try:
            host = peer.fields["host"].decode("utf-8")
            port = int.from_bytes(peer.fields["port"], "little")
        except (KeyError, UnicodeDecodeError) as e:
            raise ValueError(f"peer info of {peer.name!r}: missing or bad host/port field ({e})") from None
        old = self._peers.get(peer.name)
        if old is None:
            self._peers[peer.name] = _Peer(peer, host, port, trio.Semaphore(self._streams_per_peer))
        elif (old.host, old.port) == (host, port):
            old.info = peer
        else:
            raise ValueError(
                f"{self._name}: engine name {peer.name!r} is already bound to {old.host}:{old.port}; "
                f"refusing to rebind it to {host}:{port} (a known engine name cannot be rebound)"
            )
        return peer.name

    def remove_peer(self, name: str) -> None:
        """Forget peer `name` (an unknown name is a no-op): its idle connections are closed, its
        connections into this engine are cut off (a WRITE landing from it is discarded, with no
        notification), and it may not connect again until `add_peer` introduces it anew.
        Transfers this engine already posted to it run to their end."""
        peer = self._peers.pop(name, None)
        if peer is not None:
            for conn in peer.idle:
                conn.close()
            peer.idle.clear()
        for scope in self._inbound.pop(name, ()):
            scope.cancel()

    # -- transfers -----------------------------------------------------------------------------

    async def post(
        self,
        op: Op,
        local: MemoryRegion,
        local_pages: Sequence[int] | np.ndarray,
        peer: str,
        remote_region: str,
        remote_pages: Sequence[int] | np.ndarray,
        notif: bytes = b"",
        *,
        span: Span | None = None,
        final: bool = True,
    ) -> XferHandle:
        nursery = self._started()
        reg = self._local(local)
        if span is not None:
            if op != "WRITE":
                raise ValueError(f"span: only a WRITE moves part of each page, not a {op}")
            span.check(local.page_bytes)
        p, lp, rp, rec = open_request(
            self._name,
            self._peers,
            self._book,
            op,
            local,
            local_pages,
            peer,
            remote_region,
            remote_pages,
            notif,
        )
        scope = trio.CancelScope()
        self._scopes[rec.handle.xid] = scope
        self._runs[rec.handle.xid] = trio.Event()
        args = (rec, scope, p, op, reg, lp, remote_region, rp, bytes(notif), span, final)
        nursery.start_soon(self._run, *args)
        await trio.lowlevel.checkpoint()
        return rec.handle

    def state(self, handle: XferHandle) -> XferState:
        return self._book.get(handle).state

    def reason(self, handle: XferHandle) -> str | None:
        """Why a transfer ended in ERR (None otherwise)."""
        return self._book.get(handle).reason

    async def wait(self, handle: XferHandle, *, timeout: float) -> XferState:
        """`DONE` or `ERR`; raises `TransferTimeout` if still in flight after `timeout` seconds."""
        return await self._book.wait(handle, timeout)

    def release(self, handle: XferHandle) -> None:
        """Forget a transfer; one still in flight is cancelled (its connection is dropped)."""
        rec = self._book.pop(handle)
        scope = self._scopes.pop(handle.xid, None)
        if scope is not None and rec.state is XferState.PROC:
            scope.cancel()
        rec.finish(XferState.ERR, "released while in flight")

    async def settle(self, handle: XferHandle) -> None:
        """Release `handle` and return once this side sends nothing more of it (its connection is
        closed if it was cut short). Bytes already sent may still be read by the target: a
        target that gives up on a transfer fences it (`fence`)."""
        done = self._runs.get(handle.xid)
        self.release(handle)
        if done is not None:
            await done.wait()

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

    async def next_notif(self) -> tuple[str, bytes]:
        return await self._notifs.next()

    def notifs(self) -> list[tuple[str, bytes]]:
        return self._notifs.drain()

    # -- initiator side ------------------------------------------------------------------------

    async def _run(
        self,
        rec: XferRecord,
        scope: trio.CancelScope,
        peer: _Peer,
        op: str,
        reg: _Region,
        lp: np.ndarray,
        remote_region: str,
        rp: np.ndarray,
        notif: bytes,
        span: Span | None = None,
        final: bool = True,
    ) -> None:
        try:
            with scope:
                try:
                    async with peer.slots:
                        conn = await self._checkout(peer)
                        reusable = False
                        try:
                            if op == "WRITE":
                                await self._write(conn, rec, reg, lp, remote_region, rp, notif, span, final)
                            else:
                                await self._read(conn, rec, reg, lp, remote_region, rp, notif)
                            reusable = rec.state is XferState.DONE
                        finally:
                            if reusable and not self._closed and self._peers.get(peer.info.name) is peer:
                                peer.idle.append(conn)
                            else:
                                conn.close()
                except ProtocolError as e:
                    rec.finish(XferState.ERR, f"protocol error from {peer.info.name!r}: {e}")
                except _HandshakeTimeout as e:
                    rec.finish(XferState.ERR, str(e))
                except _NET_ERRORS as e:
                    rec.finish(XferState.ERR, f"connection to {peer.info.name!r} lost: {e!r}")
            self._scopes.pop(rec.handle.xid, None)
            rec.finish(XferState.ERR, "cancelled")
        finally:
            self._runs.pop(rec.handle.xid).set()

    async def _checkout(self, peer: _Peer) -> Conn:
        """An idle connection to `peer` that is still open, else a new one."""
        while peer.idle:
            conn = peer.idle.pop()
            if not conn.is_stale():
                return conn
            conn.close()
        return await self._connect(peer)

    async def _connect(self, peer: _Peer) -> Conn:
        conn: Conn | None = None
        try:
            with trio.fail_after(self._handshake_timeout):
                conn = Conn(await trio.open_tcp_stream(peer.host, peer.port))
                await self._initiate(conn, peer)
        except BaseException as e:
            if conn is not None:
                conn.close()
            if isinstance(e, trio.TooSlowError):
                raise _HandshakeTimeout(
                    f"no HELLO_ACK from {peer.info.name!r} at {peer.host}:{peer.port} "
                    f"within {self._handshake_timeout} s"
                ) from None
            raise
        return conn

    async def _initiate(self, conn: Conn, peer: _Peer) -> None:
        """HELLO, check the target's proof in HELLO_ACK, then prove this side's in AUTH."""
        target = peer.info.name.encode("utf-8")
        nonce_i = secrets.token_bytes(NONCE_BYTES)
        hello = encode_header(Msg.HELLO, 0, self._name_b, notif_len=NONCE_BYTES)
        await conn.send([hello, nonce_i])
        f = await conn.recv_frame()
        if f.type is Msg.ERROR:
            raise ProtocolError(f"HELLO refused: {await _error_text(conn, f)}")
        if f.type is not Msg.HELLO_ACK or f.name != target:
            raise ProtocolError(f"expected HELLO_ACK from {peer.info.name!r}, got {f.type.name} {f.name!r}")
        body = bytes(await conn.recv_exactly(f.notif_len))
        nonce_t, proof = body[:NONCE_BYTES], body[NONCE_BYTES:]
        parts = (nonce_i, nonce_t, self._name_b, target)
        if not hmac.compare_digest(proof, handshake_proof(self._secret, ACCEPTOR_PURPOSE, *parts)):
            raise ProtocolError(
                f"{peer.info.name!r} at {peer.host}:{peer.port} does not hold the cluster secret "
                "(wrong proof in HELLO_ACK)"
            )
        proof = handshake_proof(self._secret, INITIATOR_PURPOSE, *parts)
        await conn.send([encode_header(Msg.AUTH, 0, notif_len=MAC_BYTES), proof])

    async def _write(
        self,
        conn: Conn,
        rec: XferRecord,
        reg: _Region,
        lp: np.ndarray,
        region: str,
        rp: np.ndarray,
        notif: bytes,
        span: Span | None = None,
        final: bool = True,
    ) -> None:
        xid = rec.handle.xid
        name = region.encode("utf-8")
        indices = rp.astype(INDEX_DTYPE).tobytes()
        if span is None:
            head = encode_header(Msg.WRITE, xid, name, len(rp), reg.region.page_bytes, len(notif))
            parts = [head, indices, notif]
        else:
            head = encode_header(Msg.WRITE_SPAN, xid, name, len(rp), span.length, len(notif))
            parts = [head, indices, SPAN.pack(span.offset, int(final)), notif]
        try:
            await conn.send([*parts, *reg.views(lp, span)])
        except _NET_ERRORS:
            # The target may have refused the request and closed: report its reason if it sent one.
            with trio.move_on_after(0.5):
                f = await conn.recv_frame()
                if f.type is Msg.ERROR:
                    raise ProtocolError(f"refused: {await _error_text(conn, f)}") from None
            raise
        f = await conn.recv_frame()
        self._check_reply(f, xid, Msg.ACK)
        if f.type is Msg.ERROR:
            rec.finish(XferState.ERR, f"refused by peer: {await _error_text(conn, f)}")
        else:
            rec.finish(XferState.DONE)

    async def _read(
        self,
        conn: Conn,
        rec: XferRecord,
        reg: _Region,
        lp: np.ndarray,
        region: str,
        rp: np.ndarray,
        notif: bytes,
    ) -> None:
        xid = rec.handle.xid
        page_bytes = reg.region.page_bytes
        head = encode_header(Msg.READ, xid, region.encode("utf-8"), len(rp), page_bytes, len(notif))
        await conn.send([head, rp.astype(INDEX_DTYPE).tobytes(), notif])
        f = await conn.recv_frame()
        self._check_reply(f, xid, Msg.READ_DATA)
        if f.type is Msg.ERROR:
            rec.finish(XferState.ERR, f"refused by peer: {await _error_text(conn, f)}")
            return
        if f.count != len(lp) or f.page_bytes != page_bytes:
            raise ProtocolError(
                f"READ_DATA of {f.count} x {f.page_bytes} bytes, expected {len(lp)} x {page_bytes}"
            )
        await conn.recv_into(reg.views(lp))
        await conn.send([encode_header(Msg.READ_DONE, xid)])
        rec.finish(XferState.DONE)

    @staticmethod
    def _check_reply(f: Frame, xid: int, want: Msg) -> None:
        if f.type not in (want, Msg.ERROR):
            raise ProtocolError(f"expected {want.name} or ERROR, got {f.type.name}")
        # An ERROR for transfer 0 refuses the connection itself (say, an AUTH the target refused).
        if f.xid != xid and not (f.type is Msg.ERROR and f.xid == 0):
            raise ProtocolError(f"{f.type.name} for transfer {f.xid}, expected {xid}")

    # -- target side ---------------------------------------------------------------------------

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = Conn(stream)
        xid = 0
        peer: str | None = None
        scope = trio.CancelScope()  # `remove_peer` cancels it
        try:
            with trio.move_on_after(self._handshake_timeout) as handshake:
                peer = await self._accept(conn)
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
            with trio.move_on_after(ERROR_SEND_S), contextlib.suppress(*_NET_ERRORS):
                await conn.send_error(xid, str(e))
        except _NET_ERRORS:
            pass  # the initiator went away; a partial WRITE is discarded (no notification)
        finally:
            served = self._inbound.get(peer) if peer is not None else None
            if served is not None:
                served.discard(scope)
                if not served:
                    del self._inbound[peer]
            conn.close()

    async def _accept(self, conn: Conn) -> str:
        """The target's side of the handshake; returns the peer's name once it proved that it
        holds the cluster secret. Nothing it sends after HELLO is read before that."""
        f = await conn.recv_frame(boundary=True)
        if f.type is not Msg.HELLO:
            raise ProtocolError(f"expected HELLO first, got {f.type.name}")
        try:
            peer = f.name.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("HELLO: the engine name is not UTF-8") from None
        nonce_i = bytes(await conn.recv_exactly(f.notif_len))
        if peer not in self._peers:
            raise ProtocolError(f"HELLO from {peer!r}: not a peer {self._name!r} knows")
        nonce_t = secrets.token_bytes(NONCE_BYTES)
        parts = (nonce_i, nonce_t, f.name, self._name_b)
        proof = handshake_proof(self._secret, ACCEPTOR_PURPOSE, *parts)
        ack = encode_header(Msg.HELLO_ACK, 0, self._name_b, notif_len=NONCE_BYTES + MAC_BYTES)
        await conn.send([ack, nonce_t, proof])
        f = await conn.recv_frame()
        if f.type is not Msg.AUTH:
            raise ProtocolError(f"expected AUTH from {peer!r}, got {f.type.name}")
        theirs = bytes(await conn.recv_exactly(f.notif_len))
        if not hmac.compare_digest(theirs, handshake_proof(self._secret, INITIATOR_PURPOSE, *parts)):
            raise ProtocolError(f"AUTH from {peer!r}: wrong proof (it does not hold the cluster secret)")
        if peer not in self._peers:  # removed while it proved itself
            raise ProtocolError(f"HELLO from {peer!r}: not a peer {self._name!r} knows (removed)")
        return peer

    async def _request(self, conn: Conn, f: Frame) -> tuple[_Region, np.ndarray, bytes, Span | None, bool]:
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
        if not notif:
            await conn.recv_into(reg.views(idx, span))
        else:
            if notif in self._fenced:
                raise ProtocolError(f"WRITE {notif[:64]!r}: fenced (the target gave up on this transfer)")
            if notif in self._landing:
                raise ProtocolError(f"WRITE {notif[:64]!r}: a WRITE with this notification is landing")
            landing = self._landing[notif] = _Landing()
            try:
                with landing.scope:
                    await conn.recv_into(reg.views(idx, span))
            finally:
                del self._landing[notif]
                landing.left.set()
            if landing.scope.cancelled_caught:
                raise ProtocolError(f"WRITE {notif[:64]!r}: fenced while landing")
            if final:
                self._notifs.put(peer, notif)
        await conn.send([encode_header(Msg.ACK, f.xid)])

    async def _serve_read(self, conn: Conn, peer: str, f: Frame) -> None:
        reg, idx, notif, _, _ = await self._request(conn, f)
        head = encode_header(Msg.READ_DATA, f.xid, count=len(idx), page_bytes=reg.region.page_bytes)
        await conn.send([head, *reg.views(idx)])
        done = await conn.recv_frame()
        if done.type is not Msg.READ_DONE or done.xid != f.xid:
            raise ProtocolError(
                f"expected READ_DONE for transfer {f.xid}, got {done.type.name} for {done.xid}"
            )
        if notif:
            self._notifs.put(peer, notif)


async def _error_text(conn: Conn, f: Frame) -> str:
    raw = await conn.recv_exactly(f.notif_len)
    return raw.decode("utf-8", errors="replace")
