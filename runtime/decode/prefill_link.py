"""The decode node's control connection to its prefill node, and the notifications prefill's
WRITEs end with.

One connection at a time: opened at start and, once lost, again by the next transfer's message,
at the address `PrefillAddress` gives then (a prefill node restarted elsewhere is found there).
It opens with a mutual challenge–response over the cluster secret and a hello that checks the two
nodes can work together (`hicache.runtime.wire.compat`). Each connection has a task reading its
answers and handing each to the transfer that waits for it (and each `progress` message, which
says prefill is still working on a transfer, to whoever `follow`s it); a connection that breaks
or says something unusable is dropped, which closes the waits of the transfers sent on it. The tasks run
under `run`, in the service's nursery.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.model.llama import TinyModel
from hicache.runtime.security import peer_auth
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire import compat, protocol
from hicache.runtime.wire.prefill_address import PrefillAddress

log = logging.getLogger("hicache.runtime.decode")

# What a broken or misbehaving control connection to prefill raises.
CONTROL_ERRORS = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.EndOfChannel,
    EOFError,
    OSError,
    protocol.ProtocolError,
)


class IncompatiblePeer(protocol.ProtocolError):
    """The prefill node cannot serve this decode node: another page size, layout, model, transfer
    engine or protocol (see `hicache.runtime.wire.compat`)."""


class PrefillLink:
    """The control connection to prefill, its answers by transfer, and the notifications."""

    def __init__(
        self,
        engine: TransferEngine,
        layout: KVLayout,
        model: TinyModel,
        secret: ClusterSecret,
        *,
        frame_timeout: float,
        shard: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.model = model
        self.secret = secret
        self.frame_timeout = frame_timeout
        self.shard = shard  # this rank's place in its TP group, for the hello's profile
        self.at = PrefillAddress(("", 0))
        self.generation = 0  # counts control connections opened
        self._stream: trio.SocketStream | None = None  # None: to be opened by the next transfer
        self._peer: str | None = None  # the prefill engine's name, once a hello named it
        self._lock = trio.Lock()
        self._sent: dict[int, int] = {}  # transfer -> the connection its message went out on
        self._unsent = trio.Event()  # set (and replaced) whenever a transfer leaves `_sent`
        self._replies: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._progress: dict[int, Callable[[dict[str, Any]], None]] = {}  # transfer -> hears its progress
        self.arrivals: dict[int, trio.Event] = {}  # transfer -> set by its notification
        send, self._readers = trio.open_memory_channel[tuple[Any, ...]](math.inf)
        self._new_reader = send

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the notification loop and each connection's answer reader until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._notif_loop)
            task_status.started()
            async for args in self._readers:
                nursery.start_soon(self._read_replies, *args)

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()

    async def connect(self) -> None:
        """Open the control connection (hello: each side learns the other's transfer engine)."""
        try:
            host, port = self.at.resolve()  # again each time: it may have moved
        except ValueError as exc:
            raise protocol.ProtocolError(f"no prefill address: {exc}") from None
        stream = await trio.open_tcp_stream(host, port)
        limit = self.frame_timeout
        try:
            reader = protocol.FrameReader(stream, max_binary=0, frame_timeout=limit)

            async def hear() -> dict[str, Any]:
                # A peer that accepts and then says nothing must not hold start-up or a transfer.
                with trio.move_on_after(limit):
                    return (await reader.receive())[0]
                raise protocol.ProtocolError(
                    f"the prefill node at {host}:{port} said nothing for {limit:g} s"
                )

            await peer_auth.initiate(
                self.secret, functools.partial(protocol.send, stream), hear, "the prefill node"
            )
            mine = compat.profile(self.layout, self.engine, self.model.full_config, shard=self.shard)
            hello = {"op": "hello", "info": self.engine.local_info().hex(), "profile": mine}
            await protocol.send(stream, hello)
            hello = await hear()
            if hello.get("op") == "error":
                raise IncompatiblePeer(f"the prefill node refused: {protocol.clip(str(hello.get('reason')))}")
            why = compat.mismatch(mine, hello.get("profile"), "the prefill node")
            if why is not None:
                raise IncompatiblePeer(why)
            info = protocol.field(hello, "info", str)
            try:
                name = await self.engine.add_peer(bytes.fromhex(info))
                if self._peer not in (None, name):  # a restarted prefill's old engine
                    self.engine.remove_peer(self._peer)
                self._peer = name
            except ValueError as exc:  # not hex, or info the engine cannot use
                raise protocol.ProtocolError(
                    f"prefill's hello: bad 'info': {protocol.clip(str(exc))}"
                ) from None
        except BaseException:
            await stream.aclose()
            raise
        self._stream = stream
        self.generation += 1
        self._new_reader.send_nowait((reader, stream, self.generation))

    def expect(self, tid: int, buffer: int = 1) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """Where prefill's answers about transfer `tid` arrive, until `forget(tid)`."""
        send, receive = trio.open_memory_channel[dict[str, Any]](buffer)
        self._replies[tid] = send
        return receive

    def follow(self, tid: int, heard: Callable[[dict[str, Any]], None]) -> None:
        """Call `heard(msg)` with each `progress` message prefill sends about transfer `tid`
        (prefill computed more of it, or it moved up prefill's queue), until `forget(tid)`."""
        self._progress[tid] = heard

    def forget(self, tid: int) -> None:
        """Transfer `tid` waits for no more answers."""
        self._unsend(tid)
        self._replies.pop(tid, None)
        self._progress.pop(tid, None)

    def _unsend(self, tid: int) -> None:
        if self._sent.pop(tid, None) is not None:
            self._unsent.set()
            self._unsent = trio.Event()

    async def send(self, tid: int, msg: dict[str, Any]) -> int:
        """Send `msg` about transfer `tid` to prefill (connecting first if needed); returns the
        connection it went out on, which answers it or, when it breaks, closes its wait."""
        async with self._lock:
            if self._stream is None:
                await self.connect()
            await protocol.send(self._stream, msg)  # type: ignore[arg-type]
            gen = self._sent[tid] = self.generation
        return gen

    async def cut(self, gen: int) -> None:
        """Close control connection `gen` as a dying peer would, at a point where no transfer
        sent on it is unanswered: no WRITE can land after its transfer is reported failed."""
        async with self._lock:  # nothing new goes out meanwhile
            while any(g == gen for g in self._sent.values()):
                await self._unsent.wait()
            if self._stream is not None and self.generation == gen:
                stream, self._stream = self._stream, None
                await stream.aclose()

    async def cancel(self, tid: int, timeout: float) -> bool:
        """Ask prefill to cancel transfer `tid`; True once it confirms that its WRITE settled."""
        receive = self.expect(tid, buffer=4)
        try:
            with trio.move_on_after(timeout):
                await self.send(tid, {"op": "cancel", "tid": tid})
                while True:
                    msg = await receive.receive()
                    if msg.get("op") in ("cancelled", "kv"):  # a late answer also comes after settling
                        return True
        except CONTROL_ERRORS:
            pass
        finally:
            self.forget(tid)
        return False

    async def _read_replies(self, reader: protocol.FrameReader, stream: trio.SocketStream, gen: int) -> None:
        """Hand prefill's answers to the transfers waiting for them; a connection that breaks or
        says something unusable is dropped (its transfers fail; the next one reconnects)."""
        while True:
            try:
                msg, _ = await reader.receive()
                tid = msg.get("tid")
                if msg["op"] == "goodbye":  # closed for being idle: nothing sent after it was read
                    log.info(
                        "control connection %d closed by prefill: %s",
                        gen,
                        protocol.clip(str(msg.get("reason"))),
                    )
                    raise EOFError
                if msg["op"] == "error" or type(tid) is not int:
                    why = msg.get("reason") if msg["op"] == "error" else "an answer without a 'tid'"
                    raise protocol.ProtocolError(
                        f"prefill said {protocol.show(msg['op'])}: {protocol.clip(str(why))}"
                    )
            except (
                EOFError,
                protocol.ProtocolError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
            ) as exc:
                if not isinstance(exc, EOFError):
                    log.warning(
                        "control connection %d to prefill dropped: %s", gen, exc or type(exc).__name__
                    )
                if self._stream is stream:
                    self._stream = None  # the next transfer opens a new connection
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
                for tid, g in list(self._sent.items()):
                    send = self._replies.get(tid)
                    if g == gen and send is not None:
                        send.close()
                return
            if msg["op"] == "progress":  # not an answer: the transfer is still in prefill's hands
                heard = self._progress.get(tid)
                if heard is not None:
                    heard(msg)
                continue
            if self._sent.get(tid) == gen:
                self._unsend(tid)
            send = self._replies.get(tid)
            if send is not None:
                try:
                    send.send_nowait(msg)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    log.warning("prefill answered transfer %d more often than asked; ignored", tid)

    async def _notif_loop(self) -> None:
        while True:
            try:
                _, msg = await self.engine.next_notif()
            except trio.EndOfChannel:
                return
            tid = msg[3:]
            if not (msg.startswith(b"kv:") and tid.isdigit() and len(tid) <= 20):
                log.warning("ignored a notification that names no transfer: %s", protocol.show(msg))
                continue
            arrived = self.arrivals.get(int(tid))
            if arrived is not None:  # else its transfer was given up on and fenced
                arrived.set()
