"""Faults injected into the decode node's transfers and timers, as hooks the transfer and timer
code always calls: `FaultHooks` passes everything through, `InjectedFaults` (with a
`RuntimeFaults`) carries out the spec's `transfer` and `timer` faults. The L3 and copy faults
wrap the store and the copy engine the same way (`runtime/decode/faults.py`); the page checks
that catch them run either way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from hicache.core import commands as cmd
from hicache.faults import Decision
from hicache.runtime.decode.faults import RuntimeFaults, flip_offset, flip_page_byte
from hicache.runtime.kv.kv_pool import KVPool


class TransferFault:
    """One transfer's fault, stage by stage; this base injects none."""

    async def start(self) -> str:
        """Before anything is sent: a reason to fail the transfer at once ("" to go on)."""
        return ""

    def shape(self, c: cmd.RequestKV, page: int) -> tuple[int, list[int]]:
        """The end and the L1 pages prefill is asked to fill."""
        return c.end, list(c.dst_slots)

    async def answered(self, cut: Callable[[], Awaitable[None]]) -> str:
        """Prefill answered (and its WRITE landed, if it said ok): a reason to fail it anyway."""
        return ""

    def received(self, l1: KVPool, dst: list[int]) -> None:
        """The pages landed and are about to be checked against prefill's digests."""


class FaultHooks:
    """Where the transfer and timer code lets faults in; this base (a node without injected
    faults) lets none in."""

    def transfer(self, tid: int) -> TransferFault:
        return TransferFault()

    def timer(self, c: cmd.SetTimer) -> float | None:
        """When timer `c` fires (None: at once)."""
        return c.at

    def rejected(self) -> None:
        """A received page differed from what prefill sent."""


class _InjectedTransfer(TransferFault):
    def __init__(self, faults: RuntimeFaults, d: Decision) -> None:
        self.faults, self.d = faults, d

    async def start(self) -> str:
        await self.faults.delay(self.d)
        if self.d.kind == "error":
            self.faults.applied(self.d)
            return "prefill transfer error (injected)"
        return ""

    def shape(self, c: cmd.RequestKV, page: int) -> tuple[int, list[int]]:
        end, dst = c.end, list(c.dst_slots)
        if self.d.kind == "partial" and dst:  # prefill sends a prefix
            self.faults.applied(self.d)
            k = self.d.prefix(len(dst))
            end, dst = min(c.end, c.start + k * page), dst[:k]
        return end, dst

    async def answered(self, cut: Callable[[], Awaitable[None]]) -> str:
        if self.d.kind != "peer_death":
            return ""
        self.faults.applied(self.d)
        await cut()
        return "prefill connection lost before the transfer was confirmed (injected)"

    def received(self, l1: KVPool, dst: list[int]) -> None:
        if self.d.kind == "corrupt" and dst:
            self.faults.applied(self.d)
            i, offset = flip_offset(self.d, len(dst), l1.layout.page_bytes)
            flip_page_byte(l1, dst[i], offset)


class InjectedFaults(FaultHooks):
    """The spec's `transfer` and `timer` faults, decided by `faults` (which counts them)."""

    def __init__(self, faults: RuntimeFaults) -> None:
        self.faults = faults

    def transfer(self, tid: int) -> TransferFault:
        d = self.faults.take("transfer", tid)
        return TransferFault() if d is None else _InjectedTransfer(self.faults, d)

    def timer(self, c: cmd.SetTimer) -> float | None:
        d = self.faults.take("timer", c.timer)
        if d is None:
            return c.at
        self.faults.applied(d)
        return c.at + d.delay if d.kind == "delay" else None

    def rejected(self) -> None:
        self.faults.caught["received_page_rejected"] += 1
