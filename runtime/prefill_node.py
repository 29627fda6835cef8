"""The prefill node: computes a prompt's KV with the model and writes the pages a decode node
asks for straight into that node's L1 pool over the transfer engine.

A decode node connects, says hello with its engine's `local_info()`, then sends
`kv` requests: tokens, the range [start, end) it lacks, and the L1 pages to write them to. The
prefill node computes (or reuses, for a fallback range of a prompt it just computed) the KV,
stages the pages, posts one WRITE with the notification `kv:<transfer>`, and answers with the
first output token and the digests of the pages it sent.

A decode node that gives up on a transfer sends `cancel` (on any of its connections): the
transfer is cancelled, its WRITE settled (`TransferEngine.settle`: nothing more of it moves),
and only then is `cancelled` answered, so the decode node may reuse the pages. Every reply, a
failure included, is likewise sent only after its WRITE settled. A request cancelled before
it arrived is refused when it does. When a control connection ends, the transfers it asked for
are cancelled the same way: their decode node stopped waiting for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import trio

from hicache.runtime import protocol
from hicache.runtime.kv_digest import page_digests
from hicache.runtime.kv_layout import KVLayout
from hicache.runtime.kv_pool import KVPool
from hicache.runtime.model import TinyModel, to_pages
from hicache.runtime.transfer.base import TransferEngine, XferState


class _PageAllocator:
    """Staging pages handed out per transfer; a transfer waits until enough are free."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))
        self.capacity = n
        self.changed = trio.Condition()

    async def take(self, n: int) -> list[int]:
        if n > self.capacity:
            raise ValueError(f"a transfer of {n} pages exceeds the staging pool of {self.capacity}")
        async with self.changed:
            while len(self.free) < n:
                await self.changed.wait()
            out = self.free[-n:] if n else []
            del self.free[len(self.free) - n :]
            return out

    async def give(self, pages: list[int]) -> None:
        async with self.changed:
            self.free.extend(pages)
            self.changed.notify_all()


SETTLE_TIMEOUT_S = 30.0  # how long a reply waits for its WRITE to settle before giving up on it
CANCELLED_MEMORY = 4096  # cancels of transfers not yet seen, remembered per node


