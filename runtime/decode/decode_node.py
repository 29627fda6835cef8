"""The decode node: a trio service that runs the core and executes its commands for real.

It makes no cache decision of its own, and reads nothing of the core but what its commands
carry. It is made of parts that share one feed to the core (`Feed`: the core's `Dispatcher`,
executing every command through the one table `_handlers` builds) and never call back into the
service:

- the live-request table (`live.LiveTable`);
- client connections (`clients.Clients`), which add requests and answer them;
- the prefill link (`prefill_link.PrefillLink`) and the transfers over it
  (`transfers.Transfers`: KV increments that WRITE into L1 pages, checked against prefill's
  digests);
- restores and copies (`restores.Restores`: L3 queries, prefetches and stores, load-backs and
  backups on the copy engine, timers);
- the decode batch (`batch.Batch`: one batched forward per step for every running request);
- with `--tp-size N`, the lockstep rounds of the ranks (`hicache.runtime.tp.tp_rounds.Rounds`),
  which take every event but a decode step's for the next round; only rank 0 serves clients;
- what the node reports about itself (`status.Status`).

The service builds them, opens the one nursery every task runs in, and starts each command's
I/O there. With a `FaultSpec` it also injects faults into its own operations, as wrappers around
the parts' store, copies and transfers (`runtime/decode/faults.py`, `runtime/decode/injected.py`),
and checks L2 pages against the checksums taken when they were written.

For verification the reply carries, per page of the KV the request had before its first decode
step, the digest of its bytes and where it came from (restored from the cache, or sent by
prefill with prefill's own digest), the digests of its final pages, and optionally the
assembled KV itself.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import trio

from hicache.core import commands as cmd
from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.faults import FaultSpec
from hicache.runtime.decode.batch import Batch
from hicache.runtime.decode.clients import Clients
from hicache.runtime.decode.faults import CheckedCopies, FaultyStore, PageGuard, RuntimeFaults
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.injected import FaultHooks, InjectedFaults
from hicache.runtime.decode.live import Live, LiveTable
from hicache.runtime.decode.prefill_link import PrefillLink
from hicache.runtime.decode.restores import Restores
from hicache.runtime.decode.status import Status
from hicache.runtime.decode.transfers import Transfers
from hicache.runtime.kv.copy_engine import CopyEngine
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.model.llama import TinyModel
from hicache.runtime.model.tp_model import head_range
from hicache.runtime.security.api_keys import ApiKeys
from hicache.runtime.security.cluster_secret import ClusterSecret
from hicache.runtime.security.limits import Gate, Limits
from hicache.runtime.storage.base import StorageBackend
from hicache.runtime.tp.tp_group import TPGroup
from hicache.runtime.tp.tp_rounds import Rounds
from hicache.runtime.transfer.base import TransferEngine
from hicache.runtime.wire.prefill_address import PrefillAddress

log = logging.getLogger("hicache.runtime.decode")
SCRATCH_PAGES = 64  # requests in one batched forward (a larger batch takes several)


class DecodeService:
    """A decode node: builds its parts around one `Feed`, executes the core's commands through
    them, and runs their tasks in the one nursery `run` opens."""

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
        transfer_timeout: float = 60.0,
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
        """`transfer_timeout`: seconds prefill may stay silent about a transfer (no progress,
        no answer) before it is given up on (`Transfers`). `check_pages` (default: whenever
        `faults` are given) verifies every page leaving L2 against its checksum (pages received
        from prefill are always checked against prefill's digests); `limits` bound what clients
        may hold; `secret` (default: `ClusterSecret.load()`) is what the prefill node must prove
        it holds, and this node too; `api_keys` say who clients are (None: open, see
        `runtime/security/api_keys.py`). With `tp`, this is one rank of a tensor-parallel node
        (`model` its part, `layout` its heads) run in rounds with the others
        (`runtime/tp/tp_rounds.py`); `command_log` (a text file) records every command the core
        emits, for comparing ranks."""
        if layout.page_size != config.page_size:
            raise ValueError(f"layout page size {layout.page_size} != core page size {config.page_size}")
        if tp is not None and faults is not None and faults.active:
            raise ValueError("fault injection is not supported with --tp-size > 1")
        self.cfg = config
        self.core = DecodeNodeCore(config)
        self.tp = tp
        self.command_log = command_log
        self.model = model
        self.layout = layout
        self.engine = engine
        self.model_name = model_name
        self.faults = RuntimeFaults(faults) if faults is not None and faults.active else None
        hooks = FaultHooks() if self.faults is None else InjectedFaults(self.faults)
        if self.faults is not None:
            store = FaultyStore(store, self.faults)
        self.gate = Gate(limits if limits is not None else Limits(), log)
        secret = secret if secret is not None else ClusterSecret.load()
        # Past the core's pages: the decode steps' scratch pages (`Batch`), never the core's. Host
        # memory is held as pages are first written (lazy), as what L1 caches grows. With L1 on
        # a GPU, L2 is pinned so load-backs and backups are asynchronous DMA; with L1 on the host,
        # pinning would only touch every page of L2 at start.
        self.l1 = KVPool(layout, config.l1_pages + SCRATCH_PAGES, device=device, name="L1", lazy=True)
        l2_pages = max(config.l2_pages, 1)  # filled by backups
        self.l2 = KVPool(layout, l2_pages, pinned=self.l1.is_cuda, name="L2", lazy=True)
        self.region = engine.register("L1", self.l1.bytes_view())
        self.check_pages = self.faults is not None if check_pages is None else check_pages
        guard = PageGuard(self.l2) if self.check_pages else None
        checked = CheckedCopies(CopyEngine(threads=1), self.l1, self.l2, guard=guard, faults=self.faults)
        self.moved: collections.Counter[str] = collections.Counter()  # bytes and batches, by kind

        self.live = LiveTable()
        self.feed = Feed(self.core, tick_interval=tick_interval)
        self.rounds: Rounds | None = None
        if tp is not None:
            self.rounds = Rounds(tp, self.feed, self.live, self.core, tick_interval=tick_interval)
        self.feed.divert = self.rounds
        heads = list(head_range(model.full_config, tp.rank, tp.size)) if tp is not None else None
        shard = {"rank": tp.rank, "size": tp.size, "heads": heads} if tp is not None else None
        self.link = PrefillLink(
            engine, layout, model, secret, frame_timeout=self.gate.limits.frame_timeout_s, shard=shard
        )
        self.transfers = Transfers(
            self.feed,
            self.live,
            self.link,
            engine,
            self.l1,
            self.moved,
            page_size=config.page_size,
            vocab=model.config.vocab,
            heads=heads,
            faults=hooks,
            transfer_timeout=transfer_timeout,
            fence_timeout=fence_timeout,
        )
        self.restores = Restores(self.feed, store, self.l2, checked, self.moved, hooks)
        self.batch = Batch(
            self.feed,
            self.live,
            self.l1,
            model,
            page_size=config.page_size,
            scratch=list(range(config.l1_pages, config.l1_pages + SCRATCH_PAGES)),
            answered=_answer_client if self.rounds is None else self.rounds.responded,
        )
        self.status = Status(
            self.core,
            self.feed,
            self.live,
            self.moved,
            faults=self.faults,
            layout=layout,
            model_name=model_name,
            store=store,
            rounds=self.rounds,
        )
        self.clients = Clients(
            self.feed,
            self.live,
            self.core,
            self.status,
            self.gate,
            model,
            layout,
            model_name=model_name,
            api_keys=api_keys,
            rounds=self.rounds,
        )
        if self.rounds is not None and tp is not None:
            step = self.batch.step_in_order
            self.rounds.attach(lambda now: step(now, tp.decode_step), self.status.local)
        self.dispatch = self.feed.attach(self._handlers(), "runtime decode node")
        self._nursery: trio.Nursery | None = None  # open while `run` runs: every command's task

    def _handlers(self) -> dict[type, Callable[[Any], None]]:
        """How each command is executed: I/O in its own task, batch changes at once."""

        def spawn(fn: Callable[[Any], Awaitable[None]]) -> Callable[[Any], None]:
            return lambda c: self._spawn(fn, c)

        restores, batch = self.restores, self.batch
        table = {
            cmd.QueryStorage: spawn(restores.query),
            cmd.Prefetch: lambda c: self._spawn(restores.prefetch, c, restores.open_prefetch(c)),
            cmd.CancelPrefetch: restores.cancel_prefetch,
            cmd.LoadBack: spawn(restores.load),
            cmd.Backup: spawn(restores.backup),
            cmd.Store: spawn(restores.put),
            cmd.RequestKV: spawn(self.transfers.request_kv),
            cmd.SetTimer: spawn(restores.timer),
            cmd.Agree: _agree,
            cmd.StartDecode: batch.start,
            cmd.ExtendKV: batch.extend,
            cmd.Retract: batch.retract,
            cmd.Respond: self._respond,
        }
        if self.rounds is not None:
            table[cmd.SetTimer] = self.rounds.set_timer
            table[cmd.Agree] = self.rounds.agree
        if self.command_log is not None:
            table = {kind: self._logged(fn) for kind, fn in table.items()}
        return table

    def _respond(self, c: cmd.Respond) -> None:
        """Answer the request; transfers still in flight for it are cancelled, on prefill too."""
        self.batch.respond(c)
        self.transfers.request_ended(c.req)

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

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        assert self._nursery is not None, "a command's task starts only while the service runs"
        self._nursery.start_soon(fn, *args)

    # ------------------------------------------------------------------ what others read

    @property
    def store(self) -> StorageBackend:
        """The L3 store the node reads and writes (wrapped by `FaultyStore` under faults)."""
        return self.restores.store

    @store.setter
    def store(self, store: StorageBackend) -> None:
        self.restores.store = self.status.store = store

    @property
    def core_events(self) -> int:
        """Events fed to the core so far."""
        return self.feed.events

    @property
    def refused_events(self) -> int:
        """Events the core refused (logged and dropped; the node went on)."""
        return self.feed.refused_events

    @property
    def abandoned(self) -> int:
        """Transfers given up on without a fence (their requests failed)."""
        return self.transfers.abandoned

    def gauges(self) -> dict[str, int]:
        return self.status.gauges()

    def audit(self) -> dict[str, Any]:
        return self.status.audit()

    # ------------------------------------------------------------------ lifecycle

    async def run(
        self,
        client_port: int,
        prefill: PrefillAddress | tuple[str, int],
        *,
        host: str = "127.0.0.1",
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Connect to the prefill node, then serve clients on `client_port` until cancelled."""
        self.link.at = prefill if isinstance(prefill, PrefillAddress) else PrefillAddress(prefill)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.link.run)
                await self.link.connect()
                if self.rounds is not None and self.tp is not None:
                    await self.tp.ready()
                    nursery.start_soon(self.rounds.run)
                    if self.tp.rank != 0:
                        task_status.started(0)  # only rank 0 serves clients
                        return
                else:
                    nursery.start_soon(self.feed.run_ticks)
                    nursery.start_soon(self.batch.run)
                serve = functools.partial(trio.serve_tcp, self.clients.serve, client_port, host=host)
                listeners = await nursery.start(serve)
                task_status.started(listeners[0].socket.getsockname()[1])
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.link.aclose()
                await self.store.aclose()


def _answer_client(live: Live) -> None:
    """A single rank's answer is ready once the core responded."""
    live.answer.set()


def _agree(c: cmd.Agree) -> None:
    raise NotImplementedError(f"a single-rank decode node does not execute {type(c).__name__}")
