"""The front door's backend on a real decode node: each request streams over its own
connection to the node (`DecodeClient.stream`), and leaving it early aborts it there.

One connection per request in flight keeps a slow stream from holding up another; connections
are kept for reuse once their request ended cleanly, up to `idle_connections`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import attrs

from hicache.runtime.serving.backend import (
    TIERS,
    Finished,
    GenerateEvent,
    GenerateRequest,
    ModelInfo,
    Tokens,
)
from hicache.runtime.wire import protocol
from hicache.runtime.wire.client import DecodeClient

log = logging.getLogger("hicache.runtime.serving")

# A result's outcome and finish reason -> the front door's finish reason.
_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@attrs.define(eq=False)
class NodeBackend:
    """A decode node at `host:port`, reached with `api_key` (an admin key if the node has keys:
    the front door authenticates its own clients and passes their tenant on)."""

    host: str
    port: int
    info: ModelInfo  # what `model_info` answers (set before the app is made)
    api_key: str | None = None
    idle_connections: int = 16
    _idle: list[DecodeClient] = attrs.field(factory=list)

    async def _client(self) -> DecodeClient:
        if self._idle:
            return self._idle.pop()
        return await DecodeClient.connect(self.host, self.port, api_key=self.api_key)

    def moved(self, host: str, port: int) -> None:
        """The node was restarted at `host:port`: connections to the old one are dropped."""
        self.host, self.port = host, port
        self._idle.clear()  # their sockets met the old node's end; closed as they are collected

    def _give_back(self, client: DecodeClient) -> None:
        if len(self._idle) < self.idle_connections:
            self._idle.append(client)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        sampling = req.sampling.to_wire()
        try:
            client = await self._client()
        except OSError as exc:
            yield Finished("abort", f"the decode node at {self.host}:{self.port} is unreachable: {exc}")
            return
        ended = False
        try:
            stream = client.generate_stream(
                req.rid, req.input_ids, req.max_new_tokens, sampling=sampling, tenant=req.tenant
            )
            sent = 0
            async for frame in stream:
                if frame["op"] == "tokens":
                    account = frame.get("account")
                    cached = {t: int(account.get(t, 0)) for t in TIERS} if isinstance(account, dict) else None
                    ids = list(frame["tokens"])
                    sent += len(ids)
                    lps = _logprobs(frame, 0, len(ids))
                    yield Tokens(ids, cached_tokens=cached, logprobs=lps, prompt_logprobs=_scores(frame))
                elif frame["op"] == "result":
                    ended = True
                    rest = list(frame.get("tokens") or [])[sent:]  # made after the last frame went
                    if rest:
                        lps = _logprobs(frame, sent, len(rest))
                        yield Tokens(rest, logprobs=lps, prompt_logprobs=_scores(frame))
                    yield _finished(frame, len(req.input_ids))
                    return
        except protocol.ProtocolError as exc:
            ended = True
            log.warning("request %s failed at the decode node: %s", req.rid, exc)
            yield Finished("error", str(exc), prompt_tokens=len(req.input_ids))
        finally:
            if ended and client.usable:
                self._give_back(client)

    async def peek(self, tokens: list[int], tenant: str | None) -> int:
        """Pages of `tokens` the node holds for `tenant` (what a cache-aware router weighs)."""
        client = await self._client()
        pages = await client.peek(tokens, tenant)
        self._give_back(client)
        return pages

    async def flush(self) -> None:
        client = await self._client()
        await client.evict(l1=1 << 40, l2=1 << 40)
        self._give_back(client)

    async def stats(self) -> Mapping[str, float]:
        client = await self._client()
        stats = await client.stats()
        self._give_back(client)
        return {
            k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }

    def model_info(self) -> ModelInfo:
        return self.info

    async def aclose(self) -> None:
        for client in self._idle:
            await client.aclose()
        self._idle.clear()


def _finished(result: dict[str, Any], prompt_tokens: int) -> Finished:
    outcome = result.get("outcome")
    account = result.get("account") or {}
    cached = {tier: int(account.get(tier, 0)) for tier in TIERS}
    if outcome == "finished":
        reason = _REASONS.get(str(result.get("finish_reason")), "length")
    elif outcome == "aborted":
        reason = "abort"
    else:
        reason = "error"
    return Finished(
        reason,  # type: ignore[arg-type]
        str(result.get("reason") or ""),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        ttft_s=result.get("ttft_s"),
        prefill_cached_tokens=_total(result.get("prefill_cached")),
        transferred_tokens=_count(account.get("transferred")),
        phases=_phases(result.get("phases")),
        refused=outcome == "failed" and result.get("refused") is True,
    )


def _logprobs(frame: dict[str, Any], start: int, n: int) -> list[Any] | None:
    """A frame's log-probabilities of its tokens `start`.. (`n` of them), None if it has none."""
    lps = frame.get("logprobs")
    if not isinstance(lps, list) or len(lps) < start + n:
        return None
    return lps[start : start + n]


def _scores(frame: dict[str, Any]) -> list[Any] | None:
    """A frame's prompt log-probabilities (the decode node checked prefill's), None if none."""
    lps = frame.get("prompt_logprobs")
    return lps if isinstance(lps, list) else None


def _total(value: object) -> int | None:
    """The tokens of a result's per-tier dict summed (None when the node sent none)."""
    if not isinstance(value, dict):
        return None
    return sum(n for n in map(_count, value.values()) if n is not None)


def _phases(value: object) -> dict[str, float] | None:
    """A result's `phases` (seconds by name), the non-negative finite ones; None when none."""
    if not isinstance(value, dict):
        return None
    out = {str(k): v for k, v in ((k, protocol.seconds(v)) for k, v in value.items()) if v is not None}
    return out or None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
