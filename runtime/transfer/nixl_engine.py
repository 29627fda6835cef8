"""A transfer engine on NIXL (`nixl._api.nixl_agent`, UCX backend): RDMA where there is a NIC.

Each region is registered once and prepared once as a list of one descriptor per page
(`prep_xfer_dlist`); a request selects pages by index (`make_prepped_xfer`), exactly NIXL's
prepped-transfer flow. Metadata travels in `local_info()` (the agent metadata plus our region
descriptors), so no NIXL listener thread is needed.

Threads. On some UCX paths (`cma`, process_vm_writev between processes on one host) `transfer()`
copies inline before it returns, so every post runs on a worker thread (`trio.to_thread`, one at
a time per engine). All other agent calls (notifications, state polls, releases) run on the event
loop. A lock makes sure no two agent calls overlap (without a progress thread the UCX worker takes
one caller at a time); the poller never waits for it, it skips a round while a post holds it, and only
`register()`/`local_info()`, setup calls, may wait for a post in flight.

Progress. The agent runs without NIXL's progress thread (`progress_thread=False` by default).
Measured on a 2-core host, UCX DRAM->DRAM: in one process, 64 MiB as 256 x 256 KiB pages moved at
2.3-3.7 GB/s without it and 1.0-1.3 GB/s with it; between two processes (bench/transfer_bench.py,
64 x 256 KiB) 4-5 GB/s without it and 1.0-1.4 GB/s with it: the thread competes for the cores.
Its benefit, progress while nobody polls, is provided here by the engine's poller task, which calls
`get_new_notifs()` (progressing the UCX worker) and `check_xfer_state()` of transfers in flight,
backing off from `min_poll_s` to `max_poll_s` while idle. Both sides must be progressed: the target
to accept data and the initiator to push the notification out after its transfer is done.

`nixl` is imported when an engine is constructed, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, Self

import attrs
import numpy as np
import trio

from hicache.runtime.transfer.base import (
    MAX_NAME_BYTES,
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
    open_request,
    tensor_geometry,
)

log = logging.getLogger(__name__)

NIXL_REQUIREMENT = "nixl==1.5.1"


def _import_nixl() -> Any:
    try:
        import nixl._api as api
    except ImportError as e:
        raise ImportError(
            f"NixlEngine needs the nixl package (pip install {NIXL_REQUIREMENT}); importing it failed: {e}"
        ) from e
    # NIXL logs every backend instantiation at INFO and plugin parameter problems as warnings.
    logging.getLogger("nixl").setLevel(logging.ERROR)
    return api


@attrs.define(eq=False)
class _Region:
    region: MemoryRegion
    tensor: Any
    reg_descs: Any
    descs: DescList
    prepped: Any
    spans: dict[tuple[int, int], Any] = attrs.field(factory=dict)  # (offset, length) -> prepped


@attrs.define(eq=False)
class _Peer:
    info: PeerInfo
    prepped: dict[str, Any] = attrs.field(factory=dict)
    spans: dict[tuple[str, int, int], Any] = attrs.field(factory=dict)  # (region, offset, length)


@attrs.define(eq=False)
class _Posted:
    """A NIXL request of ours: its handle once created, and whether it may be released."""

    handle: Any = None
    polling: bool = False
    abandoned: bool = False
    gone: trio.Event = attrs.field(factory=trio.Event)  # set once NIXL can no longer move its bytes


class NixlEngine:
    """NIXL transfer engine; use as `async with NixlEngine(name) as engine:`.

    `name` is the NIXL agent name (unique among peers). `port > 0` also starts NIXL's metadata
    listener on that port for peers that use `fetch_remote_metadata`; with `port=0` (default)
    metadata travels only in `local_info()`. Register every region before calling
    `local_info()`: NIXL metadata includes the registrations.
    """

    kind = "nixl"  # how peers name this engine (`hicache.runtime.wire.compat`)

    def __init__(
        self,
        name: str,
        port: int = 0,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
        min_poll_s: float = 1e-4,
        max_poll_s: float = 2e-3,
    ) -> None:
        if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"name: expected 1..{MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
        if not 0 <= port < 65536:
            raise ValueError(f"port: expected 0..65535, got {port}")
        if not 0 < min_poll_s <= max_poll_s:
            raise ValueError(
                f"poll interval: expected 0 < min_poll_s <= max_poll_s, got {min_poll_s}, {max_poll_s}"
            )
        api = _import_nixl()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=port > 0,
            listen_port=port if port > 0 else api.DEFAULT_COMM_PORT,
            backends=list(backends),
        )
        self._name = name
        self._agent = api.nixl_agent(name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(
                f"{name}: NIXL backends {missing} are unavailable; plugins: {self._agent.plugin_list}"
            )
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(1)
        self._min_poll = min_poll_s
        self._max_poll = max_poll_s
        self._regions: dict[str, _Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._book = XferBook(name)
        self._posted: dict[int, _Posted] = {}
        self._to_release: list[tuple[Any, trio.Event]] = []
        self._notifs = NotifQueue()
        self._wake = trio.Event()
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._name

    # -- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._stack is not None or self._closed:
            raise RuntimeError(f"{self._name}: an engine starts once")
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._poll)
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._closed = True
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        try:
            await stack.__aexit__(*exc_info)
        finally:
            for rec in self._book.records():
                rec.finish(XferState.ERR, "engine closed")
            self._notifs.close()
            with self._lock:
                self._teardown()

    async def aclose(self) -> None:
        """Same as leaving `async with`; call it from the task that started the engine."""
        await self.__aexit__(None, None, None)

    def _teardown(self) -> None:
        """Give every NIXL object back; errors are logged, since there is nobody to raise to."""
        agent = self._agent
        steps: list[tuple[str, Any]] = []
        steps += [
            ("release transfer", p.handle.release) for p in self._posted.values() if p.handle is not None
        ]
        steps += [("release transfer", h.release) for h, _ in self._to_release]
        for peer_name, peer in self._peers.items():
            steps += [("release remote descriptors", h.release) for h in peer.prepped.values()]
            steps += [("release remote span descriptors", h.release) for h in peer.spans.values()]
            steps.append(("remove peer", lambda n=peer_name: agent.remove_remote_agent(n)))
        for reg in self._regions.values():
            steps.append(("release local descriptors", reg.prepped.release))
            steps += [("release local span descriptors", h.release) for h in reg.spans.values()]
            steps.append(("deregister", lambda r=reg.reg_descs: agent.deregister_memory(r)))
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - teardown keeps going
                log.warning("%s: %s failed: %r", self._name, what, e)
        for p in self._posted.values():
            p.gone.set()
        for _, gone in self._to_release:
            gone.set()
        self._posted.clear()
        self._to_release.clear()
        self._peers.clear()

    def _started(self) -> trio.Nursery:
        if self._nursery is None or self._closed:
            raise RuntimeError(f"{self._name}: not running (use `async with engine:`)")
        return self._nursery

    # -- regions and peers ---------------------------------------------------------------------

    def register(self, name: str, tensor: Any) -> MemoryRegion:
        """Register a page pool `[num_pages, ...]` and prepare its descriptors.

        Takes a torch tensor (host or GPU) or a numpy array (host).
        """
        if not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(f"region name: expected 1..{MAX_NAME_BYTES} UTF-8 bytes, got {name!r}")
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered with {self._name}")
        num_pages, page_bytes = tensor_geometry(name, tensor)
        if isinstance(tensor, np.ndarray):
            region = MemoryRegion(name, tensor.ctypes.data, page_bytes, num_pages)
            to_register: Any = [(region.base, region.nbytes, 0, "")]
        else:
            gpu = tensor.device.type == "cuda"
            mem, dev = ("VRAM", tensor.get_device()) if gpu else ("DRAM", 0)
            region = MemoryRegion(name, tensor.data_ptr(), page_bytes, num_pages, mem, dev)
            to_register = tensor
        descs = DescList.for_region(region)
        with self._lock:
            reg_descs = self._agent.register_memory(to_register, region.mem_type)
            try:
                prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs.as_array(), region.mem_type)
            except BaseException:
                self._agent.deregister_memory(reg_descs)
                raise
        self._regions[name] = _Region(region, tensor, reg_descs, descs, prepped)
        return region

    def prepare(self, region: MemoryRegion) -> DescList:
        return self._local(region).descs

    def _local(self, region: MemoryRegion) -> _Region:
        reg = self._regions.get(region.name)
        if reg is None or reg.region != region:
            raise ValueError(f"region {region.name!r} is not registered with {self._name}")
        return reg

    def local_info(self) -> bytes:
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        regions = tuple(r.region for r in self._regions.values())
        return PeerInfo(self.kind, self._name, {"nixl_md": bytes(metadata)}, regions).encode()

    async def add_peer(self, info: bytes) -> str:
        """Load a peer's NIXL metadata and prepare its regions' descriptors. Adding a known peer
        again with the same metadata updates its regions; with other metadata (another agent
        claiming the name) it raises `ValueError`: a known engine name cannot be rebound."""
        peer = PeerInfo.decode(info)
        if peer.kind != self.kind:
            raise ValueError(
                f"peer info is for a {peer.kind!r} engine; {self._name} is a {self.kind!r} engine"
            )
        if "nixl_md" not in peer.fields:
            raise ValueError(f"peer info of {peer.name!r}: missing field 'nixl_md'")
        old = self._peers.get(peer.name)
        if old is not None and old.info.fields["nixl_md"] != peer.fields["nixl_md"]:
            raise ValueError(
                f"{self._name}: engine name {peer.name!r} is already bound to other NIXL metadata; "
                "refusing to rebind it (a known engine name cannot be rebound)"
            )
        prepped = await trio.to_thread.run_sync(self._add_peer_sync, peer, limiter=self._limiter)
        self._peers[peer.name] = _Peer(peer, prepped)
        return peer.name

    def remove_peer(self, name: str) -> None:
        """Forget peer `name` (an unknown name is a no-op): release its prepared descriptors and
        unload its NIXL metadata; posting to it raises until it is added again. Failures are
        logged, as in teardown."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        with self._lock:
            steps = [
                ("release remote descriptors", h.release)
                for h in [*peer.prepped.values(), *peer.spans.values()]
            ]
            steps.append(("remove peer", lambda: self._agent.remove_remote_agent(name)))
            for what, step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - the peer is forgotten either way
                    log.warning("%s: %s %r failed: %r", self._name, what, name, e)

    def _add_peer_sync(self, peer: PeerInfo) -> dict[str, Any]:
        with self._lock:
            old = self._peers.pop(peer.name, None)
            if old is not None:
                for h in [*old.prepped.values(), *old.spans.values()]:
                    h.release()
            loaded = self._agent.add_remote_agent(peer.fields["nixl_md"])
            loaded = loaded.decode("utf-8") if isinstance(loaded, bytes) else str(loaded)
            if loaded != peer.name:
                raise ValueError(f"peer info names {peer.name!r} but its NIXL metadata is agent {loaded!r}")
            return {
                r.name: self._agent.prep_xfer_dlist(peer.name, DescList.for_region(r).as_array(), r.mem_type)
                for r in peer.regions
            }

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
        local_h, remote_h = reg.prepped, p.prepped[remote_region]
        if span is not None:  # descriptors of that part of every page, prepared once per span
            local_h, remote_h = await trio.to_thread.run_sync(
                self._span_dlists, reg, p, remote_region, span, limiter=self._limiter
            )
        posted = self._posted[rec.handle.xid] = _Posted()
        # One-sided: a part that is not the last carries no notification (the initiator's
        # `settle` is what stops a WRITE here, not a fence on the target).
        args = (
            op,
            local_h,
            lp.astype(np.int32),
            remote_h,
            rp.astype(np.int32),
            bytes(notif) if final else b"",
        )
        nursery.start_soon(self._drive, rec, posted, peer, args)
        await trio.lowlevel.checkpoint()
        return rec.handle

    async def _drive(self, rec: XferRecord, posted: _Posted, peer: str, args: tuple[Any, ...]) -> None:
        op, local_h, lp, remote_h, rp, notif = args
        try:
            if len(lp) == 0:
                # NIXL rejects empty requests; the notification alone keeps the contract.
                if notif:
                    await trio.to_thread.run_sync(self._send_notif_sync, peer, notif, limiter=self._limiter)
                status = "DONE"
            else:
                status = await trio.to_thread.run_sync(
                    self._post_sync, posted, op, local_h, lp, remote_h, rp, notif, limiter=self._limiter
                )
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            rec.finish(XferState.ERR, f"post failed: {e!r}")
            self._retire(rec.handle.xid)
            return
        if status == "PROC" and not posted.abandoned:
            posted.polling = True
            self._wake.set()
            return
        rec.finish(XferState(status), None if status == "DONE" else "NIXL reported ERR at post")
        self._retire(rec.handle.xid)

    def _span_dlists(self, reg: _Region, peer: _Peer, remote_region: str, span: Span) -> tuple[Any, Any]:
        """Prepared descriptors of bytes [offset, offset + length) of every page, on both sides."""
        with self._lock:
            key = (span.offset, span.length)
            local = reg.spans.get(key)
            if local is None:
                rows = _span_rows(reg.descs.as_array(), span)
                local = reg.spans[key] = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", rows, reg.region.mem_type
                )
            remote = peer.spans.get((remote_region, *key))
            if remote is None:
                r = peer.info.region(remote_region)
                rows = _span_rows(DescList.for_region(r).as_array(), span)
                remote = peer.spans[(remote_region, *key)] = self._agent.prep_xfer_dlist(
                    peer.info.name, rows, r.mem_type
                )
            return local, remote

    def _post_sync(
        self,
        posted: _Posted,
        op: str,
        local_h: Any,
        lp: np.ndarray,
        remote_h: Any,
        rp: np.ndarray,
        notif: bytes,
    ) -> str:
        with self._lock:
            posted.handle = self._agent.make_prepped_xfer(op, local_h, lp, remote_h, rp, notif)
            return self._agent.transfer(posted.handle)

    def _send_notif_sync(self, peer: str, notif: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer, notif)

    def _retire(self, xid: int) -> None:
        """The NIXL request is finished (or dead): its handle may go once nobody needs it."""
        posted = self._posted.pop(xid, None)
        if posted is None:
            return
        if posted.handle is not None:
            self._to_release.append((posted.handle, posted.gone))
            posted.handle = None
        else:
            posted.gone.set()

    async def _poll(self) -> None:
        """Progress the agent: collect notifications, finish transfers in flight, release handles."""
        delay = self._min_poll
        while True:
            busy = False
            if self._lock.acquire(blocking=False):
                try:
                    busy = self._poll_once()
                finally:
                    self._lock.release()
            else:
                busy = True  # a post is running; look again soon
            in_flight = any(p.polling for p in self._posted.values())
            delay = self._min_poll if busy or in_flight else min(delay * 2, self._max_poll)
            self._wake = trio.Event()
            with trio.move_on_after(delay):
                await self._wake.wait()

    def _poll_once(self) -> bool:
        agent = self._agent
        busy = False
        for peer, msgs in agent.get_new_notifs().items():
            for msg in msgs:
                self._notifs.put(peer, msg)
                busy = True
        for xid, posted in list(self._posted.items()):
            if not posted.polling:
                continue
            status = agent.check_xfer_state(posted.handle)
            if status != "PROC":
                busy = True
                rec = self._book.by_xid(xid)
                if rec is not None:
                    rec.finish(XferState(status), None if status == "DONE" else "NIXL reported ERR")
                self._retire(xid)
        while self._to_release:
            handle, gone = self._to_release.pop()
            try:
                handle.release()
            except Exception as e:  # noqa: BLE001 - an aborted transfer may refuse; nothing to do
                log.warning("%s: releasing a transfer failed: %r", self._name, e)
            gone.set()
        return busy

    def state(self, handle: XferHandle) -> XferState:
        return self._book.get(handle).state

    def reason(self, handle: XferHandle) -> str | None:
        """Why a transfer ended in ERR (None otherwise)."""
        return self._book.get(handle).reason

    async def wait(self, handle: XferHandle, *, timeout: float) -> XferState:
        """`DONE` or `ERR`; raises `TransferTimeout` if still in flight after `timeout` seconds."""
        return await self._book.wait(handle, timeout)

    def release(self, handle: XferHandle) -> None:
        """Forget a transfer; NIXL aborts one still in flight when its handle is released."""
        rec = self._book.pop(handle)
        rec.finish(XferState.ERR, "released while in flight")
        posted = self._posted.get(handle.xid)
        if posted is None:
            return
        posted.abandoned = True
        posted.polling = False
        if posted.handle is not None:
            # The poller releases it under the agent lock, i.e. never while a post still uses it.
            self._retire(handle.xid)
            self._wake.set()
        # Otherwise the request is not created yet: its driver retires it after the post.

    async def settle(self, handle: XferHandle) -> None:
        """Release `handle` and return once NIXL has released the request, i.e. aborted it if it
        was still in flight: the initiator's side of a fence, since a target cannot refuse
        one-sided writes."""
        posted = self._posted.get(handle.xid)
        self.release(handle)
        if posted is not None:
            await posted.gone.wait()

    async def fence(self, notif: bytes) -> bool:
        """False: a target cannot stop one-sided writes; the initiator must `settle` them."""
        if not notif:
            raise ValueError("fence: expected the non-empty notification the transfer carries")
        await trio.lowlevel.checkpoint()
        return False

    async def next_notif(self) -> tuple[str, bytes]:
        return await self._notifs.next()

    def notifs(self) -> list[tuple[str, bytes]]:
        return self._notifs.drain()


def _span_rows(rows: np.ndarray, span: Span) -> np.ndarray:
    """Per-page descriptor rows `(address, length, device)` narrowed to `span` of each page."""
    out = rows.copy()
    out[:, 0] += np.uint64(span.offset)
    out[:, 1] = np.uint64(span.length)
    return out
