"""The decode node: a trio service that runs the core and executes its commands for real.

It makes no cache decision of its own, and reads nothing of the core but what its commands
carry (a `Dispatcher` executes them through one table, `_handlers`). Clients send `generate`
requests; the service feeds the core (arrival, ticks, completions, evictions, forgetting), and
runs every command concurrently in its nursery: storage queries, prefetches and stores on the
L3 backend, load-backs and backups on the copy engine, KV increments from the prefill node (a
control message, then a WRITE into L1 that ends with a notification), timers. Requests the core
hands to the decode batch (`StartDecode`, growing by `ExtendKV`) are decoded with the same
model, writing each new token's KV into its L1 page; finished sequences go back to the core,
which inserts them into the tree and backs them up L1 -> L2 -> L3.

Each prefetch runs in its own cancel scope, which `CancelPrefetch` cancels; its `PrefetchDone`
names the pages that landed and is fed only once the L3 read has returned, so no byte can land
in the prefetch's host slots after the core frees them.

For verification the reply carries, per page of the KV the request had before its first decode
step, the digest of its bytes and where it came from (restored from the cache, or sent by
prefill with prefill's own digest), the digests of its final pages, and optionally the
assembled KV itself.

Every page received from prefill is checked against the digest prefill sent for it on the
authenticated control connection (`runtime/security/peer_auth.py`): a page that differs fails its
transfer, which the core retries or falls back from, and is never decoded from. With a
`FaultSpec` the service also injects faults into its own operations (`runtime/decode/faults.py`) and
checks L2 pages against the checksums taken when they were written. A control connection to
prefill that is lost is opened again by the next transfer, at the address `prefill_at` gives
then (a prefill node restarted elsewhere is found there).

With `--tp-size N` each rank runs this service over its part of the model and its heads of the
KV; the ranks feed their cores in lockstep rounds (`runtime/decode/tp_rounds.py`): `_feed` hands
`Rounds` everything but a decode step's events, timers fire and agreements are answered there,
and only rank 0 serves clients.

Nothing a client or prefill sends stops the node: a bad frame ends its connection, a bad field
its request, each with a reason in the log (`hicache.runtime.decode`) and, where the protocol
allows, in an `error` answer; `Limits` bound the connections, the bytes of frames being received
and the time a frame or an idle connection may take (`runtime/security/limits.py`).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import attrs
import numpy as np
import torch
import trio

from hicache.core import commands as cmd
from hicache.core import events as ev
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.dispatch import Dispatcher
from hicache.core.errors import CoreError
from hicache.core.pages import namespace_seed, page_keys
from hicache.faults import FaultSpec
from hicache.runtime.decode.faults import (
    CheckedCopies,
    FaultyStore,
    PageGuard,
    RuntimeFaults,
    flip_offset,
    flip_page_byte,
)
from hicache.runtime.decode.tp_rounds import Rounds
from hicache.runtime.kv.copy_engine import CopyEngine
from hicache.runtime.kv.kv_digest import page_digest
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyModel, from_pages
from hicache.runtime.model.tp_model import head_range
from hicache.runtime.security import peer_auth
from hicache.runtime.security.api_keys import MAX_TENANT_CHARS, OPEN, ApiKeys, Principal
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.security.limits import Gate, Limits, peer_name
from hicache.runtime.storage.base import StorageBackend
from hicache.runtime.tp.tp_group import TPGroup
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire import compat, protocol
from hicache.runtime.wire.prefill_address import PrefillAddress
from hicache.runtime.wire.sampling_fields import check_sampling, draw, seed_for

log = logging.getLogger("hicache.runtime.decode")
MOVED = (
    "restore_batches",
    "restore_bytes",
    "prefetch_batches",
    "prefetch_bytes",
    "backup_bytes",
    "transfer_bytes",
)
SCRATCH_PAGES = 64  # requests in one batched forward (a larger batch takes several)
MAX_ECHOED_RID = 1024  # a refused request's id is echoed in the error when at most this long

# What a broken or misbehaving control connection to prefill raises.
_CONTROL_ERRORS = (
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


@attrs.define(eq=False)
class _Live:
    """A request between its arrival and its answer."""

    rid: str
    prompt: list[int]
    max_new: int
    seed: int
    verify: bool
    arrival: float
    answer: trio.Event = attrs.Factory(trio.Event)
    gen: list[int] = attrs.Factory(list)
    kv_len: int = 0  # tokens whose KV is in the request's L1 pages
    slots: list[int] = attrs.Factory(list)  # its L1 pages while running (StartDecode + ExtendKV)
    running: bool = False
    first_token_at: float = -1.0
    promised: int = -1
    received: dict[int, str] = attrs.Factory(dict)  # page index -> prefill's digest (this admission)
    start_pages: list[dict[str, Any]] = attrs.Factory(list)
    start_kv: bytes = b""
    final_pages: list[str] = attrs.Factory(list)
    outcome: str = ""
    reason: str = ""
    account: dict[str, int] = attrs.Factory(dict)
    sampling: dict[str, Any] = attrs.Factory(dict)  # checked (`sampling.check`); prefill gets it too
    stop_ids: frozenset[int] = frozenset()  # a generated token among these ends the request
    finish_reason: str = ""  # "stop" (a stop token) or "length" (max_new), once Finished
    changed: trio.Event = attrs.Factory(trio.Event)  # set (and replaced) when tokens are added
    seq: int = 0  # TP: its place in arrival order, the same on every rank
    duplicate: bool = False  # TP: the core refused its arrival (an id still in use)
    ranks: list[dict[str, Any]] = attrs.Factory(list)  # TP, rank 0: ranks 1..'s page reports
    prefill_cached: dict[str, int] | None = None  # prompt tokens prefill had cached, by tier

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.gen


@attrs.define
class _Step:
    """One batched decode step: per request, its page table (the current page replaced by a
    scratch page), the partial page to copy into the scratch page first, the position and
    token, and how to draw the next token."""

    tables: list[list[int]] = attrs.Factory(list)
    copies: list[tuple[int, int, int] | None] = attrs.Factory(list)  # (page, scratch, positions)
    positions: list[int] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    sampling: list[dict[str, Any]] = attrs.Factory(list)


class DecodeService:
    def __init__(
        self,
        config: DecodeConfig,
        model: TinyModel,
        layout: KVLayout,
        store: StorageBackend,
        engine: TransferEngine,
        *,
        model_name: str = "tiny",
        tick_interval: float = 0.002,
        transfer_timeout: float = 30.0,
        fence_timeout: float = 5.0,
        device: str = "cpu",
        faults: FaultSpec | None = None,
        check_pages: bool | None = None,
        limits: Limits | None = None,
        secret: ClusterSecret | None = None,
        api_keys: ApiKeys | None = None,
        tp: TPGroup | None = None,
        command_log: TextIO | None = None,
    ) -> None:
        """`check_pages` (default: whenever `faults` are given) verifies every page leaving L2
        against its checksum (pages received from prefill are always checked against prefill's
        digests); `limits` bound what clients may hold; `secret` (default:
        `ClusterSecret.load()`) is what the prefill node must prove it holds, and this node too;
        `api_keys` say who clients are (None: open, see `runtime/security/api_keys.py`). With `tp`, this
        is one rank of a tensor-parallel node (`model` its part, `layout` its heads) run in
        rounds with the others (`runtime/decode/tp_rounds.py`); `command_log` (a text file) records
        every command the core emits, for comparing ranks."""
        if layout.page_size != config.page_size:
            raise ValueError(f"layout page size {layout.page_size} != core page size {config.page_size}")
        if tp is not None and faults is not None and faults.active:
            raise ValueError("fault injection is not supported with --tp-size > 1")
        self.cfg = config
        self.core = DecodeNodeCore(config)
        self.tp = tp
        self.rounds = Rounds(self, tp) if tp is not None else None
        self.command_log = command_log
        self.model = model
        self.layout = layout
        self.faults = RuntimeFaults(faults) if faults is not None and faults.active else None
        self.store: StorageBackend = store if self.faults is None else FaultyStore(store, self.faults)
        self.engine = engine
        self.model_name = model_name
        self.tick_interval = tick_interval
        self.transfer_timeout = transfer_timeout
        self.fence_timeout = fence_timeout
        self.gate = Gate(limits if limits is not None else Limits(), log)
        self.secret = secret if secret is not None else ClusterSecret.load()
        self._prefill_peer: str | None = None  # the prefill engine's name, once a hello named it
        self.api_keys = api_keys
        self.abandoned = 0  # transfers given up on without a fence (their requests failed)
        # Past the core's pages: the decode steps' scratch pages (`_step_plan`), never the core's.
        self.l1 = KVPool(layout, config.l1_pages + SCRATCH_PAGES, device=device, name="L1")
        self._scratch = list(range(config.l1_pages, config.l1_pages + SCRATCH_PAGES))
        self.l2 = KVPool(layout, max(config.l2_pages, 1), name="L2")
        self.region = engine.register("L1", self.l1.bytes_view())
        self.copies = CopyEngine(threads=1)
        self.check_pages = self.faults is not None if check_pages is None else check_pages
        guard = PageGuard(self.l2) if self.check_pages else None
        self.checked = CheckedCopies(self.copies, self.l1, self.l2, guard=guard, faults=self.faults)
        self.live: dict[str, _Live] = {}
        self._nursery: trio.Nursery | None = None
        self._prefill_at = PrefillAddress(("", 0))
        self._prefill: trio.SocketStream | None = None  # None: to be opened by the next transfer
        self._prefill_gen = 0  # counts control connections opened
        self._sent: dict[int, int] = {}  # transfer -> the connection its request went out on, until answered
        self._prefill_lock = trio.Lock()
        self._kv_replies: dict[int, trio.MemorySendChannel] = {}
        self._notifs: dict[int, trio.Event] = {}
        self._prefetches: dict[int, trio.CancelScope] = {}  # prefetch op -> its scope, until it ends
        self._tick_due = trio.Event()
        self._decode_wake = trio.Event()
        self._compute = trio.CapacityLimiter(1)
        self.dispatch = Dispatcher(self.core, self._handlers(), "runtime decode node")
        self.refused_events = 0  # events the core refused (logged and dropped; the node went on)
        # Bytes and batches moved, by kind (the `stats` op reports them for /metrics).
        self.moved: collections.Counter[str] = collections.Counter()

    def _handlers(self) -> dict[type, Callable[[Any], None]]:
        """How each command is executed: I/O in its own task, batch changes at once."""

        def spawn(fn: Callable[[Any], Awaitable[None]]) -> Callable[[Any], None]:
            return lambda c: self._spawn(fn, c)

        table = {
            cmd.QueryStorage: spawn(self._query),
            cmd.Prefetch: self._start_prefetch,
            cmd.CancelPrefetch: self._cancel_prefetch,
            cmd.LoadBack: spawn(self._load),
            cmd.Backup: spawn(self._backup),
            cmd.Store: spawn(self._store),
            cmd.RequestKV: spawn(self._request_kv),
            cmd.SetTimer: spawn(self._timer),
            cmd.Agree: self._agree,
            cmd.StartDecode: self._start,
            cmd.ExtendKV: self._extend,
            cmd.Retract: self._retract,
            cmd.Respond: self._respond,
        }
        if self.rounds is not None:
            table[cmd.SetTimer] = self.rounds.set_timer
            table[cmd.Agree] = self.rounds.agree
        if self.command_log is not None:
            table = {kind: self._logged(fn) for kind, fn in table.items()}
        return table

    def _logged(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """`fn`, after writing its command to the command log (an agreement without its values,
        which are this rank's own)."""

        def run(c: Any) -> None:
            shown = (
                ("Agree", c.agreement, str(c.kind), [k for k, _ in c.values])
                if isinstance(c, cmd.Agree)
                else c
            )
            print(repr(shown), file=self.command_log, flush=True)
            fn(c)

        return run

    @property
    def core_events(self) -> int:
        """Events fed to the core so far."""
        return self.dispatch.events

    # ------------------------------------------------------------------ lifecycle

    async def run(
        self,
        client_port: int,
        prefill: PrefillAddress | tuple[str, int],
        *,
        host: str = "127.0.0.1",
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Connect to the prefill node, then serve clients on `client_port` until cancelled."""
        self._prefill_at = prefill if isinstance(prefill, PrefillAddress) else PrefillAddress(prefill)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._connect_prefill()
                nursery.start_soon(self._notif_loop)
                if self.rounds is not None:
                    await self.tp.ready()  # type: ignore[union-attr]
                    nursery.start_soon(self.rounds.run)
                    if self.tp.rank != 0:  # type: ignore[union-attr]
                        task_status.started(0)  # only rank 0 serves clients
                        return
                else:
                    nursery.start_soon(self._tick_loop)
                    nursery.start_soon(self._decode_loop)
                serve = functools.partial(trio.serve_tcp, self._client, client_port, host=host)
                listeners = await nursery.start(serve)
                task_status.started(listeners[0].socket.getsockname()[1])
        finally:
            with trio.CancelScope(shield=True):
                if self._prefill is not None:
                    await self._prefill.aclose()
                await self.store.aclose()

    async def _connect_prefill(self) -> None:
        """Open the control connection (hello: each side learns the other's transfer engine)."""
        try:
            host, port = self._prefill_at.resolve()  # again each time: it may have moved
        except ValueError as exc:
            raise protocol.ProtocolError(f"no prefill address: {exc}") from None
        stream = await trio.open_tcp_stream(host, port)
        limit = self.gate.limits.frame_timeout_s
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
            mine = compat.profile(self.layout, self.engine, self.model.full_config, shard=self._shard())
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
                if self._prefill_peer not in (None, name):  # a restarted prefill's old engine
                    self.engine.remove_peer(self._prefill_peer)
                self._prefill_peer = name
            except ValueError as exc:  # not hex, or info the engine cannot use
                raise protocol.ProtocolError(
                    f"prefill's hello: bad 'info': {protocol.clip(str(exc))}"
                ) from None
        except BaseException:
            await stream.aclose()
            raise
        self._prefill = stream
        self._prefill_gen += 1
        self._spawn(self._prefill_replies, reader, stream, self._prefill_gen)

    # ------------------------------------------------------------------ clients

    async def _client(self, stream: trio.SocketStream) -> None:
        """Serve one client connection. Whatever it sends ends at most this connection (or, for
        a bad field, only that request), with the reason logged and answered."""
        peer = peer_name(stream)
        try:
            if await self.gate.enter(stream, peer):
                try:
                    await self._serve_client(stream, peer)
                finally:
                    self.gate.leave()
        finally:
            await stream.aclose()

    async def _serve_client(self, stream: trio.SocketStream, peer: str) -> None:
        reader = self.gate.reader(stream, max_binary=0)
        who: Principal | None = OPEN if self.api_keys is None else None  # None: not yet known
        try:
            while True:
                try:
                    msg, _ = await reader.receive()
                except EOFError:
                    return
                try:
                    if msg["op"] == "auth":
                        who = self._authenticate(msg, who, peer)
                        reply = {"op": "auth", "ok": True, "tenant": who.tenant, "admin": who.admin}
                        binary = b""
                    elif msg["op"] == "generate" and who is not None:
                        reply, binary = await self._generate(msg, who, reader, stream)
                    else:
                        reply, binary = await self._answer(msg, who)
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

    async def _answer(self, msg: dict[str, Any], who: Principal | None) -> tuple[dict[str, Any], bytes]:
        """The answer to one client message; `MessageError` for a missing or bad field, or for
        an operation this client's API key does not allow."""
        op = msg["op"]
        if who is None:
            raise protocol.MessageError(
                f"message {protocol.show(op)}: this node needs an API key: send "
                "{'op': 'auth', 'api_key': ...} first"
            )
        if op in ("evict", "idle", "stats", "audit") and not who.admin:
            raise protocol.MessageError(f"message {op!r}: needs an admin API key")
        if op == "peek":  # how much of a prompt this node holds: a cache-aware router asks
            tokens = protocol.int_list(msg, "tokens", high=self.model.config.vocab)
            seed = namespace_seed(self.model_name, self._tenant(msg, who))
            keys = page_keys(np.asarray(tokens, dtype=np.int64), self.cfg.page_size, seed).tolist()
            return {"op": "peek", "pages": self.core.cached_pages(keys), "page_size": self.cfg.page_size}, b""
        if op == "evict":
            l1 = protocol.int_field(msg, "l1") if "l1" in msg else 1 << 40
            l2 = protocol.int_field(msg, "l2") if "l2" in msg else 0
            self._feed(ev.EvictRequested(self._now(), l1, l2))
            return {"op": "evict", "ok": True}, b""
        if op == "idle":
            while not (self.core.idle and not self.live):
                await trio.sleep(self.tick_interval)
            return {"op": "idle", "ok": True}, b""
        if op == "stats":
            reply = {"op": "stats", **attrs.asdict(self.core.stats), **self.gauges()}
            if self.rounds is not None:
                others = await self.rounds.ask("gauges")
                reply["ranks"] = [self.gauges(), *(others[r] for r in sorted(others))]
            return reply, b""
        if op == "audit":
            reply = {"op": "audit", **self.audit()}
            if self.rounds is not None:
                others = await self.rounds.ask("audit")
                reply["ranks"] = [self.audit(), *(others[r] for r in sorted(others))]
            return reply, b""
        if op == "config":  # what this node runs with: a front door records it with a trace
            if not who.admin:
                raise protocol.MessageError("message 'config': needs an admin API key")
            store = getattr(self.store, "inner", self.store)  # the real store under injected faults
            capacity = getattr(store, "capacity_bytes", None)
            return {
                "op": "config",
                "model": self.model_name,
                "config": {k: getattr(v, "value", v) for k, v in attrs.asdict(self.cfg).items()},
                "layout": {**attrs.asdict(self.layout), "page_bytes": self.layout.page_bytes},
                "storage": {
                    "kind": type(store).__name__ if self.cfg.storage else None,
                    "capacity_bytes": capacity or None,
                    "capacity_pages": getattr(store, "capacity_pages", None) or None,
                },
            }, b""
        return {"op": "error", "reason": f"unknown op {protocol.show(op)}"}, b""

    def gauges(self) -> dict[str, int]:
        """What the node holds and has moved now: requests by stage, pages per tier, bytes."""
        audit = self.core.audit()
        running = sum(live.running for live in self.live.values())
        return {
            "requests_running": running,
            "requests_waiting": len(self.live) - running,
            "l1_pages_used": self.cfg.l1_pages - audit["l1_free"],
            "l1_pages": self.cfg.l1_pages,
            "l2_pages_used": self.cfg.l2_pages - audit["l2_free"] if self.cfg.l2_pages else 0,
            "l2_pages": self.cfg.l2_pages,
            # The longest prompt the node can ever admit (its L1 less the decode reserve).
            "max_prompt_tokens": (self.cfg.l1_pages - self.cfg.decode_reserve_pages) * self.cfg.page_size,
            **{key: self.moved[key] for key in MOVED},
        }

    def audit(self) -> dict[str, Any]:
        """What the node holds (slots by owner, locks, pins: `DecodeNodeCore.audit`), whether
        its invariants hold, and the faults injected and caught so far."""
        try:
            self.core.check()
            check = "ok"
        except CoreError as exc:
            check = str(exc)
        out: dict[str, Any] = {**self.core.audit(), "check": check, "refused_events": self.refused_events}
        if self.faults is not None:
            out["faults_injected"] = dict(sorted(self.faults.injected.items()))
            out["faults_caught"] = dict(sorted(self.faults.caught.items()))
        return out

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
        sampling = check_sampling(msg.get("sampling"), self.model.config.vocab)
        if sampling["seed"] is None:
            sampling["seed"] = seed_for(rid)
        duplicate = {"op": "result", "rid": rid, "outcome": "failed", "reason": "duplicate request id"}
        if rid in self.live:
            return duplicate, b""
        seed = namespace_seed(self.model_name, tenant)
        live = _Live(rid, prompt, max_new, seed, verify, self._now(), sampling=sampling)
        stops = set(sampling.get("stop_token_ids", ()))
        if not sampling.get("ignore_eos"):
            stops |= set(getattr(self.model, "eos_token_ids", ()))
        live.stop_ids = frozenset(stops)
        keys = page_keys(np.asarray(prompt, dtype=np.int64), self.cfg.page_size, seed).tolist()
        self.live[rid] = live
        if self.rounds is not None:
            self.rounds.arrive(live, keys)  # every rank feeds it in the next round
        else:
            try:
                self._feed(ev.RequestArrived(live.arrival, rid, len(prompt), keys), refuse=True)
            except CoreError:  # the core still keeps an ended request of that id (I/O in flight)
                del self.live[rid]
                return duplicate, b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, live, reader)
            if streaming:
                nursery.start_soon(self._stream_tokens, live, stream)
            await live.answer.wait()
            nursery.cancel_scope.cancel()
        del self.live[rid]
        if live.duplicate:
            return duplicate, b""
        # The core drops it once no I/O refers to it any more.
        self._feed(ev.ForgetRequested(self._now(), rid))
        self._log_request(live)
        reply = {
            "op": "result",
            "rid": rid,
            "outcome": live.outcome,
            "reason": live.reason,
            "tokens": live.gen,
            "ttft_s": live.first_token_at - live.arrival if live.first_token_at >= 0 else None,
            "e2e_s": self._now() - live.arrival,
            "promised_tokens": max(live.promised, 0),
            "finish_reason": live.finish_reason or ("abort" if live.outcome == "aborted" else ""),
            "account": live.account,
            "start_pages": live.start_pages,
            "final_pages": live.final_pages,
            "prefill_cached": live.prefill_cached or {},
        }
        if self.tp is not None:  # each rank's pages hold its heads: the ledger checks them per rank
            reply["tp_ranks"] = [
                {"start_pages": r["start_pages"], "final_pages": r["final_pages"]} for r in live.ranks
            ]
            if live.verify and live.start_kv:
                return reply, self._whole_kv(live)
        return reply, live.start_kv

    def _log_request(self, live: _Live) -> None:
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

    async def _watch(self, live: _Live, reader: protocol.FrameReader) -> None:
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

    async def _stream_tokens(self, live: _Live, stream: trio.SocketStream) -> None:
        """Send each token as soon as it exists; a client that does not take them is gone."""
        sent = 0
        while True:
            changed = live.changed
            if len(live.gen) > sent:
                frame: dict[str, Any] = {"op": "tokens", "rid": live.rid, "tokens": live.gen[sent:]}
                if not sent and live.account:  # where the prompt's KV came from, known at start
                    frame["account"] = live.account
                sent = len(live.gen)
                try:
                    await self.gate.send(stream, frame)
                except (protocol.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                    self._abort(live, "the client stopped reading its tokens")
                    return
            await changed.wait()

    def _abort(self, live: _Live, reason: str) -> None:
        if not live.answer.is_set():
            log.info("request %s: %s; aborting it", protocol.show(live.rid), reason)
            self._feed(ev.AbortRequested(self._now(), live.rid, reason))

    def _tokens_added(self, live: _Live) -> None:
        live.changed.set()
        live.changed = trio.Event()

    # ------------------------------------------------------------------ feeding the core

    def _now(self) -> float:
        return trio.current_time()

    def _feed(self, event: ev.Event, *, refuse: bool = False) -> None:
        """Feed the core and execute its commands; the first event since the last tick asks
        the tick loop for the next one. A refused event changes nothing in the core, so it is
        logged and dropped (an arrival's caller asks with `refuse` to answer it instead): what a
        peer's late or doubled answer makes the driver feed never stops the node. A TP rank
        feeds all but its decode steps' events in its next round (`runtime/decode/tp_rounds.py`)."""
        if self.rounds is not None:
            if self.rounds.feed(event):
                return
            event = attrs.evolve(event, at=self.rounds.now)  # a decode step's: the round's time
        self._feed_now(event, refuse=refuse)

    def _feed_now(self, event: ev.Event, *, refuse: bool = False) -> None:
        try:
            tick = self.dispatch.feed(event)
        except CoreError as exc:
            if refuse:
                raise
            log.error("the core refused %s: %s", type(event).__name__, exc)
            self.refused_events += 1
            return
        if tick and self.rounds is None:
            self._tick_due.set()

    async def _tick_loop(self) -> None:
        while True:
            await self._tick_due.wait()
            self._tick_due = trio.Event()
            await trio.sleep(self.tick_interval)
            self._feed(ev.Tick(self._now()))

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    def _agree(self, c: cmd.Agree) -> None:
        raise NotImplementedError(f"a single-rank decode node does not execute {type(c).__name__}")

    # ------------------------------------------------------------------ command executors

    async def _query(self, c: cmd.QueryStorage) -> None:
        hits = []
        for rid, keys in c.queries:
            hits.append((rid, await self.store.exists(list(keys)) if keys else 0))
        self._feed(ev.StorageQueried(self._now(), c.op, tuple(hits)))

    def _start_prefetch(self, c: cmd.Prefetch) -> None:
        # The scope exists before the task starts, so a cancel that comes first still counts.
        scope = self._prefetches[c.op] = trio.CancelScope()
        self._spawn(self._prefetch, c, scope)

    def _cancel_prefetch(self, c: cmd.CancelPrefetch) -> None:
        """Stop the read; the prefetch still answers, with what landed (an ended op: ignored)."""
        scope = self._prefetches.get(c.op)
        if scope is not None:
            scope.cancel()

    async def _prefetch(self, c: cmd.Prefetch, scope: trio.CancelScope) -> None:
        """Read the pages from L3 until done or cancelled; then report the pages that landed.

        `get` returns or raises only once nothing it started can write to the host slots (a
        read in a worker thread is waited for), and reports pages as they land, so
        `PrefetchDone` is exact and comes after the last byte."""
        landed = 0
        self.moved["prefetch_batches"] += 1

        def progress(pages: int) -> None:
            nonlocal landed
            landed = pages

        try:
            with scope:
                landed = await self.store.get(list(c.keys), self.l2, list(c.host_slots), progress=progress)
            with trio.CancelScope(shield=True):  # the guard must learn what landed, whatever comes
                await self.checked.prefetched(c.host_slots, landed)
        finally:
            del self._prefetches[c.op]
        self.moved["prefetch_bytes"] += landed * self.layout.page_bytes
        self._feed(ev.PrefetchDone(self._now(), c.op, landed))

    async def _load(self, c: cmd.LoadBack) -> None:
        failed = await self.checked.load(c)
        self.moved["restore_batches"] += 1
        self.moved["restore_bytes"] += (len(c.device_slots) - len(failed)) * self.layout.page_bytes
        self._feed(ev.LoadDone(self._now(), c.op, failed))

    async def _backup(self, c: cmd.Backup) -> None:
        failed = await self.checked.backup(c)
        self.moved["backup_bytes"] += (len(c.device_slots) - len(failed)) * self.layout.page_bytes
        self._feed(ev.BackupDone(self._now(), c.op, failed))

    async def _store(self, c: cmd.Store) -> None:
        """Write the pages that still check out; report every page L3 does not hold after."""
        keep = await self.checked.storable(c.host_slots)
        missed: list[int] = []
        if keep:
            keys, slots = [c.keys[i] for i in keep], [c.host_slots[i] for i in keep]
            try:
                missed = [keep[i] for i in await self.store.put(keys, self.l2, slots)]
            except Exception:  # noqa: BLE001 - a store that fails holds none of them for sure
                missed = keep
        kept = set(keep) - set(missed)
        failed = tuple(i for i in range(len(c.keys)) if i not in kept)
        self._feed(ev.StoreDone(self._now(), c.op, failed))

    async def _timer(self, c: cmd.SetTimer) -> None:
        d = self.faults.take("timer", c.timer) if self.faults is not None else None
        if d is not None:
            self.faults.applied(d)  # type: ignore[union-attr]
        if d is None or d.kind == "delay":
            await trio.sleep_until(c.at + (d.delay if d is not None else 0.0))
        self._feed(ev.TimerFired(self._now(), c.timer))

    async def _request_kv(self, c: cmd.RequestKV) -> None:
        live = self.live[c.req]
        if live.promised < 0:
            live.promised = c.start
        prompt_len = c.prompt_len  # the prompt of this admission
        page = self.cfg.page_size
        faults = self.faults
        d = faults.take("transfer", c.transfer) if faults is not None else None
        if faults is not None and d is not None:
            await faults.delay(d)
            if d.kind == "error":
                faults.applied(d)
                self._feed(ev.KVFailed(self._now(), c.req, c.transfer, "prefill transfer error (injected)"))
                return
        end, dst = c.end, list(c.dst_slots)
        if faults is not None and d is not None and d.kind == "partial" and dst:  # prefill sends a prefix
            faults.applied(d)
            k = d.prefix(len(dst))
            end, dst = min(c.end, c.start + k * page), dst[:k]
        send, receive = trio.open_memory_channel[dict](1)
        self._kv_replies[c.transfer] = send
        arrived = self._notifs.setdefault(c.transfer, trio.Event())
        msg = {
            "op": "kv",
            "tid": c.transfer,
            **({"heads": list(self._heads)} if self.tp is not None else {}),
            "tokens": live.tokens[:prompt_len],
            "namespace": live.seed,  # prefill reuses work only within one tenant's namespace
            "sampling": live.sampling,  # prefill draws the first token as the decode node draws the rest
            "start": c.start,
            "end": end,
            "dst": dst,
        }
        reason = ""
        reply: dict = {}
        with trio.move_on_after(self.transfer_timeout) as scope:
            try:
                gen = await self._send_control(c.transfer, msg)
                reply = await receive.receive()
                if reply.get("ok"):
                    await arrived.wait()
                if faults is not None and d is not None and d.kind == "peer_death":
                    faults.applied(d)
                    await self._cut_prefill(gen)
                    reason = "prefill connection lost before the transfer was confirmed (injected)"
            except _CONTROL_ERRORS as exc:
                reason = f"prefill connection lost: {exc or type(exc).__name__}"
        self._sent.pop(c.transfer, None)
        self._kv_replies.pop(c.transfer, None)
        self._notifs.pop(c.transfer, None)
        if scope.cancelled_caught:
            reason = f"no KV from prefill within {self.transfer_timeout} s"
        elif not reason and not reply.get("ok"):
            reason = str(reply.get("reason", "prefill failed"))
        elif not reason and end < c.end:
            reason = f"prefill sent {len(dst)} of {len(c.dst_slots)} pages (injected)"
        if not reason and reply.get("ok"):
            reason = self._bad_reply(reply, len(dst))
            if reason:
                log.warning("transfer %d failed: %s", c.transfer, reason)
        if not reason:  # always: a page that is not what prefill sent is never served
            if faults is not None and d is not None and d.kind == "corrupt" and dst:
                faults.applied(d)
                i, offset = flip_offset(d, len(dst), self.layout.page_bytes)
                flip_page_byte(self.l1, dst[i], offset)
            reason = self._check_received(dst, reply["digests"], c.start // page)
        if reason and not arrived.is_set() and not await self._fence(c.transfer, answered=bool(reply)):
            # Its bytes may still land: the request fails and its pages stay with the transfer.
            self.abandoned += 1
            self._feed(ev.KVAbandoned(self._now(), c.req, c.transfer, f"{reason}; not fenced"))
            self._notifs[c.transfer] = arrived
            self._spawn(self._settle_abandoned, c.transfer, c.req, arrived)
            return
        if reason:
            self._feed(ev.KVFailed(self._now(), c.req, c.transfer, reason))
            return
        self.moved["transfer_bytes"] += len(dst) * self.layout.page_bytes
        if live.prefill_cached is None:  # the request's first prefill, not a fallback's
            live.prefill_cached = _cached_tokens(reply.get("cached"))
        for j, digest in enumerate(reply["digests"]):
            live.received[c.start // page + j] = digest
        if not live.gen:
            live.gen.append(int(reply["first_token"]))
            self._tokens_added(live)
        self._feed(ev.KVArrived(self._now(), c.req, c.transfer))

    async def _send_control(self, tid: int, msg: dict[str, Any]) -> int:
        """Send `msg` about transfer `tid` to prefill (connecting first if needed); returns the
        connection it went out on, which answers it or, when it breaks, closes its wait."""
        async with self._prefill_lock:
            if self._prefill is None:
                await self._connect_prefill()
            await protocol.send(self._prefill, msg)  # type: ignore[arg-type]
            gen = self._sent[tid] = self._prefill_gen
        return gen

    async def _fence(self, tid: int, *, answered: bool) -> bool:
        """Make sure no more bytes of transfer `tid` land in L1; False if that cannot be shown.

        The engine fences by itself where it reads every byte (TCP). Otherwise prefill's answer
        is the fence, since it answers only once its WRITE settled; without one, prefill is asked
        to cancel the transfer and confirm."""
        if await self.engine.fence(f"kv:{tid}".encode()):
            return True
        return answered or await self._cancel_at_prefill(tid)

    async def _cancel_at_prefill(self, tid: int) -> bool:
        """Ask prefill to cancel transfer `tid`; True once it confirms that its WRITE settled."""
        send, receive = trio.open_memory_channel[dict](4)
        self._kv_replies[tid] = send
        try:
            with trio.move_on_after(self.fence_timeout):
                await self._send_control(tid, {"op": "cancel", "tid": tid})
                while True:
                    msg = await receive.receive()
                    if msg.get("op") in ("cancelled", "kv"):  # a late answer also comes after settling
                        return True
        except _CONTROL_ERRORS:
            pass
        finally:
            self._sent.pop(tid, None)
            self._kv_replies.pop(tid, None)
        return False

    async def _settle_abandoned(self, tid: int, req: str, arrived: trio.Event) -> None:
        """Keep asking prefill to settle an abandoned transfer; its pages are freed once it has
        (or once its notification shows the WRITE completed)."""
        wait = self.fence_timeout
        while not arrived.is_set():
            if await self._cancel_at_prefill(tid):
                break
            with trio.move_on_after(wait):
                await arrived.wait()
            wait = min(wait * 2, 60.0)
        self._notifs.pop(tid, None)
        self._feed(ev.KVFailed(self._now(), req, tid, "abandoned transfer settled"))

    def _bad_reply(self, reply: dict[str, Any], pages: int) -> str:
        """Why prefill's `ok` answer cannot be used ("" if it can): a peer's fields are checked
        like a client's, and a bad one fails the transfer instead of the node."""
        digests = reply.get("digests")
        if not (
            isinstance(digests, list) and len(digests) == pages and all(isinstance(d, str) for d in digests)
        ):
            got = protocol.show(digests)
            return f"prefill's answer: field 'digests' must be a list of {pages} strings, got {got}"
        token = reply.get("first_token")
        if type(token) is not int or not 0 <= token < self.model.config.vocab:
            return f"prefill's answer: field 'first_token' must be a token id, got {protocol.show(token)}"
        return ""

    def _check_received(self, dst: list[int], digests: list[str], first: int) -> str:
        """Why the pages a transfer wrote are not what prefill says it sent ("" if they are)."""
        for j, digest in enumerate(digests):
            if page_digest(self.l1.data[dst[j]]) != digest:
                if self.faults is not None:
                    self.faults.caught["received_page_rejected"] += 1
                return f"received page {first + j} differs from what prefill sent"
        return ""

    async def _cut_prefill(self, gen: int) -> None:
        """Close control connection `gen` as a dying peer would, at a point where no transfer
        sent on it is unanswered: no WRITE can land after its transfer is reported failed."""
        async with self._prefill_lock:  # nothing new goes out meanwhile
            while any(g == gen for g in self._sent.values()):
                await trio.sleep(self.tick_interval)
            if self._prefill is not None and self._prefill_gen == gen:
                stream, self._prefill = self._prefill, None
                await stream.aclose()

    async def _prefill_replies(
        self, reader: protocol.FrameReader, stream: trio.SocketStream, gen: int
    ) -> None:
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
                if self._prefill is stream:
                    self._prefill = None  # the next transfer opens a new connection
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
                for tid, g in list(self._sent.items()):
                    send = self._kv_replies.get(tid)
                    if g == gen and send is not None:
                        send.close()
                return
            if self._sent.get(tid) == gen:
                del self._sent[tid]
            send = self._kv_replies.get(tid)
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
            arrived = self._notifs.get(int(tid))
            if arrived is not None:  # else its transfer was given up on and fenced
                arrived.set()

    # ------------------------------------------------------------------ decoding

    def _start(self, c: cmd.StartDecode) -> None:
        live = self.live[c.req]
        live.kv_len = c.prompt_len
        live.slots = list(c.device_slots)
        live.account = c.account.as_dict()
        slots = torch.tensor(c.device_slots, dtype=torch.int64)
        pages = self.l1.data[slots]
        if live.first_token_at < 0:
            live.first_token_at = c.ready_at  # its KV was complete then; the batch may have been full
            page = self.cfg.page_size
            tokens = np.asarray(live.tokens[: c.prompt_len], dtype=np.int64)
            keys = page_keys(tokens, page, live.seed).tolist()  # the keys the core gave its pages
            live.start_pages = [
                {
                    "key": keys[i] if i < len(keys) else None,
                    "digest": page_digest(pages[i]),
                    "source": "prefill" if i in live.received else "cache",
                    "sent": live.received.get(i),
                }
                for i in range(math.ceil(live.kv_len / page))
            ]
            if live.verify:
                live.start_kv = from_pages(pages.cpu(), live.kv_len).contiguous().numpy().tobytes()
        live.received = {}
        live.running = True
        self._decode_wake.set()

    def _extend(self, c: cmd.ExtendKV) -> None:
        live = self.live[c.req]
        del live.slots[c.first_page :]
        live.slots.extend(c.device_slots)

    def _retract(self, c: cmd.Retract) -> None:
        live = self.live[c.req]
        live.running = False
        live.slots = []

    def _finish_done(self, batch: list[_Live], now: float) -> list[_Live]:
        """Feed `Finished` for the requests of `batch` that drew a stop token or reached
        `max_new`, in batch order; the ones still running."""
        for live in batch:
            if live.gen and live.gen[-1] in live.stop_ids:
                live.finish_reason = "stop"
            elif len(live.gen) >= live.max_new:
                live.finish_reason = "length"
            else:
                continue
            live.running = False
            self._feed(ev.Finished(now, live.rid))
        return [x for x in batch if x.running]

    async def _decode_loop(self) -> None:
        """One decode step for every running request per iteration, computed off the loop."""
        while True:
            batch = [x for x in self.live.values() if x.running]
            if not batch:
                await self._decode_wake.wait()
                self._decode_wake = trio.Event()
                continue
            batch = self._finish_done(batch, self._now())
            if not batch:
                continue
            for first in range(0, len(batch), len(self._scratch)):
                part = batch[first : first + len(self._scratch)]
                step = self._step_plan(part)
                tokens = await trio.to_thread.run_sync(self._step, step, limiter=self._compute)
                for live, scratch, token in zip(part, self._scratch, tokens, strict=False):
                    if live.running:
                        self._advance(live, scratch, token)

    def _step_plan(self, batch: list[_Live]) -> _Step:
        """What one batched step reads, taken on the event loop (slots change only here).

        Each request's current page is stood in for by a scratch page of its own, which the
        step copies the page's earlier positions into and writes the new position's K/V into:
        the step never writes a page the core owns, so a request aborted meanwhile (its pages
        freed and maybe reused) loses nothing but its own result. `_advance` copies the new K/V
        into the request's page once the core has granted it."""
        page = self.cfg.page_size
        step = _Step()
        for live, scratch in zip(batch, self._scratch, strict=False):
            pos = live.kv_len
            full, offset = divmod(pos, page)
            step.copies.append((live.slots[full], scratch, offset) if offset else None)
            step.tables.append([*live.slots[:full], scratch])
            step.positions.append(pos)
            step.tokens.append(live.tokens[pos])
            step.sampling.append(live.sampling)
        return step

    def _step(self, step: _Step) -> list[int]:
        """One forward for the whole batch (in a worker thread), and the next token of each."""
        data = self.l1.data
        for copy in step.copies:
            if copy is not None:
                src, dst, offset = copy
                data[dst, :, :, :offset] = data[src, :, :, :offset]
        logits = self.model.decode_batch(data, step.tables, step.positions, step.tokens)
        return draw(logits, step.sampling, [p + 1 for p in step.positions])

    def _advance(self, live: _Live, scratch: int, token: int) -> None:
        """The step's token KV exists: tell the core (it grants the page), then copy it there."""
        page = self.cfg.page_size
        pos = live.kv_len
        seq = live.tokens
        new_keys: list[int] = []
        if (pos + 1) % page == 0:
            keys = page_keys(np.asarray(seq[: pos + 1], dtype=np.int64), page, live.seed)
            new_keys = [int(keys[-1])]
        self._feed(ev.Decoded(self._now(), live.rid, 1, new_keys))
        if not live.running:
            # Retracted by its own growth: this step's KV got no page, but its token stands; on
            # resume the token at `pos` is part of the prompt whose KV prefill or the cache gives.
            live.gen.append(token)
            self._tokens_added(live)
            return
        slot = live.slots[pos // page]  # granted by an ExtendKV while the core took the Decoded
        self.l1.data[slot, :, :, pos % page] = self.l1.data[scratch, :, :, pos % page]
        live.kv_len = pos + 1
        live.gen.append(token)
        self._tokens_added(live)

    def _respond(self, c: cmd.Respond) -> None:
        live = self.live[c.req]
        live.account = c.account.as_dict()
        live.outcome, live.reason = str(c.outcome), c.reason
        if c.outcome == "finished" and live.kv_len:
            full = live.slots[: live.kv_len // self.cfg.page_size]  # the tree's now, unchanged yet
            live.final_pages = [page_digest(p) for p in self.l1.data[torch.tensor(full, dtype=torch.int64)]]
        live.running = False
        live.slots = []
        if self.tp is None:
            live.answer.set()
        elif self.tp.rank == 0:
            self.rounds.release(c.req)  # type: ignore[union-attr]
        else:  # what rank 0's reply needs of this rank
            info = {"start_pages": live.start_pages, "final_pages": live.final_pages, "kv": live.start_kv}
            self.rounds.report(c.req, info)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ tensor parallelism

    @property
    def _heads(self) -> tuple[int, int]:
        assert self.tp is not None
        return head_range(self.model.full_config, self.tp.rank, self.tp.size)

    def _shard(self) -> dict[str, Any] | None:
        """This rank's place in its TP group, for the hello's profile (None: one rank)."""
        if self.tp is None:
            return None
        return {"rank": self.tp.rank, "size": self.tp.size, "heads": list(self._heads)}

    def new_live(self, rid: str, fields: dict[str, Any]) -> _Live:
        """Ranks 1..: a request rank 0's client sent, with the data rank 0 passed on."""
        live = _Live(rid, **fields)
        self.live[rid] = live
        return live

    def local_answer(self, what: str) -> dict[str, Any]:
        """This rank's answer to rank 0's `stats` ("gauges") or `audit`."""
        return self.gauges() if what == "gauges" else self.audit()

    def _whole_kv(self, live: _Live) -> bytes:
        """Rank 0: the request's KV over all heads, from each rank's part (heads are axis 3)."""
        shape = (self.layout.layers, 2, -1, self.layout.kv_heads, self.layout.head_dim)
        dtype = self.layout.torch_dtype
        parts = [live.start_kv, *(r["kv"] for r in live.ranks)]
        tensors = [torch.frombuffer(bytearray(p), dtype=dtype).view(shape) for p in parts]
        return torch.cat(tensors, dim=3).contiguous().numpy().tobytes()

    async def tp_decode_step(self) -> None:
        """One decode step of a round: every rank steps the same batch in the same order (the
        model's all-reduces pair up), and feeds the same `Finished` and `Decoded` events."""
        batch = sorted((x for x in self.live.values() if x.running), key=lambda x: x.seq)
        batch = self._finish_done(batch, self.rounds.now)  # type: ignore[union-attr]
        for first in range(0, len(batch), len(self._scratch)):
            part = batch[first : first + len(self._scratch)]
            step = self._step_plan(part)
            tokens = await self.tp.decode_step(functools.partial(self._step, step))  # type: ignore[union-attr]
            for live, scratch, token in zip(part, self._scratch, tokens, strict=False):
                if live.running:
                    self._advance(live, scratch, token)


def _cached_tokens(value: object) -> dict[str, int]:
    """A `kv` reply's `cached` field (tokens per prefill tier) as far as it makes sense."""
    if not isinstance(value, dict):
        return {}
    return {
        k: v
        for k, v in value.items()
        if k in ("l1", "l2", "l3") and isinstance(v, int) and not isinstance(v, bool) and v >= 0
    }
