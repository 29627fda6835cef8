"""Replay a scenario's requests through a running decode node, verify them, and record them in
the simulator's schema (times measured, not modelled).

Token ids: a generated workload carries them (taken modulo the model's vocabulary); a trace
carries only block ids, so each block's tokens are drawn from a generator seeded by its id —
equal ids give equal tokens, and the trace's prefix structure reaches the real model. A
multi-turn session's next prompt is rebuilt from what the model really generated: the previous
prompt + the previous *generated* output + the turn's new text, so the cache sees the same
structure as the scenario describes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import trio

from hicache.results import RequestRecord
from hicache.runtime.verify import KVLedger
from hicache.runtime.wire.client import DecodeClient
from hicache.scenarios.workload import WorkItem


def _stable(text: str) -> int:
    """A seed from a name, the same in every process (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def block_tokens(block_id: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(block_id).integers(0, vocab, n).tolist()


def base_tokens(item: WorkItem, vocab: int) -> list[int]:
    """The item's prompt as token ids of the model, before a session's rewriting."""
    if item.prompt is not None:
        return (np.asarray(item.prompt, dtype=np.int64) % vocab).tolist()
    if item.blocks:
        out: list[int] = []
        for b in item.blocks:
            out += block_tokens(b, item.block_size, vocab)
        out = out[: item.prompt_len]
        extra = item.prompt_len - len(out)  # a tail the trace names no block for
        if extra > 0:
            out += block_tokens(_stable(f"{item.id}/tail"), extra, vocab)
        return out
    return block_tokens(_stable(item.id), item.prompt_len, vocab)


@attrs.define
class ReplayResult:
    records: list[RequestRecord]
    problems: list[str]
    wall_s: float
    verified: int


class Replayer:
    def __init__(
        self,
        host: str,
        port: int,
        ledger: KVLedger,
        *,
        token_bytes: int,
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.ledger = ledger
        self.vocab = ledger.model.config.vocab
        self.token_bytes = token_bytes
        self.verify = verify
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.problems: list[str] = []
        self.verified = 0
        self._sessions: dict[str, tuple[list[int], int]] = {}  # actual sequence, scenario length
        self._checker = trio.CapacityLimiter(1)

    def prompt_of(self, item: WorkItem) -> list[int]:
        tokens = base_tokens(item, self.vocab)
        prev = self._sessions.get(item.session) if item.session and item.prompt is not None else None
        if prev is not None:
            actual, scenario_len = prev
            if item.prompt_len >= scenario_len:
                tokens = actual + tokens[scenario_len:]
        return tokens

    async def run(
        self, items: Sequence[WorkItem], *, sequential: bool, time_scale: float, clients: int = 0
    ) -> ReplayResult:
        """Replay `items`: one at a time (`sequential`), or each session's chain on its own
        connection — open loop at the items' arrival times, or closed loop where an item has a
        `think` (sent that long after its session's previous answer, with at most `clients`
        sessions open at once; 0: no limit). `time_scale` scales every wait."""
        start = time.perf_counter()
        t0 = trio.current_time()
        if sequential:
            client = await DecodeClient.connect(self.host, self.port)
            try:
                for item in items:
                    await self._one(client, item)
                    await client.idle()
            finally:
                await client.aclose()
        else:
            chains: dict[str, list[WorkItem]] = {}
            for item in items:
                chains.setdefault(item.session or f"request/{item.id}", []).append(item)
            seats = trio.CapacityLimiter(clients) if clients > 0 else None
            async with trio.open_nursery() as nursery:
                for chain in chains.values():
                    nursery.start_soon(self._chain, chain, t0, time_scale, seats)
        self.records.sort(key=lambda r: (r.arrival, r.id))
        return ReplayResult(self.records, self.problems, time.perf_counter() - start, self.verified)

    async def _chain(
        self, chain: list[WorkItem], t0: float, time_scale: float, seats: trio.CapacityLimiter | None
    ) -> None:
        await trio.sleep_until(t0 + chain[0].arrival * time_scale)
        async with seats if seats is not None else contextlib.nullcontext():  # a client's seat
            client = await DecodeClient.connect(self.host, self.port)
            try:
                for n, item in enumerate(chain):
                    if n and item.think is not None:  # closed loop: after the previous answer
                        await trio.sleep(item.think * time_scale)
                    elif n:
                        await trio.sleep_until(t0 + item.arrival * time_scale)
                    await self._one(client, item)
            finally:
                await client.aclose()

    async def _one(self, client: DecodeClient, item: WorkItem) -> None:
        prompt = self.prompt_of(item)
        max_new = max(1, item.output_len)
        reply, kv = await client.generate(item.id, prompt, max_new, verify=self.verify, tenant=item.tenant)
        if self.verify:
            # Checking recomputes the request with the model: off the loop, so the replay's own
            # timing is not disturbed; one at a time and in completion order, so a page is
            # checked only after the request that produced it was recorded.
            problems = await trio.to_thread.run_sync(
                functools.partial(self.ledger.check, prompt, max_new, reply, kv, tenant=item.tenant),
                limiter=self._checker,
            )
            self.problems += problems
            self.verified += not problems
        if item.session and reply.get("outcome") == "finished":
            self._sessions[item.session] = (prompt + reply["tokens"], item.prompt_len + item.output_len)
        self.records.append(self._record(item, prompt, reply))
        if self.progress is not None:
            self.progress(1)

    def _record(self, item: WorkItem, prompt: list[int], reply: dict) -> RequestRecord:
        a = reply.get("account") or {}
        ok = reply.get("outcome") == "finished"
        n = len(reply.get("tokens") or [])
        ttft = reply.get("ttft_s")
        e2e = float(reply.get("e2e_s") or math.nan)
        return RequestRecord(
            id=item.id,
            session=item.session,
            turn=item.turn,
            arrival=item.arrival,
            prefill_node=0,
            decode_node=0,
            prompt_tokens=len(prompt),
            output_tokens=n,
            outcome=str(reply.get("outcome")),
            reason=str(reply.get("reason") or ""),
            ttft_s=float(ttft) if ttft is not None else math.nan,
            tpot_s=(e2e - ttft) / (n - 1) if ok and ttft is not None and n > 1 else math.nan,
            e2e_s=e2e,
            cached_l1=int(a.get("l1", 0)),
            cached_l2=int(a.get("l2", 0)),
            cached_l3=int(a.get("l3", 0)),
            transferred_tokens=int(a.get("transferred", 0)),
            promised_tokens=int(reply.get("promised_tokens") or 0),
            fallback_tokens=int(a.get("fallback", 0)),
            prefill_cached_tokens=sum((reply.get("prefill_cached") or {}).values()),
            pd_transfer_bytes=float(a.get("transferred", 0) * self.token_bytes),
            retractions=int(a.get("retractions", 0)),
        )
