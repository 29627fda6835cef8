"""The transfer-engine interface shared by the TCP and NIXL engines, and the pieces both use.

The shape follows NIXL: a node registers its page pools once, describes each pool as a list of
one descriptor per page (prepared once), and per request selects pages from the local and the
remote list by index. A transfer is posted, polled (`DONE`/`PROC`/`ERR`) and released; the target
learns that the data arrived from a notification message delivered after the last byte.

`local_info()` bytes are everything a peer needs to reach this engine. They use a small
self-describing, length-checked and checksummed encoding (never pickle), because they cross
process and trust boundaries.
"""

from __future__ import annotations

import enum
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, runtime_checkable

import attrs
import numpy as np
import trio

if TYPE_CHECKING:
    import torch

Op = Literal["WRITE", "READ"]
OPS: tuple[str, ...] = ("WRITE", "READ")
MAX_NOTIF_BYTES = 1 << 16
MAX_NAME_BYTES = 1024


class XferState(enum.StrEnum):
    """The state of a posted transfer; the values are NIXL's `check_xfer_state` strings."""

    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


class TransferTimeout(TimeoutError):
    """`wait` ran out of time while the transfer was still in flight (its handle stays valid)."""


@attrs.frozen
class MemoryRegion:
    """A registered page pool: `num_pages` pages of `page_bytes` bytes starting at `base`.

    `base` is the address of page 0 in the owner's process (NIXL) or 0 where the engine addresses
    memory by region name only (TCP). Peers learn regions from `local_info()`.
    """

    name: str
    base: int
    page_bytes: int
    num_pages: int
    mem_type: str = "DRAM"
    device: int = 0

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages


@attrs.frozen
class Desc:
    """One descriptor: `length` bytes at `offset` from the start of `region`."""

    region: MemoryRegion
    offset: int
    length: int


