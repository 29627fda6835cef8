"""One transfer's way out of the prefill node: its staging pages and the WRITEs that carry them
into the decode node's L1 pages, in order, the notification riding on the last.

Pages are staged as prefill computes them (a chunk's pages, a layer group at a time, from the
compute thread) or all at once when it is done, and each staged piece is one WRITE, posted once
the one before is done. `final` marks the piece that carries the notification, so the decode
node hears of the transfer only when every byte is there. With TP `heads` (a rank's [lo, hi)),
only those heads of each page are staged, as the first part of a staging page.
"""

from __future__ import annotations

import contextlib
import logging
import math

import attrs
import torch
import trio

from hicache.runtime.kv.kv_digest import page_digests
from hicache.runtime.transfer.base import MemoryRegion, Span, TransferEngine, XferHandle, XferState

log = logging.getLogger("hicache.runtime.prefill")

SETTLE_TIMEOUT_S = 30.0  # how long a reply waits for its WRITE to settle before giving up on it


@attrs.frozen
class Piece:
    """Pages [a, b) of the transfer (0 = its first page), layers [lo, hi) of each."""

    a: int
    b: int
    lo: int
    hi: int
    final: bool


class KVOut:
    """The staged pages of one transfer and its WRITEs (`run` posts them as they are staged)."""

    def __init__(
        self,
        engine: TransferEngine,
        region: MemoryRegion,
        staging: torch.Tensor,
        per: int,
        part: slice,
        slots: list[int],
        peer: str,
        dst: list[int],
        notif: bytes,
        layers: int,
        transfer_timeout: float,
    ) -> None:
        self.engine, self.region, self.staging, self.part = engine, region, staging, part
        self.parts = [s * per for s in slots]  # staging page s holds parts s*per .. s*per+per-1
        self.idx = torch.tensor(self.parts, dtype=torch.int64)
        self.peer, self.dst, self.notif = peer, dst, notif
        self.layers = layers
        self.transfer_timeout = transfer_timeout
        self.unsettled: list[XferHandle] = []
        self.pieces = 0  # WRITEs queued
        self.final_queued = False
        self.during_compute = 0  # pieces staged by the compute thread while prefill computed
        self._send, self._ready = trio.open_memory_channel[Piece](math.inf)
        self._token = trio.lowlevel.current_trio_token()

    def _copy(self, a: int, b: int, lo: int, hi: int, pages: torch.Tensor) -> None:
        if b > a:
            # Pages computed on a GPU come to the host staging pool here (one copy per piece).
            part = pages[:, :, :, :, self.part].to(self.staging.device, self.staging.dtype)
            self.staging[self.idx[a:b], lo:hi] = part

    def stage(self, a: int, b: int, lo: int, hi: int, pages: torch.Tensor, *, final: bool = False) -> None:
        """Stage `pages` (layers [lo, hi) of pages [a, b)) and queue their WRITE (in trio)."""
        self._copy(a, b, lo, hi, pages)
        self.queue(Piece(a, b, lo, hi, final))

    def stage_from_thread(self, a: int, b: int, lo: int, hi: int, pages: torch.Tensor, final: bool) -> None:
        """`stage` from the compute thread: the copy there, the WRITE queued in trio. A
        transfer already given up on takes nothing more."""
        self._copy(a, b, lo, hi, pages)
        self.during_compute += 1
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self.queue, Piece(a, b, lo, hi, final), trio_token=self._token)

    def queue(self, piece: Piece) -> None:
        try:
            self._send.send_nowait(piece)
            self.pieces += 1
            self.final_queued |= piece.final
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # given up on: its WRITEs are no longer wanted

    def close(self) -> None:
        """Nothing more will be staged: `run` ends once the queued WRITEs are done."""
        self._send.close()

    async def run(self) -> None:
        """WRITE each staged piece as it comes, one at a time; the `final` one carries the
        notification. A WRITE that fails fails the transfer."""
        layer_bytes = self.region.page_bytes // self.layers
        async with self._ready:
            async for p in self._ready:
                whole = (p.lo, p.hi) == (0, self.layers)
                span = None if whole else Span(p.lo * layer_bytes, (p.hi - p.lo) * layer_bytes)
                handle = await self.engine.post(
                    "WRITE",
                    self.region,
                    self.parts[p.a : p.b],
                    self.peer,
                    "L1",
                    self.dst[p.a : p.b],
                    self.notif,
                    span=span,
                    final=p.final,
                )
                self.unsettled.append(handle)
                state = await self.engine.wait(handle, timeout=self.transfer_timeout)
                if state is not XferState.DONE:
                    raise RuntimeError(f"transfer {state}: {self.engine.reason(handle)}")

    async def digests(self) -> list[str]:
        """Hashing reads every byte of the pages: a worker thread does it, off the loop."""
        if not self.parts:
            return []
        return await trio.to_thread.run_sync(page_digests, self.staging[self.idx])

    async def settle(self) -> bool:
        """Settle every WRITE posted (also when cancelled); False if one did not in time (its
        staging pages must then stay out of use)."""
        self._send.close()
        settled = True
        for handle in self.unsettled:
            with trio.move_on_after(SETTLE_TIMEOUT_S) as waited:
                await self.engine.settle(handle)
            if waited.cancelled_caught:
                settled = False
                log.error(
                    "%r did not settle in %s s; its staging pages stay out of use",
                    self.notif,
                    SETTLE_TIMEOUT_S,
                )
        return settled
