"""The prefill node: computes a prompt's KV with the model and writes the pages a decode node
asks for straight into that node's L1 pool over the transfer engine.

A decode node connects, proves that it holds the cluster secret (`runtime/security/peer_auth.py`; the
prefill node proves it too), says hello with its engine's `local_info()`, then sends
`kv` requests: tokens, the range [start, end) it lacks, and the L1 pages to write them to. The
prefill node computes the KV its own cache (`prefill_cache`: L1, L2, and the shared L3) does
not hold, stages the pages, posts one WRITE with the notification `kv:<transfer>`, and answers
with the first output token, the digests of the pages it sent, and how many prompt tokens it
had cached (`cached`: per tier).

A decode node that gives up on a transfer sends `cancel` (on any of its connections): the
transfer is cancelled, its WRITE settled (`TransferEngine.settle`: nothing more of it moves),
and only then is `cancelled` answered, so the decode node may reuse the pages. Every reply, a
failure included, is likewise sent only after its WRITE settled. A request cancelled before
it arrived is refused when it does. When a control connection ends, the transfers it asked for
are cancelled the same way: their decode node stopped waiting for them.

The hello binds the decode node's engine name to its address for as long as one of its control
connections lives: a hello naming a known engine at another address is refused, so no peer
can divert another's KV. Nothing a peer sends stops the node: a bad frame, or a message it
cannot address (no `tid`), ends that connection with an `error` answer and a reason in the log
(`hicache.runtime.prefill`); a `kv` request with a bad field is answered `ok: false` with the
reason. `Limits` bound the connections, the bytes of frames being received, and the time a
frame or an idle connection may take (`runtime/security/limits.py`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import trio

from hicache.runtime.kv.kv_digest import page_digests
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import LlamaModel
from hicache.runtime.model.sampling import sample
from hicache.runtime.prefill.prefill_cache import (
    DEFAULT_CACHE_BYTES,
    LayerGroups,
    PrefillCache,
    Prefilled,
    Speeds,
    compute_all,
)
from hicache.runtime.security import peer_auth
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.security.limits import Gate, Limits, peer_name
from hicache.runtime.storage.base import StorageBackend
from hicache.runtime.tp.tp_kv import head_parts, heads_field
from hicache.runtime.transfer.base import MemoryRegion, Span, TransferEngine, XferHandle, XferState
from hicache.runtime.wire import compat, protocol
from hicache.runtime.wire.sampling_fields import Sampling


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


log = logging.getLogger("hicache.runtime.prefill")

# Layer groups a transfer leaves in while prefill computes them (0: once prefill is done).
DEFAULT_LAYER_GROUPS = 4
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
        model: LlamaModel,
        layout: KVLayout,
        engine: TransferEngine,
        *,
        staging_pages: int = 1024,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_host_bytes: int = 0,
        store: StorageBackend | None = None,
        speeds: Speeds | None = None,
        transfer_timeout: float = 30.0,
        limits: Limits | None = None,
        secret: ClusterSecret | None = None,
        layer_groups: int = DEFAULT_LAYER_GROUPS,
    ) -> None:
        """`limits` bound what the decode nodes (any peer) connected to this node may hold;
        `secret` (default: `ClusterSecret.load()`) is what each of them must prove it holds.
        `cache_bytes` of KV (L1; 0: no cache), `cache_host_bytes` more behind it (L2), and L3
        (`store`, the decode nodes' shared store) make the prefill cache (`prefill_cache`).
        `layer_groups` > 0: KV leaves in that many layer groups while prefill computes them
        (a span WRITE each, the notification with the last); 0: once prefill is done."""
        self.model = model
        self.layout = layout
        self.engine = engine
        self.staging = KVPool(layout, staging_pages, name="prefill-staging")
        self.region = engine.register("staging", self.staging.bytes_view())
        self._parts = head_parts(self.staging, engine)  # TP: pages of 1/d of the heads
        self.pages = _PageAllocator(staging_pages)
        self.transfer_timeout = transfer_timeout
        if layer_groups < 0:
            raise ValueError(f"layer_groups: expected >= 0, got {layer_groups}")
        self.layer_groups = layer_groups
        self.streamed = 0  # transfers sent in layer groups while prefill computed them
        self.gate = Gate(limits if limits is not None else Limits(), log)
        self.secret = secret if secret is not None else ClusterSecret.load()
        self._peer_connections: dict[str, int] = {}  # engine name -> its live control connections
        self._compute = trio.CapacityLimiter(1)
        l1_pages = cache_bytes // layout.page_bytes
        self.cache = (
            PrefillCache(
                model,
                layout,
                l1_pages,
                l2_pages=cache_host_bytes // layout.page_bytes,
                store=store,
                speeds=speeds,
                limiter=self._compute,
            )
            if l1_pages > 0
            else None
        )
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache (L1, L2 or L3)
        self.computed_tokens = 0
        self.requests = 0  # prompts that computed more than their last token
        self.cancelled = 0
        self._in_flight: dict[tuple[str, int], _InFlight] = {}
        self._cancelled_early: deque[tuple[str, int]] = deque(maxlen=CANCELLED_MEMORY)

    async def serve(
        self, port: int, *, host: str = "127.0.0.1", task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept decode nodes' control connections on `port` until cancelled."""
        await trio.serve_tcp(self._connection, port, host=host, task_status=task_status)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """Serve one decode node's control connection. Whatever it sends ends at most this
        connection (and the transfers it asked for), with the reason logged and answered."""
        where = peer_name(stream)
        try:
            if await self.gate.enter(stream, where):
                try:
                    await self._control(stream, where)
                finally:
                    self.gate.leave()
        finally:
            await stream.aclose()

    async def _control(self, stream: trio.SocketStream, where: str) -> None:
        reader = self.gate.reader(stream, max_binary=0)
        send_lock = trio.Lock()
        peer: str | None = None

        async def say(msg: dict) -> None:
            async with send_lock:
                await self.gate.send(stream, msg)

        async def hear() -> dict:
            return (await reader.receive())[0]

        try:
            # Nothing the peer says is acted on before it proved it holds the cluster secret.
            await peer_auth.accept(self.secret, say, hear, f"the peer at {where}")
            self.gate.trust(reader)  # only now may its frames draw on the node's budget
            hello, _ = await reader.receive()
            if hello["op"] != "hello":
                raise protocol.MessageError(f"expected 'hello', got {protocol.show(hello['op'])}")
            info = protocol.field(hello, "info", str)
            try:
                raw = bytes.fromhex(info)
            except ValueError as exc:
                raise protocol.MessageError(
                    f"message 'hello': bad field 'info': {protocol.clip(str(exc))}"
                ) from None
            mine = compat.profile(self.layout, self.engine, self.model.config)
            why = compat.mismatch(mine, hello.get("profile"), "the decode node") or compat.shard_heads(
                hello.get("profile"), self.layout.kv_heads
            )
            if why is not None:  # checked before the peer is known to the engine
                raise protocol.MessageError(f"message 'hello': {why}")
            try:
                # A known engine name is never rebound to another address (the engine refuses).
                peer = await self.engine.add_peer(raw)
            except ValueError as exc:  # info this engine cannot use, or a name bound elsewhere
                raise protocol.MessageError(
                    f"message 'hello': bad field 'info': {protocol.clip(str(exc))}"
                ) from None
            self._peer_connections[peer] = self._peer_connections.get(peer, 0) + 1
            async with send_lock:
                await self.gate.send(
                    stream, {"op": "hello", "info": self.engine.local_info().hex(), "profile": mine}
                )
            ended: Exception | None = None  # raised past the nursery, which would wrap it in a group
            async with trio.open_nursery() as nursery:
                try:
                    await self._requests(reader, stream, send_lock, peer, nursery)
                except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    ended = exc
                finally:
                    # Nobody waits for these answers any more: stop the transfers (they settle).
                    nursery.cancel_scope.cancel()
            if ended is not None:
                raise ended
        except protocol.IdleTimeout as exc:
            log.info("connection from %s closed: %s", where, exc)
            await self._last_word(stream, send_lock, {"op": "goodbye", "reason": str(exc)})
        except protocol.ProtocolError as exc:
            log.warning("connection from %s closed: %s", where, exc)
            await self._last_word(stream, send_lock, {"op": "error", "reason": str(exc)})
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("connection from %s lost: %s", where, exc or type(exc).__name__)
        except Exception as exc:  # e.g. the transfer engine refused the peer: say why, keep serving
            log.exception("connection from %s closed after an error", where)
            reason = f"{type(exc).__name__}: {protocol.clip(str(exc))}"
            await self._last_word(stream, send_lock, {"op": "error", "reason": reason})
        finally:
            if peer is not None:
                self._forget(peer)

    def _forget(self, peer: str) -> None:
        """Drop the engine's binding of `peer` once no control connection of it is left: a
        decode node that comes back says hello again, and its name is free for nobody else."""
        left = self._peer_connections.pop(peer, 1) - 1
        if left > 0:
            self._peer_connections[peer] = left
        else:
            self.engine.remove_peer(peer)

    async def _last_word(self, stream: trio.SocketStream, lock: trio.Lock, msg: dict) -> None:
        with trio.move_on_after(self.gate.limits.frame_timeout_s):
            async with lock:  # not into the middle of another answer
                await self.gate.send_quietly(stream, msg)

    async def _requests(
        self,
        reader: protocol.FrameReader,
        stream: trio.SocketStream,
        lock: trio.Lock,
        peer: str,
        nursery: trio.Nursery,
    ) -> None:
        """Read requests until the peer is done; each is served in `nursery`. An idle timeout
        counts only while none of them is in progress."""
        while True:
            try:
                msg, _ = await reader.receive()
            except EOFError:
                return
            except protocol.IdleTimeout:
                if nursery.child_tasks:
                    continue
                raise
            op = msg["op"]
            if op not in ("kv", "cancel"):
                raise protocol.MessageError(f"unknown message {protocol.show(op)}")
            tid = protocol.field(msg, "tid", int)  # without it no answer can be addressed
            if op == "kv":
                nursery.start_soon(self._serve_kv, stream, lock, peer, tid, msg)
            else:
                nursery.start_soon(self._cancel, stream, lock, peer, tid)

    async def _answer(self, stream: trio.SocketStream, lock: trio.Lock, peer: str, msg: dict) -> None:
        """Send one answer; a peer that does not take it in time loses the connection."""
        async with lock:
            try:
                await self.gate.send(stream, msg)
            except protocol.ProtocolError as exc:
                log.warning("connection of %s closed: %s", protocol.show(peer), exc)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the connection's reader sees it end too

    async def _cancel(self, stream: trio.SocketStream, lock: trio.Lock, peer: str, tid: int) -> None:
        serving = self._in_flight.get((peer, tid))
        if serving is None:
            self._cancelled_early.append((peer, tid))
        else:
            serving.scope.cancel()
            await serving.ended.wait()
        self.cancelled += 1
        await self._answer(stream, lock, peer, {"op": "cancelled", "tid": tid})

    async def _serve_kv(
        self, stream: trio.SocketStream, lock: trio.Lock, peer: str, tid: int, msg: dict
    ) -> None:
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
            namespace = protocol.int_field(msg, "namespace", high=1 << 64)
            start, end = protocol.field(msg, "start", int), protocol.field(msg, "end", int)
            dst = protocol.int_list(msg, "dst")
            page = self.layout.page_size
            if len(tokens) > self.gate.limits.max_tokens:
                raise protocol.MessageError(
                    f"message 'kv': {len(tokens)} tokens is over this node's limit of "
                    f"{self.gate.limits.max_tokens} (--max-tokens)"
                )
            if not (tokens and 0 <= start <= end <= len(tokens) and start % page == 0):
                raise ValueError(f"bad range [{start}, {end}) of a {len(tokens)}-token prompt")
            first_page, last_page = start // page, math.ceil(end / page)
            if len(dst) != last_page - first_page:
                raise ValueError(f"{len(dst)} destination pages for pages {first_page}..{last_page - 1}")
            sampling = Sampling.from_wire(msg.get("sampling"), self.model.config.vocab, "kv")
            heads = heads_field(msg, self.layout.kv_heads)
            notif = f"kv:{tid}".encode()
            done, digests = await self._prefill_and_send(
                tokens, namespace, first_page, last_page, peer, dst, notif, heads
            )
            # The first token is drawn here as the decode node draws the rest; a message without
            # a seed (the decode node always sends one) draws from seed 0.
            (first_token,) = sample(done.logits[None, :], [sampling], [len(tokens)], request_keys=[0])
            cached = {"l1": done.l1, "l2": done.l2, "l3": done.l3}
            reply.update(ok=True, first_token=first_token, digests=digests, cached=cached)
        except protocol.MessageError as exc:  # a bad field: the reason names it
            reply.update(ok=False, reason=str(exc))
        except Exception as exc:  # answered, not raised: the decode node falls back or fails the request
            reply.update(ok=False, reason=f"{type(exc).__name__}: {protocol.clip(str(exc))}")
        if not reply.get("ok"):
            log.warning("kv %s from %s failed: %s", protocol.show(tid), protocol.show(peer), reply["reason"])
        await self._answer(stream, lock, peer, reply)

    async def _kv(
        self, tokens: Sequence[int], namespace: int, first: int, last: int, stream: LayerGroups | None = None
    ) -> Prefilled:
        """The prompt's pages [first, last) and last logits, computing only what the cache
        (`prefill_cache`) does not hold. The cache is keyed by the namespace (model and tenant,
        `namespace_seed`): a tenant never reuses another tenant's work, so it is no timing
        channel between tenants."""
        ids = np.asarray(tokens, dtype=np.int64)
        if self.cache is None:
            done = await compute_all(self.model, ids, self.layout.page_size, first, last, self._compute)
        else:
            done = await self.cache.prefill(ids, namespace, first, last, stream)
        computed = len(ids) - done.cached
        self.computed_tokens += computed
        self.reused_tokens += done.cached
        self.requests += computed > 1
        return done

    async def _prefill_and_send(
        self,
        tokens: Sequence[int],
        namespace: int,
        first: int,
        last: int,
        peer: str,
        dst: list[int],
        notif: bytes,
        heads: tuple[int, int] | None = None,
    ) -> tuple[Prefilled, list[str]]:
        """Prefill the prompt and WRITE pages [first, last) into `dst` at `peer`: layer group by
        layer group while prefill computes them (`layer_groups`), else once it is done. Each
        WRITE is posted once the one before is done, and the notification rides on the last,
        so the decode node hears of the transfer only when every byte is there. With `heads`
        (a TP rank's [lo, hi)), only those heads of each page, staged as the first part of a
        staging page. Returns the prefill and the digests of the pages sent. Every WRITE has
        settled (nothing of it moves) when this returns or raises, so staging pages and the
        decode node's pages are free."""
        region, staging, per, part = self.region, self.staging.data, 1, slice(None)
        if heads is not None:
            per = self.layout.kv_heads // (heads[1] - heads[0])
            region, staging = self._parts[per]
            part = slice(heads[0], heads[1])
        slots = await self.pages.take(len(dst))
        parts = [s * per for s in slots]  # staging page s holds parts s*per .. s*per+per-1
        idx = torch.tensor(parts, dtype=torch.int64)
        layers = self.layout.layers
        ready_send, ready = trio.open_memory_channel[tuple[int, int]](math.inf)
        token = trio.lowlevel.current_trio_token()

        def deliver(lo: int, hi: int, pages: torch.Tensor) -> None:  # on the compute thread
            staging[idx, lo:hi] = pages[:, :, :, :, part].to(staging.dtype)
            trio.from_thread.run_sync(ready_send.send_nowait, (lo, hi), trio_token=token)

        stream = None
        if self.layer_groups and slots and self.cache is not None:
            stream = LayerGroups(layers, self.layer_groups, deliver)
        unsettled: list[XferHandle] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._ship, ready, region, parts, peer, dst, notif, unsettled)
                with ready_send:
                    done = await self._kv(tokens, namespace, first, last, stream)
                    if stream is None or stream.sent == 0:  # not streamed: the pages at once
                        if slots:
                            staging[idx] = done.pages[:, :, :, :, part].to(staging.dtype)
                        ready_send.send_nowait((0, layers))
                    else:
                        self.streamed += 1
            return done, page_digests(staging[idx]) if slots else []
        finally:
            with trio.CancelScope(shield=True):
                if await self._settle(unsettled, notif):  # else a WRITE may still read them
                    await self.pages.give(slots)

    async def _ship(
        self,
        ready: trio.MemoryReceiveChannel[tuple[int, int]],
        region: MemoryRegion,
        parts: list[int],
        peer: str,
        dst: list[int],
        notif: bytes,
        unsettled: list[XferHandle],
    ) -> None:
        """WRITE each layer group [lo, hi) of the staged pages (`parts` of `region`) as it
        becomes ready, one at a time; the last carries the notification."""
        layers = self.layout.layers
        layer_bytes = region.page_bytes // layers
        async with ready:
            async for lo, hi in ready:
                whole = (lo, hi) == (0, layers)
                span = None if whole else Span(lo * layer_bytes, (hi - lo) * layer_bytes)
                handle = await self.engine.post(
                    "WRITE", region, parts, peer, "L1", dst, notif, span=span, final=hi == layers
                )
                unsettled.append(handle)
                state = await self.engine.wait(handle, timeout=self.transfer_timeout)
                if state is not XferState.DONE:
                    raise RuntimeError(f"transfer {state}: {self.engine.reason(handle)}")

    async def _settle(self, handles: list[XferHandle], notif: bytes) -> bool:
        """Settle every WRITE posted (also when cancelled); False if one did not in time."""
        settled = True
        for handle in handles:
            with trio.move_on_after(SETTLE_TIMEOUT_S) as waited:
                await self.engine.settle(handle)
            if waited.cancelled_caught:
                settled = False
                log.error(
                    "%r did not settle in %s s; its staging pages stay out of use", notif, SETTLE_TIMEOUT_S
                )
        return settled
