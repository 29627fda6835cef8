"""The TCP engine's wire format and one connection's I/O (`runtime/transfer/tcp.py` is the engine).

Every message starts with a fixed 32-byte little-endian header

    magic "HCKV" | version u8 | type u8 | name_len u16 | xid u64 | count u32 | page_bytes u64 |
    notif_len u32

followed by `name` (name_len bytes), then, for WRITE and READ, `count` page indices (u32 each),
then `notif` (notif_len bytes), then, for WRITE and READ_DATA, `count * page_bytes` page bytes.
A WRITE_SPAN is a WRITE of bytes [offset, offset + page_bytes) of each page only: after the
indices come `offset u32 | final u32`. HELLO, HELLO_ACK and AUTH (the handshake,
`tcp_handshake.py`) carry notif fields of exactly 16, 48 and 32 bytes, and AUTH no name.

`Conn.recv_frame` checks a header before anything it announces is read: magic, version, type,
the name's and notification's lengths against their limits, no pages or notification where the
type carries none. Pages of a host region move straight between the socket and page memory
(`sendmsg` / `recvmsg_into` over memoryviews of the pages, `Region.views`): no staging copy, and
each syscall moves at most what the socket buffer holds, so the event loop never stalls long.

A staged region (`Staging`) is one the socket cannot reach: device memory (a decode node's L1 pool
on its GPU). Its pages pass through a host staging buffer, pinned where CUDA is available, holding
just the pages of one transfer: received there and then copied into the region, or gathered there
from the region and then sent. `Region.incoming` and `Region.outgoing` hide which kind a region is.
"""

from __future__ import annotations

import contextlib
import enum
import select
import struct
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import attrs
import numpy as np
import trio

from hicache.runtime.transfer.base import MAX_NAME_BYTES, MAX_NOTIF_BYTES, DescList, MemoryRegion, Span

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
# At most this many bytes per strided (span) copy to or from a staged region: torch copies a
# strided device view through a contiguous scratch copy, which an L1 pool's full GPU must fit.
SPAN_SCRATCH_BYTES = 64 << 20
# The handshake's fresh nonces and BLAKE2b-256 proofs (`tcp_handshake.py`), in bytes.
NONCE_BYTES = 16
MAC_BYTES = 32


class Msg(enum.IntEnum):
    """A message's type (the header's type byte)."""

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


class ProtocolError(Exception):
    """The other side sent something this protocol does not allow."""


class PeerClosed(Exception):
    """The connection ended; `clean` when it ended between two messages."""

    def __init__(self, clean: bool) -> None:
        super().__init__("connection closed" + ("" if clean else " in the middle of a message"))
        self.clean = clean


NET_ERRORS = (OSError, PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError)


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
class Region:
    """A registered page pool: its region, the tensor, and its pages as bytes for the socket
    (`pages`, a host region) or the staging that moves them (`staging`, a staged region)."""

    region: MemoryRegion
    tensor: torch.Tensor | np.ndarray
    pages: np.ndarray | None  # uint8 [num_pages, page_bytes] sharing the tensor's memory
    descs: DescList
    staging: Staging | None = None

    def views(self, idx: np.ndarray, span: Span | None = None) -> list[memoryview]:
        """Views of pages `idx` (of bytes `span` of each, if given), in that order."""
        pages = self.pages
        assert pages is not None, "a staged region has no host pages to view"
        if span is None:
            return [memoryview(pages[i]) for i in idx.tolist()]
        lo, hi = span.offset, span.offset + span.length
        return [memoryview(pages[i, lo:hi]) for i in idx.tolist()]

    @contextlib.contextmanager
    def incoming(self, idx: np.ndarray, span: Span | None = None) -> Iterator[Arrival]:
        """Where pages `idx` (bytes `span` of each) of one transfer are to be received: the pages
        themselves, or a staging buffer that `Arrival.land` copies into them (returned on exit,
        so pages never landed are simply dropped)."""
        staging = self.staging
        if staging is None or not len(idx):
            yield Arrival(self.views(idx, span) if staging is None else [])
            return
        nbytes = len(idx) * (span.length if span is not None else self.region.page_bytes)
        buf = staging.take(nbytes)
        try:
            yield Arrival(staging.views(buf, nbytes), staging, buf, idx, span)
        finally:
            staging.give(buf)

    @contextlib.asynccontextmanager
    async def outgoing(self, idx: np.ndarray, span: Span | None = None) -> AsyncIterator[list[memoryview]]:
        """Views to send pages `idx` (bytes `span` of each) from, in order: the pages themselves,
        or a staging buffer they were gathered into (complete before this yields)."""
        staging = self.staging
        if staging is None or not len(idx):
            yield self.views(idx, span) if staging is None else []
            return
        nbytes = len(idx) * (span.length if span is not None else self.region.page_bytes)
        buf = staging.take(nbytes)
        try:
            await staging.gather(buf, idx, span)
            yield staging.views(buf, nbytes)
        finally:
            staging.give(buf)


