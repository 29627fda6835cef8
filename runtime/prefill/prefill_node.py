"""The prefill node: computes a prompt's KV with the model and writes the pages a decode node
asks for straight into that node's L1 pool over the transfer engine.

A decode node connects, proves that it holds the cluster secret (`runtime/security/peer_auth.py`; the
prefill node proves it too), says hello with its engine's `local_info()`, then sends
`kv` requests: tokens, the range [start, end) it lacks, and the L1 pages to write them to. The
prefill node computes the KV its own cache (`prefill_cache`: L1, L2, and the shared L3) does
not hold, in chunks that its scheduler interleaves with other prompts' (`prefill_steps`,
`hicache.core.prefill_sched`), stages the pages as chunks complete them and WRITEs them
(`kv_out`), the notification `kv:<transfer>` on the last, and answers with the first output
token, the digests of the pages it sent, and how many prompt tokens it had cached (`cached`:
per tier). A `kv` with `progress: true` also hears, after every step, `progress` messages
(`done` of `total` tokens computed, or `queued` prompts ahead of it), so the decode node waits
for prefill's silence, not for its slowness. A request this node can never serve as it is (more
staging pages than it has, a bad field) is answered `ok: false, refused: true` with the reason:
asking again would fail again.

A decode node that gives up on a transfer sends `cancel` (on any of its connections): the
transfer is cancelled (leaving the queue, or getting no further chunk), its WRITE settled
(`TransferEngine.settle`: nothing more of it moves), and only then is `cancelled` answered, so
the decode node may reuse the pages. Every reply, a
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

import functools
import json
import logging
import math
from collections import deque

import attrs
import numpy as np
import trio

from hicache.core.prefill_sched import PrefillScheduler, Refused
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import LlamaModel
from hicache.runtime.model.sampling import choose
from hicache.runtime.prefill.kv_out import KVOut
from hicache.runtime.prefill.prefill_cache import DEFAULT_CACHE_BYTES, PrefillCache, Speeds
from hicache.runtime.prefill.prefill_steps import Prompt, Stepper
from hicache.runtime.security import peer_auth
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.security.limits import Gate, Limits, peer_name
from hicache.runtime.storage.base import StorageBackend
from hicache.runtime.tp.tp_kv import head_parts, heads_field
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire import compat, protocol
from hicache.runtime.wire.sampling_fields import Sampling

log = logging.getLogger("hicache.runtime.prefill")

# Layer groups a transfer leaves in while prefill computes them (0: once prefill is done).
DEFAULT_LAYER_GROUPS = 4
# Tokens of one prompt's chunk (SGLang's --chunked-prefill-size) and of one step's chunks together
# (--max-prefill-tokens). Sized for a 2-core CPU: a 512-token chunk of the default model takes
# 1.6 s at the start of a prompt and 5 s at 6,000 tokens of context (load 4), so a short prompt
# arriving behind a long one waits a few seconds, not the whole long prompt.
DEFAULT_CHUNK_TOKENS = 512
DEFAULT_STEP_TOKENS = 1024
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
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        step_tokens: int = DEFAULT_STEP_TOKENS,
    ) -> None:
        """`limits` bound what the decode nodes (any peer) connected to this node may hold;
        `secret` (default: `ClusterSecret.load()`) is what each of them must prove it holds.
        `cache_bytes` of KV (L1; 0: no cache), `cache_host_bytes` more behind it (L2), and L3
        (`store`, the decode nodes' shared store) make the prefill cache (`prefill_cache`).
        `layer_groups` > 0: KV leaves in that many layer groups while prefill computes them
        (a span WRITE each, the notification with the last); 0: once prefill is done.
        Prompts compute in chunks of at most `chunk_tokens` (whole pages), `step_tokens` in a
        step (`hicache.core.prefill_sched`)."""
        self.model = model
        self.layout = layout
        self.engine = engine
        self.staging = KVPool(layout, staging_pages, name="prefill-staging", lazy=True)
        self.region = engine.register("staging", self.staging.bytes_view())
        self._parts = head_parts(self.staging, engine)  # TP: pages of 1/d of the heads
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
        chunk_tokens = min(chunk_tokens, step_tokens)  # as SGLang: a step's budget bounds a chunk too
        if chunk_tokens < layout.page_size:
            raise ValueError(
                f"chunk_tokens and step_tokens: expected at least a page ({layout.page_size}), "
                f"got {chunk_tokens}"
            )
        sched = PrefillScheduler(staging_pages, layout.page_size, chunk_tokens, step_tokens)
        self.steps = Stepper(
            model, layout.page_size, layout.layers, sched, self.cache, self._compute, layer_groups
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
        """Accept decode nodes' control connections on `port`, and compute what they ask, until
        cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.steps.run)
            serve = functools.partial(trio.serve_tcp, self._connection, port, host=host)
            task_status.started(await nursery.start(serve))

    @property
    def sched(self) -> PrefillScheduler:
        return self.steps.sched

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
                raise protocol.MessageError(f"bad range [{start}, {end}) of a {len(tokens)}-token prompt")
            first_page, last_page = start // page, math.ceil(end / page)
            if len(dst) != last_page - first_page:
                raise protocol.MessageError(
                    f"{len(dst)} destination pages for pages {first_page}..{last_page - 1}"
                )
            sampling = Sampling.from_wire(msg.get("sampling"), self.model.config.vocab, "kv")
            heads = heads_field(msg, self.layout.kv_heads)
            tell = None
            if msg.get("progress") is True:  # the decode node follows progress, not a fixed wait

                async def tell(note: dict) -> None:
                    await self._answer(stream, lock, peer, {"op": "progress", "tid": tid, **note})

            scores_from = sampling.prompt_logprobs_from
            if scores_from >= len(tokens):
                raise protocol.MessageError(
                    f"field 'sampling.prompt_logprobs_from' must be below the prompt's {len(tokens)} "
                    f"tokens, got {scores_from}"
                )
            prompt = Prompt(f"{peer}/{tid}", np.asarray(tokens, dtype=np.int64), first_page, last_page)
            prompt.scores_from, prompt.sampling = scores_from, sampling
            make_out = functools.partial(self._kv_out, peer, dst, f"kv:{tid}".encode(), heads)
            done, digests = await self.steps.compute(prompt, namespace, make_out, tell)
            computed = len(tokens) - done.cached
            self.computed_tokens += computed
            self.reused_tokens += done.cached
            self.requests += computed > 1
            self.streamed += prompt.out is not None and prompt.out.during_compute > 0
            # The first token is drawn here as the decode node draws the rest; a message without
            # a seed (the decode node always sends one) draws from seed 0.
            # Penalties see the prompt (repetition) and no output yet; logprobs where asked for.
            (first_token,), (first_logprob,) = choose(
                done.logits[None, :], [sampling], [len(tokens)], [tokens], [[]], request_keys=[0]
            )
            cached = {"l1": done.l1, "l2": done.l2, "l3": done.l3}
            reply.update(ok=True, first_token=first_token, digests=digests, cached=cached)
            reply["timing"] = _timing(prompt, trio.current_time())
            if first_logprob is not None:
                reply["first_logprob"] = [first_logprob[0], [list(p) for p in first_logprob[1]]]
            if scores_from >= 0:
                scores = [
                    None if lp is None else [lp[0], [list(p) for p in lp[1]]] for lp in prompt.prompt_scores()
                ]
                size = len(json.dumps(scores, separators=(",", ":")))
                if size > MAX_SCORES_JSON:  # the answer (and the decode node's frame) must fit
                    raise protocol.MessageError(
                        f"the prompt's log-probabilities from token {scores_from} on take {size} bytes, "
                        f"over the {MAX_SCORES_JSON} one answer may carry: ask for fewer tokens "
                        "(a later logprob_start_len) or fewer top log-probabilities"
                    )
                reply["prompt_logprobs"] = scores
        except (protocol.MessageError, Refused) as exc:  # the same message is refused again: no retry
            reply.update(ok=False, refused=True, reason=str(exc))
        except Exception as exc:  # answered, not raised: the decode node retries or fails the request
            reply.update(ok=False, reason=plain(exc))
        if not reply.get("ok"):
            log.warning("kv %s from %s failed: %s", protocol.show(tid), protocol.show(peer), reply["reason"])
        await self._answer(stream, lock, peer, reply)

    def _kv_out(
        self, peer: str, dst: list[int], notif: bytes, heads: tuple[int, int] | None, slots: list[int]
    ) -> KVOut:
        """The way out of a transfer into `dst` at `peer`, staged in `slots`: with `heads` (a TP
        rank's [lo, hi)), only those heads of each page, staged as the first part of a staging
        page."""
        region, staging, per, part = self.region, self.staging.data, 1, slice(None)
        if heads is not None:
            per = self.layout.kv_heads // (heads[1] - heads[0])
            region, staging = self._parts[per]
            part = slice(heads[0], heads[1])
        return KVOut(
            self.engine,
            region,
            staging,
            per,
            part,
            slots,
            peer,
            dst,
            notif,
            self.layout.layers,
            self.transfer_timeout,
        )


MAX_SCORES_JSON = protocol.MAX_JSON // 2  # a prompt's log-probabilities in one answer, as JSON


def plain(exc: BaseException) -> str:
    """One sentence for a failure, never a group's "... (1 sub-exception)": the first leaf
    exception of a group, its type and message."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {protocol.clip(str(exc))}"


def _timing(p: Prompt, now: float) -> dict[str, float]:
    """Where a prompt's time on this node went, for the decode node's account of the request:
    `wait_s` queued or waiting on other prompts' chunks, `compute_s` its own forwards, `send_s`
    from its last chunk to the end of its transfer."""
    computed = p.computed_at if p.computed_at >= 0 else now
    return {
        "wait_s": round(max(0.0, computed - p.arrived_at - p.compute_s), 6),
        "compute_s": round(p.compute_s, 6),
        "send_s": round(max(0.0, now - computed), 6),
    }
