"""The decode node's client connections: authentication, `generate` (streamed or not, abortable),
and the small ops (`peek`, `evict`, `idle`, `stats`, `audit`, `config`).

Nothing a client sends stops the node: a bad frame ends its connection, a bad field its request,
each with a reason in the log (`hicache.runtime.decode`) and, where the protocol allows, in an
`error` answer; `Limits` bound the connections, the bytes of frames being received and the time a
frame or an idle connection may take (`runtime/security/limits.py`). Only a TP rank 0 serves
clients; its arrivals reach every rank in the next round.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np
import torch
import trio

from hicache.core import events as ev
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError
from hicache.core.pages import namespace_seed, page_keys
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.live import Live, LiveTable
from hicache.runtime.decode.status import Status
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.model.llama import TinyModel
from hicache.runtime.security.api_keys import MAX_TENANT_CHARS, OPEN, ApiKeys, Principal
from hicache.runtime.security.limits import Gate, peer_name
from hicache.runtime.tp.tp_rounds import Rounds
from hicache.runtime.wire import protocol
from hicache.runtime.wire.sampling_fields import Sampling, seed_for

log = logging.getLogger("hicache.runtime.decode")
MAX_ECHOED_RID = 1024  # a refused request's id is echoed in the error when at most this long


class Clients:
    """Serves client connections on `core`'s cache through `feed`, keeping `live` current."""

    def __init__(
        self,
        feed: Feed,
        live: LiveTable,
        core: DecodeNodeCore,
        status: Status,
        gate: Gate,
        model: TinyModel,
        layout: KVLayout,
        *,
        model_name: str,
        api_keys: ApiKeys | None,
        rounds: Rounds | None,
    ) -> None:
        self.feed, self.live, self.core, self.status, self.gate = feed, live, core, status, gate
        self.model, self.layout = model, layout
        self.page = core.cfg.page_size
        self.model_name = model_name
        self.api_keys = api_keys
        self.rounds = rounds  # a TP rank 0's: arrivals go to every rank through it

    async def serve(self, stream: trio.SocketStream) -> None:
        """Serve one client connection. Whatever it sends ends at most this connection (or, for
        a bad field, only that request), with the reason logged and answered."""
        peer = peer_name(stream)
        try:
            if await self.gate.enter(stream, peer):
                try:
                    await self._serve(stream, peer)
                finally:
                    self.gate.leave()
        finally:
            await stream.aclose()

    async def _serve(self, stream: trio.SocketStream, peer: str) -> None:
        # Without --api-keys every client is trusted as it is; with them, from its key on.
        reader = self.gate.reader(stream, max_binary=0, authenticated=self.api_keys is None)
        who: Principal | None = OPEN if self.api_keys is None else None  # None: not yet known
        try:
            while True:
                try:
                    with self.gate.between_requests(reader):  # may be closed to make room
                        msg, _ = await reader.receive()
                except EOFError:
                    return
                try:
                    if msg["op"] == "auth":
                        who = self._authenticate(msg, who, peer)
                        self.gate.trust(reader)
                        reply = {"op": "auth", "ok": True, "tenant": who.tenant, "admin": who.admin}
                        binary = b""
                    elif msg["op"] == "generate" and who is not None:
                        reply, binary = await self._generate(msg, who, reader, stream)
                    else:
                        reply, binary = await self._answer(msg, who), b""
                except protocol.MessageError as exc:  # the frame was whole: answer it, go on
                    log.warning("client %s: request refused: %s", peer, exc)
                    reply, binary = {"op": "error", "reason": str(exc)}, b""
                    rid = msg.get("rid")
                    if isinstance(rid, str) and len(rid) <= MAX_ECHOED_RID:
                        reply["rid"] = rid
                await self.gate.send(stream, reply, binary)
        except protocol.IdleTimeout as exc:
            # Nothing of a next request was read: the client may send it again elsewhere.
            log.info("client %s: closed: %s", peer, exc)
            await self.gate.send_quietly(stream, {"op": "goodbye", "reason": str(exc)})
        except protocol.ProtocolError as exc:
            log.warning("client %s: connection closed: %s", peer, exc)
            await self.gate.send_quietly(stream, {"op": "error", "reason": str(exc)})
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("client %s: connection lost: %s", peer, exc or type(exc).__name__)
        except Exception as exc:  # a bug met by this connection's input: it ends here, not the node
            log.exception("client %s: connection closed after an internal error", peer)
            reason = f"internal error: {type(exc).__name__}: {protocol.clip(str(exc))}"
            await self.gate.send_quietly(stream, {"op": "error", "reason": reason})

    def _authenticate(self, msg: dict[str, Any], who: Principal | None, peer: str) -> Principal:
        """The principal of the API key in an `auth` message; a wrong key ends the connection."""
        if self.api_keys is None:
            return OPEN
        if who is not None:
            raise protocol.MessageError("message 'auth': this connection is authenticated already")
        got = self.api_keys.lookup(msg.get("api_key"))
        if got is None:
            raise protocol.ProtocolError("message 'auth': unknown API key")
        log.info("client %s: authenticated (tenant %s, admin %s)", peer, protocol.show(got.tenant), got.admin)
        return got

    async def _answer(self, msg: dict[str, Any], who: Principal | None) -> dict[str, Any]:
        """The answer to one client message; `MessageError` for a missing or bad field, or for
        an operation this client's API key does not allow."""
        op = msg["op"]
        if who is None:
            raise protocol.MessageError(
                f"message {protocol.show(op)}: this node needs an API key: send "
                "{'op': 'auth', 'api_key': ...} first"
            )
        if op in ("evict", "idle", "stats", "audit", "config") and not who.admin:
            raise protocol.MessageError(f"message {op!r}: needs an admin API key")
        if op == "peek":  # how much of a prompt this node holds: a cache-aware router asks
            tokens = protocol.int_list(msg, "tokens", high=self.model.config.vocab)
            seed = namespace_seed(self.model_name, self._tenant(msg, who))
            keys = page_keys(np.asarray(tokens, dtype=np.int64), self.page, seed).tolist()
            return {"op": "peek", "pages": self.core.cached_pages(keys), "page_size": self.page}
        if op == "evict":
            l1 = protocol.int_field(msg, "l1") if "l1" in msg else 1 << 40
            l2 = protocol.int_field(msg, "l2") if "l2" in msg else 0
            self.feed.put(ev.EvictRequested(self.feed.now(), l1, l2))
            return {"op": "evict", "ok": True}
        if op == "idle":
            await self._idle()
            return {"op": "idle", "ok": True}
        if op == "stats":
            return await self.status.stats()
        if op == "audit":
            return await self.status.audit_all()
        if op == "config":
            return self.status.config()
        return {"op": "error", "reason": f"unknown op {protocol.show(op)}"}

    async def _idle(self) -> None:
        """Return once no request is live and the core has nothing in flight."""
        while not (self.core.idle and not self.live):
            if self.live:
                await self.live.emptied()
            else:
                await self.feed.next_event()

    def _tenant(self, msg: dict[str, Any], who: Principal) -> str | None:
        """Whose namespace a message acts in: its API key's; an admin key (a front door) may name
        the tenant it acts for; only a node without keys lets any client name it."""
        op = msg["op"]
        tenant = protocol.text(msg, "tenant") if msg.get("tenant") is not None else None
        if tenant is not None and len(tenant) > MAX_TENANT_CHARS:
            raise protocol.MessageError(
                f"message {op!r}: field 'tenant' is over {MAX_TENANT_CHARS} characters"
            )
        if self.api_keys is not None and not who.admin:
            if tenant is not None and tenant != who.tenant:
                raise protocol.MessageError(
                    f"message {op!r}: field 'tenant' differs from the tenant of this connection's API key"
                )
            tenant = who.tenant
        elif self.api_keys is not None and tenant is None:
            tenant = who.tenant
        return tenant

    async def _generate(
        self,
        msg: dict[str, Any],
        who: Principal,
        reader: protocol.FrameReader,
        stream: trio.SocketStream,
    ) -> tuple[dict[str, Any], bytes]:
        """Check every field before anything is touched: a bad one is a `MessageError`. The
        tenant is the API key's; only a node without keys lets the client name it.

        While the request runs, the connection is watched: an `abort` naming it, or the client
        going away (end of stream, a stream of tokens it no longer takes), aborts it in the
        core, which frees everything it held. With `stream`, each new token goes out at once
        in a `tokens` frame; the `result` comes last either way."""
        rid = protocol.text(msg, "rid")
        prompt = protocol.int_list(msg, "tokens", high=self.model.config.vocab)
        if not prompt:
            raise protocol.MessageError("message 'generate': field 'tokens' must hold at least one token")
        max_new = protocol.int_field(msg, "max_new", low=1)
        cap = self.gate.limits.max_tokens
        if len(prompt) + max_new > cap:
            raise protocol.MessageError(
                f"message 'generate': {len(prompt)} prompt tokens + max_new {max_new} is over this "
                f"node's limit of {cap} tokens per request (--max-tokens)"
            )
        tenant = self._tenant(msg, who)
        verify = protocol.field(msg, "verify", bool) if msg.get("verify") is not None else False
        streaming = protocol.field(msg, "stream", bool) if msg.get("stream") is not None else False
        sampling = Sampling.from_wire(msg.get("sampling"), self.model.config.vocab)
        if sampling.prompt_logprobs_from >= len(prompt):
            raise protocol.MessageError(
                f"message 'generate': field 'sampling.prompt_logprobs_from' must be below the "
                f"prompt's {len(prompt)} tokens, got {sampling.prompt_logprobs_from}"
            )
        if sampling.seed is None:
            sampling = attrs.evolve(sampling, seed=seed_for(rid))
        duplicate = {"op": "result", "rid": rid, "outcome": "failed", "reason": "duplicate request id"}
        if rid in self.live:
            return duplicate, b""
        seed = namespace_seed(self.model_name, tenant)
        live = Live(rid, prompt, max_new, seed, verify, self.feed.now(), sampling=sampling)
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops |= set(getattr(self.model, "eos_token_ids", ()))
        live.stop_ids = frozenset(stops)
        keys = live.page_keys(self.page, len(prompt) // self.page)  # kept on `live`, extended as it decodes
        self.live[rid] = live
        if self.rounds is not None:
            self.rounds.arrive(live, keys)  # every rank feeds it in the next round
        else:
            try:
                self.feed.put(ev.RequestArrived(live.arrival, rid, len(prompt), keys), refuse=True)
            except CoreError:  # the core still keeps an ended request of that id (I/O in flight)
                self.live.remove(rid)
                return duplicate, b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, live, reader)
            if streaming:
                nursery.start_soon(self._stream_tokens, live, stream)
            await live.answer.wait()
            nursery.cancel_scope.cancel()
        self.live.remove(rid)
        if live.duplicate:
            return duplicate, b""
        # The core drops it once no I/O refers to it any more.
        self.feed.put(ev.ForgetRequested(self.feed.now(), rid))
        _log_request(live)
        reply = {
            "op": "result",
            "rid": rid,
            "outcome": live.outcome,
            "reason": live.reason,
            "tokens": live.gen,
            **({"logprobs": live.logprobs} if live.sampling.logprobs else {}),
            # Streamed, they went with the first `tokens` frame.
            **({"prompt_logprobs": live.prompt_logprobs} if live.prompt_logprobs and not streaming else {}),
            "ttft_s": live.first_token_at - live.arrival if live.first_token_at >= 0 else None,
            "e2e_s": self.feed.now() - live.arrival,
            "promised_tokens": max(live.promised, 0),
            "finish_reason": live.finish_reason or ("abort" if live.outcome == "aborted" else ""),
            "account": live.account,
            "start_pages": live.start_pages,
            "final_pages": live.final_pages,
            "prefill_cached": live.prefill_cached or {},
            **({"phases": live.phases} if live.phases is not None else {}),
            # Failed because prefill refused it as it is: the client's to change (a 400, not a 503).
            "refused": live.outcome == "failed" and live.refused,
        }
        if self.rounds is not None:  # each rank's pages hold its heads: the ledger checks them per rank
            reply["tp_ranks"] = [
                {"start_pages": r["start_pages"], "final_pages": r["final_pages"]} for r in live.ranks
            ]
            if live.verify and live.start_kv:
                return reply, whole_kv(self.layout, live)
        return reply, live.start_kv

    async def _watch(self, live: Live, reader: protocol.FrameReader) -> None:
        """Watch the client's connection while its request runs: an `abort` naming it, or the
        end of the connection, aborts it. Any other frame (a request sent ahead) is left
        unread, to be answered in its turn once this answer is out."""
        while True:
            try:
                msg = await reader.peek()
            except protocol.IdleTimeout:
                continue  # a request in progress: the connection is not idle
            except EOFError:
                self._abort(live, "the client closed its connection")
                return
            except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the connection's own loop meets it next and answers it
            if msg.get("op") == "abort" and msg.get("rid") == live.rid:
                await reader.receive()
                self._abort(live, "aborted by the client")
            return

    async def _stream_tokens(self, live: Live, stream: trio.SocketStream) -> None:
        """Send each token as soon as it exists; a client that does not take them is gone."""
        sent = 0
        while True:
            changed = live.changed
            if len(live.gen) > sent:
                frame: dict[str, Any] = {"op": "tokens", "rid": live.rid, "tokens": live.gen[sent:]}
                if live.sampling.logprobs:
                    frame["logprobs"] = live.logprobs[sent:]
                if not sent and live.account:  # where the prompt's KV came from, known at start
                    frame["account"] = live.account
                if not sent and live.prompt_logprobs is not None:  # they came with the first token
                    frame["prompt_logprobs"] = live.prompt_logprobs
                sent = len(live.gen)
                try:
                    await self.gate.send(stream, frame)
                except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                    self._abort(live, "the client stopped reading its tokens")
                    return
            await changed.wait()

    def _abort(self, live: Live, reason: str) -> None:
        if not live.answer.is_set():
            log.info("request %s: %s; aborting it", protocol.show(live.rid), reason)
            self.feed.put(ev.AbortRequested(self.feed.now(), live.rid, reason))


