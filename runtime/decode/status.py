"""What a decode node reports about itself: gauges and moved bytes (`stats`, for /metrics), what
it holds and whether its invariants hold (`audit`, for the leak checks), and what it runs with
(`config`, recorded with a trace). A TP rank 0 adds every rank's answer, asked in a round."""

from __future__ import annotations

import collections
from typing import Any

import attrs

from hicache.core.config import DecodeConfig
from hicache.core.decode_node import DecodeNodeCore
from hicache.core.errors import CoreError
from hicache.runtime.decode.faults import RuntimeFaults
from hicache.runtime.decode.feed import Feed
from hicache.runtime.decode.live import LiveTable
from hicache.runtime.kv.kv_layout import KVLayout
from hicache.runtime.storage.base import StorageBackend
from hicache.runtime.tp.tp_rounds import Rounds

MOVED = (
    "restore_batches",
    "restore_bytes",
    "prefetch_batches",
    "prefetch_bytes",
    "backup_bytes",
    "transfer_bytes",
)


class Status:
    """Reads the node's parts; changes nothing."""

    def __init__(
        self,
        core: DecodeNodeCore,
        feed: Feed,
        live: LiveTable,
        moved: collections.Counter[str],
        *,
        faults: RuntimeFaults | None,
        layout: KVLayout,
        model_name: str,
        store: StorageBackend,
        rounds: Rounds | None,
    ) -> None:
        self.core, self.cfg, self.feed, self.live, self.moved = core, core.cfg, feed, live, moved
        self.faults = faults
        self.layout = layout
        self.model_name = model_name
        self.store = store
        self.rounds = rounds

    def gauges(self) -> dict[str, int]:
        """What the node holds and has moved now: requests by stage, pages per tier, bytes."""
        cfg: DecodeConfig = self.cfg
        audit = self.core.audit()
        running = self.live.running()
        return {
            "requests_running": running,
            "requests_waiting": len(self.live) - running,
            "l1_pages_used": cfg.l1_pages - audit["l1_free"],
            "l1_pages": cfg.l1_pages,
            "l2_pages_used": cfg.l2_pages - audit["l2_free"] if cfg.l2_pages else 0,
            "l2_pages": cfg.l2_pages,
            # The longest prompt the node can ever admit (its L1 less the decode reserve).
            "max_prompt_tokens": cfg.max_prompt_tokens,
            # What a front door admits by: requests held at once, and L1 in tokens (SGLang's name).
            "max_running_requests": cfg.max_running_requests,
            "max_total_tokens": cfg.l1_pages * cfg.page_size,
            "decode_reserve_tokens": cfg.decode_reserve_pages * cfg.page_size,
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
        out: dict[str, Any] = {**self.core.audit(), "check": check}
        out["refused_events"] = self.feed.refused_events
        if self.faults is not None:
            out["faults_injected"] = dict(sorted(self.faults.injected.items()))
            out["faults_caught"] = dict(sorted(self.faults.caught.items()))
        return out

    def local(self, what: str) -> dict[str, Any]:
        """This rank's answer to rank 0's `stats` ("gauges") or `audit`."""
        return self.gauges() if what == "gauges" else self.audit()

    async def stats(self) -> dict[str, Any]:
        reply = {"op": "stats", **attrs.asdict(self.core.stats), **self.gauges()}
        if self.rounds is not None:
            others = await self.rounds.ask("gauges")
            reply["ranks"] = [self.gauges(), *(others[r] for r in sorted(others))]
        return reply

    async def audit_all(self) -> dict[str, Any]:
        reply = {"op": "audit", **self.audit()}
        if self.rounds is not None:
            others = await self.rounds.ask("audit")
            reply["ranks"] = [self.audit(), *(others[r] for r in sorted(others))]
        return reply

    def config(self) -> dict[str, Any]:
        """What this node runs with: a front door records it with a trace."""
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
        }