@attrs.frozen
class DescList:
    """One descriptor per page of a region, prepared once; requests select pages by index."""

    region: MemoryRegion
    offsets: np.ndarray = attrs.field(eq=False, repr=False)

    @classmethod
    def for_region(cls, region: MemoryRegion) -> DescList:
        offsets = np.arange(region.num_pages, dtype=np.uint64) * np.uint64(region.page_bytes)
        offsets.setflags(write=False)
        return cls(region, offsets)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, page: int) -> Desc:
        return Desc(self.region, int(self.offsets[page]), self.region.page_bytes)

    def as_array(self) -> np.ndarray:
        """NIXL's Nx3 layout: one row `(address, length, device)` per page."""
        rows = np.empty((len(self.offsets), 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(self.region.base) + self.offsets
        rows[:, 1] = self.region.page_bytes
        rows[:, 2] = self.region.device
        return rows


@attrs.frozen
class XferHandle:
    """Names one posted transfer; the engine that posted it holds its state."""

    xid: int
    op: str
    peer: str
    num_pages: int
    nbytes: int


# ---------------------------------------------------------------------------------------------
# Validation


def tensor_geometry(name: str, tensor: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """`(num_pages, page_bytes)` of a pool whose first dimension indexes pages.

    Takes a torch tensor or a numpy array (processes that move host memory need no torch).
    """
    if isinstance(tensor, np.ndarray):
        shape, contiguous, nbytes = tensor.shape, tensor.flags.c_contiguous, tensor.nbytes
    else:
        shape, contiguous = tuple(tensor.shape), tensor.is_contiguous()
        nbytes = tensor.numel() * tensor.element_size()
    if len(shape) < 1 or shape[0] < 1:
        raise ValueError(f"region {name!r}: expected a pool [num_pages, ...], got shape {tuple(shape)}")
    if not contiguous:
        raise ValueError(f"region {name!r}: the pool must be contiguous (pages are byte ranges)")
    num_pages = int(shape[0])
    page_bytes = nbytes // num_pages
    if page_bytes < 1:
        raise ValueError(f"region {name!r}: pages of {page_bytes} bytes; expected at least 1")
    return num_pages, page_bytes


def host_pages(name: str, tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """A writable uint8 `[num_pages, page_bytes]` numpy view of a host pool's memory."""
    num_pages, page_bytes = tensor_geometry(name, tensor)
    if isinstance(tensor, np.ndarray):
        arr = tensor
    else:
        if tensor.device.type != "cpu":
            raise ValueError(f"region {name!r}: expected host memory, got a {tensor.device} tensor")
        import torch

        arr = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    if not arr.flags.writeable:
        raise ValueError(f"region {name!r}: the array is read-only")
    return arr.reshape(-1).view(np.uint8).reshape(num_pages, page_bytes)


def page_array(pages: Sequence[int] | np.ndarray, region: MemoryRegion, what: str) -> np.ndarray:
    """Page indices as an int64 array, each checked to lie in `[0, region.num_pages)`."""
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(
            f"{what} pages: expected a 1-D sequence of integers, got {arr.dtype} shape {arr.shape}"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= region.num_pages))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{what} pages: index {i} is page {int(arr[i])}, outside region {region.name!r} "
            f"of {region.num_pages} pages ({bad.size} out of range)"
        )
    return arr


@attrs.frozen
class Span:
    """Bytes [offset, offset + length) of every page of a WRITE: one layer group's share of a
    page (a page holds its layers one after another), so KV can leave as prefill computes it."""

    offset: int
    length: int

    def check(self, page_bytes: int) -> None:
        if not (self.offset >= 0 and self.length > 0 and self.offset + self.length <= page_bytes):
            raise ValueError(
                f"span: expected 0 <= offset and 0 < length with offset + length <= the page's "
                f"{page_bytes} bytes, got offset {self.offset}, length {self.length}"
            )


def open_request(
    engine: str,
    peers: Mapping[str, Any],
    book: XferBook,
    op: str,
    local: MemoryRegion,
    local_pages: Sequence[int] | np.ndarray,
    peer: str,
    remote_region: str,
    remote_pages: Sequence[int] | np.ndarray,
    notif: bytes,
) -> tuple[Any, np.ndarray, np.ndarray, XferRecord]:
    """What every engine's `post` does first: find the peer and its region, validate the request
    and open its record. Returns (the peer entry, local pages, remote pages, the record)."""
    p = peers.get(peer)
    if p is None:
        raise ValueError(f"{engine}: unknown peer {peer!r}; known peers {sorted(peers)}")
    remote = p.info.region(remote_region)
    lp, rp = check_request(op, local, local_pages, remote, remote_pages, notif)
    return p, lp, rp, book.new(op, peer, len(lp), len(lp) * local.page_bytes)


def check_request(
    op: str,
    local: MemoryRegion,
    local_pages: Sequence[int] | np.ndarray,
    remote: MemoryRegion,
    remote_pages: Sequence[int] | np.ndarray,
    notif: bytes,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a request before anything is sent; returns both page arrays.

    The destination pages (remote for WRITE, local for READ) must be distinct: two source pages
    landing on one destination page would leave it holding either.
    """
    if op not in OPS:
        raise ValueError(f"op: expected 'WRITE' or 'READ', got {op!r}")
    if local.page_bytes != remote.page_bytes:
        raise ValueError(
            f"page_bytes differ: local region {local.name!r} has {local.page_bytes}, "
            f"remote region {remote.name!r} has {remote.page_bytes}"
        )
    lp = page_array(local_pages, local, "local")
    rp = page_array(remote_pages, remote, "remote")
    if len(lp) != len(rp):
        raise ValueError(f"page lists differ in length: {len(lp)} local pages, {len(rp)} remote pages")
    dst, side = (rp, "remote") if op == "WRITE" else (lp, "local")
    if len(np.unique(dst)) != len(dst):
        raise ValueError(f"{op}: the destination ({side}) pages repeat a page; expected distinct pages")
    if not isinstance(notif, bytes | bytearray | memoryview):
        raise ValueError(f"notif: expected bytes, got {type(notif).__name__}")
    if len(notif) > MAX_NOTIF_BYTES:
        raise ValueError(f"notif: {len(notif)} bytes, at most {MAX_NOTIF_BYTES} allowed")
    return lp, rp


# ---------------------------------------------------------------------------------------------
# Peer info encoding

INFO_MAGIC = b"HCXI"
INFO_VERSION = 1
_INFO_HEAD = struct.Struct("<4sBII")  # magic, version, body length, crc32 of the body


@attrs.frozen
class PeerInfo:
    """What `local_info()` carries: the engine kind and name, engine fields, and the regions."""

    kind: str
    name: str
    fields: dict[str, bytes] = attrs.field(factory=dict)
    regions: tuple[MemoryRegion, ...] = ()

    def region(self, name: str) -> MemoryRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise ValueError(
            f"peer {self.name!r} has no region {name!r}; it has {[r.name for r in self.regions]}"
        )

    def encode(self) -> bytes:
        body = bytearray()
        _put_str(body, self.kind, 1)
        _put_str(body, self.name, 2)
        body += struct.pack("<H", len(self.fields))
        for key, value in self.fields.items():
            _put_str(body, key, 1)
            body += struct.pack("<I", len(value)) + bytes(value)
        body += struct.pack("<I", len(self.regions))
        for r in self.regions:
            _put_str(body, r.name, 2)
            body += struct.pack("<QQQ", r.base, r.page_bytes, r.num_pages)
            _put_str(body, r.mem_type, 1)
            body += struct.pack("<i", r.device)
        return _INFO_HEAD.pack(INFO_MAGIC, INFO_VERSION, len(body), zlib.crc32(body)) + bytes(body)

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        data = bytes(data)
        if len(data) < _INFO_HEAD.size:
            raise ValueError(f"peer info: {len(data)} bytes, shorter than its {_INFO_HEAD.size}-byte header")
        magic, version, length, crc = _INFO_HEAD.unpack_from(data)
        if magic != INFO_MAGIC:
            raise ValueError(f"peer info: magic {magic!r}, expected {INFO_MAGIC!r}")
        if version != INFO_VERSION:
            raise ValueError(f"peer info: version {version}, expected {INFO_VERSION}")
        body = data[_INFO_HEAD.size :]
        if len(body) != length:
            raise ValueError(f"peer info: header says {length} body bytes, got {len(body)}")
        if zlib.crc32(body) != crc:
            raise ValueError("peer info: checksum mismatch (corrupted or truncated)")
        rd = _Reader(body)
        kind = rd.str(1, "kind")
        name = rd.str(2, "name")
        fields: dict[str, bytes] = {}
        for _ in range(rd.unpack("<H", "field count")[0]):
            key = rd.str(1, "field name")
            fields[key] = rd.take(rd.unpack("<I", f"field {key!r} length")[0], f"field {key!r}")
        regions = []
        for i in range(rd.unpack("<I", "region count")[0]):
            rname = rd.str(2, f"region {i} name")
            base, page_bytes, num_pages = rd.unpack("<QQQ", f"region {rname!r} geometry")
            mem_type = rd.str(1, f"region {rname!r} mem_type")
            (device,) = rd.unpack("<i", f"region {rname!r} device")
            if page_bytes < 1 or num_pages < 1:
                raise ValueError(f"peer info: region {rname!r} has {num_pages} pages of {page_bytes} bytes")
            regions.append(MemoryRegion(rname, base, page_bytes, num_pages, mem_type, device))
        if rd.pos != len(body):
            raise ValueError(f"peer info: {len(body) - rd.pos} trailing bytes after the last region")
        return cls(kind, name, fields, tuple(regions))


def _put_str(buf: bytearray, text: str, width: int) -> None:
    raw = text.encode("utf-8")
    limit = (1 << (8 * width)) - 1
    if len(raw) > limit:
        raise ValueError(f"peer info: {text[:40]!r}... is {len(raw)} bytes, at most {limit}")
    buf += len(raw).to_bytes(width, "little") + raw


class _Reader:
    """Reads fields off a byte string, refusing to read past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        left = len(self.data) - self.pos
        if n > left:
            raise ValueError(f"peer info: {what} needs {n} bytes at offset {self.pos}, only {left} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def str(self, width: int, what: str) -> str:
        n = int.from_bytes(self.take(width, f"{what} length"), "little")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"peer info: {what} is not UTF-8 ({e})") from None


# ---------------------------------------------------------------------------------------------
# Bookkeeping shared by the engines


@attrs.define(eq=False)
class XferRecord:
    """The engine-side state of one transfer; `done` is set once it leaves PROC."""

    handle: XferHandle
    state: XferState = XferState.PROC
    reason: str | None = None
    done: trio.Event = attrs.field(factory=trio.Event)

    def finish(self, state: XferState, reason: str | None = None) -> None:
        if self.state is XferState.PROC:
            self.state = state
            self.reason = reason
            self.done.set()


class XferBook:
    """The transfers an engine has posted and not yet released."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._next = 1
        self._records: dict[int, XferRecord] = {}

    def new(self, op: str, peer: str, num_pages: int, nbytes: int) -> XferRecord:
        handle = XferHandle(self._next, op, peer, num_pages, nbytes)
        self._next += 1
        rec = XferRecord(handle)
        self._records[handle.xid] = rec
        return rec

    def get(self, handle: XferHandle) -> XferRecord:
        rec = self._records.get(handle.xid)
        if rec is None or rec.handle != handle:
            raise ValueError(f"{self.engine}: transfer {handle.xid} is unknown or already released")
        return rec

    def by_xid(self, xid: int) -> XferRecord | None:
        return self._records.get(xid)

    def pop(self, handle: XferHandle) -> XferRecord:
        rec = self.get(handle)
        del self._records[handle.xid]
        return rec

    def records(self) -> list[XferRecord]:
        return list(self._records.values())

    async def wait(self, handle: XferHandle, timeout: float) -> XferState:
        rec = self.get(handle)
        with trio.move_on_after(timeout):
            await rec.done.wait()
        if rec.state is XferState.PROC:
            raise TransferTimeout(
                f"{self.engine}: transfer {handle.xid} ({handle.op} of {handle.num_pages} pages to "
                f"{handle.peer!r}) still in flight after {timeout} s"
            )
        return rec.state


class NotifQueue:
    """Notifications that arrived, in arrival order, each `(peer name, message)`."""

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[tuple[str, bytes]](math.inf)

    def put(self, peer: str, msg: bytes) -> None:
        self._send.send_nowait((peer, bytes(msg)))

    async def next(self) -> tuple[str, bytes]:
        return await self._recv.receive()

    def drain(self) -> list[tuple[str, bytes]]:
        out = []
        while True:
            try:
                out.append(self._recv.receive_nowait())
            except trio.WouldBlock:
                return out

    def close(self) -> None:
        self._send.close()


# ---------------------------------------------------------------------------------------------
# The interface


@runtime_checkable
class TransferEngine(Protocol):
    """Moves pages between registered pools of two nodes; used as `async with engine:`.

    `post` validates everything it can before sending (`ValueError` naming the numbers);
    `wait(handle, timeout=...)` returns `DONE` or `ERR`, or raises `TransferTimeout` when the
    transfer is still in flight at the deadline (the handle stays valid: wait again or release
    it). A notification is delivered to the *remote* side after the transfer's data (WRITE: the
    pages are written there; READ: the initiator has them); an empty `notif` sends none.

    Giving up on a WRITE takes a fence, or its late bytes could land in pages handed on to
    something else: the initiator's `settle(handle)` returns once it moves nothing more of it,
    and the target's `fence(notif)` returns True once no more of a WRITE carrying `notif` can
    land, or False if the target cannot stop writes by itself (one-sided RDMA: only the
    initiator's `settle` stops them).

    `add_peer(info)` introduces a peer (its name, address and regions): only then may transfers
    be posted to it, and (TCP) may it connect. `remove_peer(name)` forgets it again (an unknown
    name is a no-op), e.g. once the control connection that introduced it has ended.
    """

    @property
    def name(self) -> str: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def aclose(self) -> None: ...

    def register(self, name: str, tensor: torch.Tensor) -> MemoryRegion: ...

    def prepare(self, region: MemoryRegion) -> DescList: ...

    def local_info(self) -> bytes: ...

    async def add_peer(self, info: bytes) -> str: ...

    def remove_peer(self, name: str) -> None: ...

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
        """`span` (WRITE only): move just those bytes of each page. `final` False: `notif` tags
        the WRITE for `fence` but is not delivered — a transfer sent as several span WRITEs
        delivers its notification with the last one, posted once the others are done."""
        ...

    def state(self, handle: XferHandle) -> XferState: ...

    def reason(self, handle: XferHandle) -> str | None: ...

    async def wait(self, handle: XferHandle, *, timeout: float) -> XferState: ...

    async def next_notif(self) -> tuple[str, bytes]: ...

    def notifs(self) -> list[tuple[str, bytes]]: ...

    def release(self, handle: XferHandle) -> None: ...

    async def settle(self, handle: XferHandle) -> None: ...

    async def fence(self, notif: bytes) -> bool: ...
