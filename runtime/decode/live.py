"""The live-request table: what the decode node knows of each request between its arrival and
its answer, shared by the parts that serve, transfer and decode it (the core keeps the cache's
side of the same request)."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from hicache.core.pages import extend_page_keys
from hicache.runtime.wire.sampling_fields import Sampling


@attrs.define(eq=False)
class Live:
    """A request between its arrival and its answer."""

    rid: str
    prompt: list[int]
    max_new: int
    seed: int
    verify: bool
    arrival: float
    answer: trio.Event = attrs.Factory(trio.Event)
    gen: list[int] = attrs.Factory(list)
    # Per generated token when its sampling asks for them: [logprob, [[id, logprob], ...]].
    logprobs: list[Any] = attrs.Factory(list)
    # The prompt's from `sampling.prompt_logprobs_from` on (the first None), from prefill's answer.
    prompt_logprobs: list[Any] | None = None
    kv_len: int = 0  # tokens whose KV is in the request's L1 pages
    slots: list[int] = attrs.Factory(list)  # its L1 pages while running (StartDecode + ExtendKV)
    running: bool = False
    first_token_at: float = -1.0
    promised: int = -1  # tokens its first admission restored locally (StartDecode), -1 before
    received: dict[int, str] = attrs.Factory(dict)  # page index -> prefill's digest (this admission)
    start_pages: list[dict[str, Any]] = attrs.Factory(list)
    start_kv: bytes = b""
    final_pages: list[str] = attrs.Factory(list)
    outcome: str = ""
    reason: str = ""
    account: dict[str, int] = attrs.Factory(dict)
    sampling: Sampling = attrs.Factory(Sampling)  # seeded at arrival; prefill gets it too
    stop_ids: frozenset[int] = frozenset()  # a generated token among these ends the request
    finish_reason: str = ""  # "stop" (a stop token) or "length" (max_new), once Finished
    changed: trio.Event = attrs.Factory(trio.Event)  # set (and replaced) when tokens are added
    seq: int = 0  # TP: its place in arrival order, the same on every rank
    duplicate: bool = False  # TP: the core refused its arrival (an id still in use)
    ranks: list[dict[str, Any]] = attrs.Factory(list)  # TP, rank 0: ranks 1..'s page reports
    prefill_cached: dict[str, int] | None = None  # prompt tokens prefill had cached, by tier
    phases: dict[str, float] | None = None  # where its time to its KV went (`transfers._phases`)
    keys: list[int] = attrs.Factory(list)  # its first full pages' keys, extended as it grows
    refused: bool = False  # prefill refused it as it is (too big for its staging): the client's to change

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.gen

    def page_keys(self, page_size: int, pages: int) -> list[int]:
        """The keys of its first `pages` full pages (a new list), hashing only those not keyed
        before: its tokens only grow, so a key, once computed, stays its page's."""
        self._key_through(page_size, pages)
        return self.keys[:pages]

    def page_key(self, page_size: int, index: int) -> int:
        """The key of its full page `index` (a decode step that fills a page asks for it)."""
        self._key_through(page_size, index + 1)
        return self.keys[index]

    def _key_through(self, page_size: int, pages: int) -> None:
        have = len(self.keys)
        if pages > have:
            lo, hi, n = have * page_size, pages * page_size, len(self.prompt)
            new = self.prompt[lo:hi] + self.gen[max(0, lo - n) : max(0, hi - n)]
            if len(new) < hi - lo:
                held = n + len(self.gen)
                raise ValueError(f"page_keys: {pages} pages of {page_size} tokens, it holds {held}")
            extend_page_keys(self.keys, new, page_size, self.seed)

    def add_token(self, token: int, logprob: Any = None) -> None:
        """Append a generated token (and its log-probabilities, when asked for) and wake whoever
        streams this request's tokens."""
        self.gen.append(token)
        if self.sampling.logprobs:
            self.logprobs.append(None if logprob is None else [logprob[0], [list(p) for p in logprob[1]]])
        self.changed.set()
        self.changed = trio.Event()


class LiveTable(dict[str, Live]):
    """The requests the node is serving, by id; the removal that empties it wakes `emptied`."""

    def __init__(self) -> None:
        super().__init__()
        self._emptied = trio.Event()

    def new(self, rid: str, fields: dict[str, Any]) -> Live:
        """TP ranks 1..: a request rank 0's client sent, with the data rank 0 passed on."""
        live = self[rid] = Live(rid, **fields)
        return live

    def remove(self, rid: str) -> Live | None:
        live = self.pop(rid, None)
        if not self:
            self._emptied.set()
            self._emptied = trio.Event()
        return live

    def running(self) -> int:
        return sum(live.running for live in self.values())

    async def emptied(self) -> None:
        """Return once the table next becomes empty (the `idle` op waits for it)."""
        await self._emptied.wait()