@attrs.define(eq=False)
class _InFlight:
    """A `kv` request being served: `cancel` cancels `scope` and waits for `ended`."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: trio.Event = attrs.field(factory=trio.Event)


class PrefillNode:
    def __init__(
        self,
        model: TinyModel,
        layout: KVLayout,
        engine: TransferEngine,
        *,
        staging_pages: int = 1024,
        remember: int = 32,
        transfer_timeout: float = 30.0,
    ) -> None:
        self.model = model
        self.layout = layout
        self.engine = engine
        self.staging = KVPool(layout, staging_pages, name="prefill-staging")
        self.region = engine.register("staging", self.staging.bytes_view())
        self.pages = _PageAllocator(staging_pages)
        self.transfer_timeout = transfer_timeout
        self._remember = remember
        self._recent: OrderedDict[bytes, tuple[torch.Tensor, int]] = OrderedDict()
        self._compute = trio.CapacityLimiter(1)
        self.computed_tokens = 0
        self.requests = 0
        self.cancelled = 0
        self._in_flight: dict[tuple[str, int], _InFlight] = {}
        self._cancelled_early: deque[tuple[str, int]] = deque(maxlen=CANCELLED_MEMORY)

    async def serve(
        self, port: int, *, host: str = "127.0.0.1", task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept decode nodes' control connections on `port` until cancelled."""
        await trio.serve_tcp(self._connection, port, host=host, task_status=task_status)

    async def _connection(self, stream: trio.SocketStream) -> None:
        reader = protocol.FrameReader(stream, max_binary=0)
        send_lock = trio.Lock()
        try:
            hello, _ = await reader.receive()
            if hello["op"] != "hello":
                raise protocol.ProtocolError(f"expected 'hello', got {hello['op']!r}")
            peer = await self.engine.add_peer(bytes.fromhex(protocol.field(hello, "info", str)))
            await protocol.send(stream, {"op": "hello", "info": self.engine.local_info().hex()})
            async with trio.open_nursery() as nursery:
                try:
                    while True:
                        try:
                            msg, _ = await reader.receive()
                        except EOFError:
                            break
                        if msg["op"] == "kv":
                            nursery.start_soon(self._serve_kv, stream, send_lock, peer, msg)
                        elif msg["op"] == "cancel":
                            nursery.start_soon(self._cancel, stream, send_lock, peer, msg)
                        else:
                            raise protocol.ProtocolError(f"unknown message {msg['op']!r}")
                finally:
                    # Nobody waits for these answers any more: stop the transfers (they settle).
                    nursery.cancel_scope.cancel()
        except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a broken or misbehaving peer: drop the connection, keep serving others
        except Exception as exc:  # e.g. the transfer engine refused the peer: say why, keep serving
            print(f"prefill: dropped a connection: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            await stream.aclose()

    async def _cancel(self, stream: trio.SocketStream, lock: trio.Lock, peer: str, msg: dict) -> None:
        tid = protocol.field(msg, "tid", int)
        serving = self._in_flight.get((peer, tid))
        if serving is None:
            self._cancelled_early.append((peer, tid))
        else:
            serving.scope.cancel()
            await serving.ended.wait()
        self.cancelled += 1
        async with lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await protocol.send(stream, {"op": "cancelled", "tid": tid})

    async def _serve_kv(self, stream: trio.SocketStream, lock: trio.Lock, peer: str, msg: dict) -> None:
        tid = protocol.field(msg, "tid", int)
        key = (peer, tid)
        if key in self._cancelled_early or key in self._in_flight:
            return  # cancelled before it arrived (or a duplicate): the decode node waits for neither
        serving = self._in_flight[key] = _InFlight()
        try:
            with serving.scope:
                await self._answer_kv(stream, lock, peer, tid, msg)
        finally:
            del self._in_flight[key]
            serving.ended.set()

    async def _answer_kv(
        self, stream: trio.SocketStream, lock: trio.Lock, peer: str, tid: int, msg: dict
    ) -> None:
        reply: dict = {"op": "kv", "tid": tid}
        try:
            tokens = protocol.int_list(msg, "tokens", high=self.model.config.vocab)
            start, end = protocol.field(msg, "start", int), protocol.field(msg, "end", int)
            dst = protocol.int_list(msg, "dst")
            page = self.layout.page_size
            if not (tokens and 0 <= start <= end <= len(tokens) and start % page == 0):
                raise ValueError(f"bad range [{start}, {end}) of a {len(tokens)}-token prompt")
            first_page, last_page = start // page, math.ceil(end / page)
            if len(dst) != last_page - first_page:
                raise ValueError(f"{len(dst)} destination pages for pages {first_page}..{last_page - 1}")
            kv, first_token = await self._kv(tokens)
            digests = await self._send(kv, first_page, last_page, peer, dst, f"kv:{tid}".encode())
            reply.update(ok=True, first_token=first_token, digests=digests)
        except Exception as exc:  # answered, not raised: the decode node falls back or fails the request
            reply.update(ok=False, reason=f"{type(exc).__name__}: {exc}")
        async with lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await protocol.send(stream, reply)

    async def _kv(self, tokens: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The prompt's KV (all of it: attention needs every earlier token) and its first output."""
        key = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()
        hit = self._recent.get(key)
        if hit is not None:
            self._recent.move_to_end(key)
            return hit
        tensor = torch.tensor(tokens, dtype=torch.int64)
        kv, first = await trio.to_thread.run_sync(self.model.prefill, tensor, limiter=self._compute)
        self.computed_tokens += len(tokens)
        self.requests += 1
        self._recent[key] = (kv, first)
        while len(self._recent) > self._remember:
            self._recent.popitem(last=False)
        return kv, first

    async def _send(
        self, kv: torch.Tensor, first: int, last: int, peer: str, dst: list[int], notif: bytes
    ) -> list[str]:
        pages = to_pages(kv, self.layout.page_size)[first:last]
        slots = await self.pages.take(len(dst))
        settled = True
        try:
            if slots:
                self.staging.data[torch.tensor(slots)] = pages.to(self.staging.data.dtype)
            digests = page_digests(self.staging.data[torch.tensor(slots, dtype=torch.int64)]) if slots else []
            handle = await self.engine.post("WRITE", self.region, slots, peer, "L1", dst, notif)
            try:
                state = await self.engine.wait(handle, timeout=self.transfer_timeout)
                if state is not XferState.DONE:
                    raise RuntimeError(f"transfer {state}: {self.engine.reason(handle)}")
            finally:
                # Also when cancelled: the answer (or the `cancelled`) waits until nothing moves.
                with trio.CancelScope(shield=True), trio.move_on_after(SETTLE_TIMEOUT_S) as waited:
                    await self.engine.settle(handle)
                settled = not waited.cancelled_caught
                if not settled:
                    print(f"prefill: {notif!r} did not settle in {SETTLE_TIMEOUT_S} s", file=sys.stderr)
            return digests
        finally:
            if settled:  # else the WRITE may still read them: keep them out of use
                with trio.CancelScope(shield=True):
                    await self.pages.give(slots)
