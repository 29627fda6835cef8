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
type carries none. Pages move straight between the socket and page memory (`sendmsg` /
`recvmsg_into` over memoryviews of the pages, `Region.views`): no staging copy, and each syscall
moves at most what the socket buffer holds, so the event loop never stalls long.
"""

from __future__ import annotations

import enum
import select
import struct
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
    """A registered page pool: its region, the tensor, and its pages as bytes for the socket."""

    region: MemoryRegion
    tensor: torch.Tensor | np.ndarray
    pages: np.ndarray  # uint8 [num_pages, page_bytes] sharing the tensor's memory
    descs: DescList

    def views(self, idx: np.ndarray, span: Span | None = None) -> list[memoryview]:
        """Views of pages `idx` (of bytes `span` of each, if given), in that order."""
        pages = self.pages
        if span is None:
            return [memoryview(pages[i]) for i in idx.tolist()]
        lo, hi = span.offset, span.offset + span.length
        return [memoryview(pages[i, lo:hi]) for i in idx.tolist()]


async def error_text(conn: Conn, f: Frame) -> str:
    """The text of an ERROR frame `f` (its notif field)."""
    raw = await conn.recv_exactly(f.notif_len)
    return raw.decode("utf-8", errors="replace")
