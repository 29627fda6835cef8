"""A transfer engine over plain TCP, in pure trio: the engine for hosts without NIXL/UCX.

Each engine listens on `(host, port)`; `local_info()` carries the address, the engine name and
the registered regions. Pages of a host region move straight between the socket and the
registered tensor's memory: no staging copy. A socket cannot reach device memory, so a region on
a GPU (a decode node's L1 pool) is staged: its pages pass through a host staging buffer the size
of one transfer, and they count as arrived (ACK, notification, READ_DONE) only once the copy into
the region has completed (`tcp_wire.Staging`).

The engine is in parts: the wire format and one connection's I/O (`tcp_wire.py`), the handshake
that proves the cluster secret (`tcp_handshake.py`), the target side that serves peers' WRITEs
and READs and fences them (`tcp_target.py`), and here the engine itself, its peers and the
initiator side of each transfer.

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
`ERR` on the initiator; the target discards a partial WRITE (`tcp_target.py`). A peer that stays
connected but silent keeps the transfer in `PROC`; `wait(timeout=...)` bounds that, and `release`
cancels it. A target that gives up on a transfer `fence`s it (`tcp_target.py`).
"""

from __future__ import annotations

import contextlib
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
    DescList,
    MemoryRegion,
    Op,
    PeerInfo,
    Span,
    XferBook,
    XferHandle,
    XferRecord,
    XferState,
    host_pages,
    open_request,
    tensor_geometry,
)
from hicache.runtime.transfer.tcp_handshake import HandshakeTimeout, initiate
from hicache.runtime.transfer.tcp_target import Target
from hicache.runtime.transfer.tcp_wire import (
    INDEX_DTYPE,
    NET_ERRORS,
    SPAN,
    Conn,
    Frame,
    Msg,
    ProtocolError,
    Region,
    Staging,
    encode_header,
    error_text,
)