@attrs.define(eq=False)
class Arrival:
    """Buffers to receive one transfer's pages into (`views`); for a staged region, `land` then
    copies them from the staging buffer into the region."""

    views: list[memoryview]
    staging: Staging | None = None
    buf: torch.Tensor | None = None
    idx: np.ndarray | None = None
    span: Span | None = None

    @property
    def staged(self) -> bool:
        """Whether the pages arrive in a staging buffer (and `land` has a copy to make)."""
        return self.staging is not None

    async def land(self) -> None:
        """Return once the received pages are in the region (at once for a host region). The copy
        cannot be cancelled halfway; a cancellation that came meanwhile is raised afterwards, so
        nothing is vouched for (ACK, notification) once the transfer is cut off."""
        if self.staging is None or self.buf is None or self.idx is None:
            return
        await self.staging.scatter(self.buf, self.idx, self.span)
        await trio.lowlevel.checkpoint_if_cancelled()


class Staging:
    """Moves a staged region's pages through host staging buffers (see the module notes).

    Buffers are reused: `take` hands out the smallest free one that is big enough and allocates
    (counted in `allocations`) only when none is; `give` keeps at most `keep_bytes` of free
    buffers. A CUDA region copies on a side stream and waits on an event, polled so the event loop
    never blocks; a host region (`staged=True`, which CI exercises) copies in place. Like NIXL's
    one-sided transfers, the copies take no stream order: pages are handed to a transfer only
    once nothing on the device still writes (source) or reads (destination) them.
    """

    def __init__(self, tensor: torch.Tensor | np.ndarray, region: MemoryRegion, keep_bytes: int) -> None:
        import torch

        t = torch.from_numpy(tensor) if isinstance(tensor, np.ndarray) else tensor.detach()
        self.pages = t.reshape(-1).view(torch.uint8).reshape(region.num_pages, region.page_bytes)
        self.stream = torch.cuda.Stream(self.pages.device) if self.pages.is_cuda else None
        self.pin = torch.cuda.is_available()  # pinned buffers let CUDA copy asynchronously
        self.keep_bytes = keep_bytes
        self.allocations = 0
        self._free: list[torch.Tensor] = []

    @property
    def kept_bytes(self) -> int:
        """Bytes of free staging buffers kept for reuse."""
        return sum(b.numel() for b in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes` bytes, reused where one is free."""
        import torch

        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Keep `buf` for reuse, dropping the smallest free buffers past `keep_bytes`."""
        self._free.append(buf)
        self._free.sort(key=lambda b: b.numel())
        while self._free and self.kept_bytes > self.keep_bytes:
            self._free.pop(0)

    @staticmethod
    def views(buf: torch.Tensor, nbytes: int) -> list[memoryview]:
        """The first `nbytes` of `buf`, for the socket."""
        return [memoryview(buf[:nbytes].numpy())]

    async def scatter(self, buf: torch.Tensor, idx: np.ndarray, span: Span | None) -> None:
        """Copy the staging rows into pages `idx`; returns once they are in the region."""
        await self._copy(buf, idx, span, to_region=True)

    async def gather(self, buf: torch.Tensor, idx: np.ndarray, span: Span | None) -> None:
        """Copy pages `idx` into the staging rows, in order; returns once they are there."""
        await self._copy(buf, idx, span, to_region=False)

    async def _copy(self, buf: torch.Tensor, idx: np.ndarray, span: Span | None, *, to_region: bool) -> None:
        """One copy per run of consecutive pages: whole pages need no device scratch memory (an
        L1 pool fills its GPU), and a span's strided copy, which torch makes through a scratch
        copy, is cut into pieces of at most `SPAN_SCRATCH_BYTES`. On CUDA it waits for the copies
        even if cancelled meanwhile: until they completed, the staging buffer must not be reused."""
        width = span.length if span is not None else self.pages.shape[1]
        pages = self.pages if span is None else self.pages[:, span.offset : span.offset + width]
        rows = buf[: len(idx) * width].view(len(idx), width)
        most = len(idx) if span is None else max(1, SPAN_SCRATCH_BYTES // width)
        pairs = [(pages[p : p + n], rows[r : r + n]) for p, r, n in _runs(idx, most)]
        if not to_region:
            pairs = [(dst, src) for src, dst in pairs]
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        import torch

        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(self.stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
        finally:
            done.record(self.stream)
            await _completed(done)


async def _completed(event: torch.cuda.Event) -> None:
    """Wait until `event` completed without blocking the event loop; shielded from cancellation
    (memory a copy still uses must not be reused). Polls with a backoff of up to 1 ms."""
    delay = 0.0
    with trio.CancelScope(shield=True):
        while not event.query():
            await trio.sleep(delay)
            delay = min(max(2 * delay, 20e-6), 1e-3)


def _runs(idx: np.ndarray, most: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive pages in `idx`, each at most `most` long: `(first page, its position
    in idx, length)`."""
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    out = []
    for s, e in zip([0, *breaks.tolist()], [*breaks.tolist(), len(idx)], strict=True):
        out += [(int(idx[a]), a, min(most, e - a)) for a in range(s, e, most)]
    return out


async def error_text(conn: Conn, f: Frame) -> str:
    """The text of an ERROR frame `f` (its notif field)."""
    raw = await conn.recv_exactly(f.notif_len)
    return raw.decode("utf-8", errors="replace")
