"""One request of any workload, in the form both drivers replay.

A generated workload carries token ids; a trace carries only chained block ids (Mooncake:
one per 512 tokens; kv-cache-tester: one per 64). Either way a request yields the chained page
keys of its prompt and of its whole sequence (prompt + output), which is all the cache needs.
A trace says nothing about the output's content, so its output pages get keys of their own
that no other request can share.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import attrs
import numpy as np

from hicache.core.pages import block_sequence_keys, namespace_seed, page_keys, private_page_keys
from hicache.scenarios.multiturn import ChatRequest
from hicache.scenarios.traces import TraceRequest


@attrs.frozen(slots=True)
class WorkItem:
    """A request to replay: arrival in seconds from the workload's start."""

    id: str
    arrival: float
    prompt_len: int
    output_len: int
    session: str = ""
    turn: int = 0
    tenant: str | None = None
    prompt: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)  # token ids
    output: np.ndarray | None = attrs.field(default=None, eq=False, repr=False)
    blocks: tuple[int, ...] | None = attrs.field(default=None, repr=False)  # chained block ids
    block_size: int = 0
    # Closed loop: sent this many seconds after the session's previous request is answered, and
    # `arrival` is only the open-loop schedule. None: it arrives at `arrival`.
    think: float | None = None
    # Its prefill compute takes this many times what the cost model says (a twin's replays with
    # jittered service times; 1 otherwise).
    service_scale: float = 1.0

    def seed(self, model: str) -> int:
        """The page-key namespace: the model, salted by the tenant when there is one."""
        return _seed(model, self.tenant)

    def sequence_keys(self, page_size: int, model: str) -> np.ndarray:
        """Keys of every full page of prompt + output (the prompt's keys are its first
        `prompt_len // page_size`)."""
        seed = self.seed(model)
        total = self.prompt_len + self.output_len
        if self.prompt is not None and self.output is not None:
            return page_keys(np.concatenate([self.prompt, self.output]), page_size, seed)
        if self.blocks is None:
            # Length-only traces: every page is this request's own.
            return _private_keys(self.id, seed, 0, total // page_size)
        # Formats that id only full blocks (kv-cache-tester) leave the prompt's tail unnamed.
        covered = min(self.prompt_len, len(self.blocks) * self.block_size)
        # Pages that reach into the output are private; a page wholly inside the prompt keeps
        # its chained key.
        return block_sequence_keys(
            self.blocks,
            self.block_size,
            page_size,
            covered,
            total // page_size,
            seed,
            _private_base(self.id, seed),
        )

    def prompt_keys(self, page_size: int, model: str) -> np.ndarray:
        return self.sequence_keys(page_size, model)[: self.prompt_len // page_size]


@functools.lru_cache(maxsize=1024)
def _seed(model: str, tenant: str | None) -> int:
    """`namespace_seed`, hashed once per namespace rather than once per request."""
    return namespace_seed(model, tenant)


def _private_base(rid: str, seed: int) -> int:
    return namespace_seed(f"private/{rid}", str(seed))


def _private_keys(rid: str, seed: int, start: int, stop: int) -> np.ndarray:
    """Keys for pages [start, stop) that belong to request `rid` alone."""
    return private_page_keys(_private_base(rid, seed), start, stop)


def from_chat(requests: Iterable[ChatRequest], tenant: str | None = None) -> list[WorkItem]:
    """Generated conversations: ids `c<conversation>t<turn>`."""
    return [
        WorkItem(
            f"c{r.conversation}t{r.turn}",
            r.arrival,
            len(r.prompt),
            len(r.output),
            session=f"c{r.conversation}",
            turn=r.turn,
            tenant=tenant,
            prompt=r.prompt,
            output=r.output,
        )
        for r in requests
    ]


def from_trace(requests: Iterable[TraceRequest], tenant: str | None = None) -> list[WorkItem]:
    """Trace requests in arrival order: ids `r<index>`; turns counted per session."""
    return list(iter_from_trace(requests, tenant))


def iter_from_trace(requests: Iterable[TraceRequest], tenant: str | None = None) -> Iterator[WorkItem]:
    """`from_trace` one item at a time, so that a streamed trace is never held whole (the turn
    counter keeps one entry per session, none for a trace without sessions)."""
    turns: dict[str, int] = {}
    for i, r in enumerate(requests):
        session = r.session or ""
        turn = turns.get(session, 0) if session else 0
        if session:
            turns[session] = turn + 1
        yield WorkItem(
            f"r{i}",
            r.arrival,
            r.input_length,
            r.output_length,
            session=session,
            turn=turn,
            tenant=tenant,
            blocks=r.block_ids,
            block_size=r.block_size or 0,
        )