if TYPE_CHECKING:
    import torch


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
    peers to dial; `port=0` picks a free port and `local_info()` reports the bound one. Regions are
    host memory (CPU tensors or numpy arrays) or, staged, device memory (`register`). `aclose()`
    (or leaving the `async with`) ends every transfer in flight with `ERR`, closes all
    connections and makes `next_notif()` raise `trio.EndOfChannel` once the queued notifications
    are read.

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
        self._regions: dict[str, Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._book = XferBook(self._name)
        self._scopes: dict[int, trio.CancelScope] = {}
        self._runs: dict[int, trio.Event] = {}  # xid -> set when its task has stopped sending
        self._target = Target(
            self._name, self._secret, handshake_timeout_s, lambda peer: peer in self._peers, self._regions
        )
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
                trio.serve_tcp,
                self._target.serve,
                self._port_wanted,
                host=self._host,
                handler_nursery=self._nursery,
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
        self._target.notifs.close()
        await stack.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Same as leaving `async with`; call it from the task that started the engine."""
        await self.__aexit__(None, None, None)

    def _started(self) -> trio.Nursery:
        if self._nursery is None or self._closed:
            raise RuntimeError(f"{self._name}: not running (use `async with engine:`)")
        return self._nursery

    # -- regions and peers ---------------------------------------------------------------------

    def register(
        self, name: str, tensor: torch.Tensor | np.ndarray, *, staged: bool | None = None
    ) -> MemoryRegion:
        """Expose a page pool `[num_pages, ...]` under `name`.

        A host pool (CPU tensor or numpy array) is read and written in place. A staged one moves
        its pages through host staging buffers (module notes), which is how a device pool (a
        CUDA tensor) is served: `staged=None` stages exactly the pools not in host memory, and
        `staged=True` stages a host pool too (the same code path, so it runs without a GPU).
        """
        if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"region name: expected 1..{MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered with {self._name}")
        on_host = isinstance(tensor, np.ndarray) or tensor.device.type == "cpu"
        if staged is None:
            staged = not on_host
        if not staged:
            pages = host_pages(name, tensor)
            region = MemoryRegion(name, 0, pages.shape[1], pages.shape[0])
            self._regions[name] = Region(region, tensor, pages, DescList.for_region(region))
            return region
        if on_host:
            host_pages(name, tensor)  # the same checks (contiguous, writable) as a host region
        num_pages, page_bytes = tensor_geometry(name, tensor)
        mem, dev = "DRAM", 0
        if not isinstance(tensor, np.ndarray) and tensor.device.type == "cuda":
            mem, dev = "VRAM", tensor.get_device()
        region = MemoryRegion(name, 0, page_bytes, num_pages, mem, dev)
        # Free staging buffers kept for reuse: at most what the largest transfer needs.
        staging = Staging(tensor, region, keep_bytes=region.nbytes)
        self._regions[name] = Region(region, tensor, None, DescList.for_region(region), staging)
        return region

    def staging_allocations(self, region: MemoryRegion) -> int:
        """How many staging buffers staged region `region` allocated so far (0: not staged)."""
        staging = self._local(region).staging
        return 0 if staging is None else staging.allocations

    def prepare(self, region: MemoryRegion) -> DescList:
        return self._local(region).descs

    def _local(self, region: MemoryRegion) -> Region:
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
        self._target.cut_off(name)

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
        """Stop every WRITE carrying `notif` from writing here (`tcp_target.py`); True once none
        can (always: the target reads every byte itself, so it can refuse them)."""
        return await self._target.fence(notif)

    async def next_notif(self) -> tuple[str, bytes]:
        return await self._target.notifs.next()

    def notifs(self) -> list[tuple[str, bytes]]:
        return self._target.notifs.drain()

    # -- initiator side ------------------------------------------------------------------------

    async def _run(
        self,
        rec: XferRecord,
        scope: trio.CancelScope,
        peer: _Peer,
        op: str,
        reg: Region,
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
                except HandshakeTimeout as e:
                    rec.finish(XferState.ERR, str(e))
                except NET_ERRORS as e:
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
                await initiate(conn, self._secret, self._name_b, peer.info.name, f"{peer.host}:{peer.port}")
        except BaseException as e:
            if conn is not None:
                conn.close()
            if isinstance(e, trio.TooSlowError):
                raise HandshakeTimeout(
                    f"no HELLO_ACK from {peer.info.name!r} at {peer.host}:{peer.port} "
                    f"within {self._handshake_timeout} s"
                ) from None
            raise
        return conn

    async def _write(
        self,
        conn: Conn,
        rec: XferRecord,
        reg: Region,
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
        async with reg.outgoing(lp, span) as views:
            try:
                await conn.send([*parts, *views])
            except NET_ERRORS:
                # The target may have refused the request and closed: report its reason if it sent one.
                with trio.move_on_after(0.5):
                    f = await conn.recv_frame()
                    if f.type is Msg.ERROR:
                        raise ProtocolError(f"refused: {await error_text(conn, f)}") from None
                raise
        f = await conn.recv_frame()
        self._check_reply(f, xid, Msg.ACK)
        if f.type is Msg.ERROR:
            rec.finish(XferState.ERR, f"refused by peer: {await error_text(conn, f)}")
        else:
            rec.finish(XferState.DONE)

    async def _read(
        self,
        conn: Conn,
        rec: XferRecord,
        reg: Region,
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
            rec.finish(XferState.ERR, f"refused by peer: {await error_text(conn, f)}")
            return
        if f.count != len(lp) or f.page_bytes != page_bytes:
            raise ProtocolError(
                f"READ_DATA of {f.count} x {f.page_bytes} bytes, expected {len(lp)} x {page_bytes}"
            )
        with reg.incoming(lp) as arrival:
            await conn.recv_into(arrival.views)
            await arrival.land()  # READ_DONE tells the target (and its notification) we have them
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