def _log_request(live: Live) -> None:
    """One line per request, with its tier account; a warning for a failure or a fallback."""
    a = live.account
    ttft = f"{live.first_token_at - live.arrival:.3f} s" if live.first_token_at >= 0 else "-"
    line = (
        f"request {protocol.show(live.rid)} {live.outcome}"
        f"{' (' + live.finish_reason + ')' if live.finish_reason else ''}: "
        f"{len(live.prompt)} prompt tokens, cached l1 {a.get('l1', 0)} l2 {a.get('l2', 0)} "
        f"l3 {a.get('l3', 0)}, transferred {a.get('transferred', 0)}, "
        f"fallback {a.get('fallback', 0)}; {len(live.gen)} tokens out, ttft {ttft}"
    )
    if live.outcome == "failed":
        log.warning("%s; %s", line, live.reason)
    elif a.get("fallback"):
        log.warning("%s; %d tokens fell back to prefill (see the warnings above)", line, a["fallback"])
    else:
        log.info(line)


def whole_kv(layout: KVLayout, live: Live) -> bytes:
    """TP rank 0: the request's KV over all heads, from each rank's part (heads are axis 3)."""
    shape = (layout.layers, 2, -1, layout.kv_heads, layout.head_dim)
    dtype = layout.torch_dtype
    parts = [live.start_kv, *(r["kv"] for r in live.ranks)]
    tensors = [torch.frombuffer(bytearray(p), dtype=dtype).view(shape) for p in parts]
    return torch.cat(tensors, dim=3).contiguous().view(torch.uint8).numpy().tobytes()
