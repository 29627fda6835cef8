"""What the HTTP front door needs from a decode node, and from a tokenizer.

The front door (this package) owns HTTP, JSON, tokenizing, detokenizing and stop strings; the
backend owns scheduling, the KV tiers and the model. They meet here, so a fake backend in the
tests and the real decode node are interchangeable without touching the app.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from hicache.runtime.wire.sampling_fields import Sampling

TIERS = ("l1", "l2", "l3")  # decode GPU pool, host memory, storage: the tiers cached tokens came from

# The `stats()` names that count since the node started (Prometheus counters); every other stat is
# a gauge, read as it is now. A routed backend's per-node copies (`node0_arrived`) count too.
CUMULATIVE_STATS = frozenset(
    {
        # the decode node's core (hicache/core/decode_base.py NodeStats, all but max_loads_in_flight)
        "arrived", "admitted", "finished", "aborted", "failed", "retracted", "prompt_tokens",
        "l1_tokens", "l2_tokens", "l3_tokens", "transferred_tokens", "fallback_tokens",
        "storage_queries", "prefetches", "load_batches", "transfer_retries", "transfers_abandoned",
        "bad_l2_pages",
        # what the node moved (runtime/decode/status.py MOVED) and where a router sent requests
        "restore_batches", "restore_bytes", "prefetch_batches", "prefetch_bytes", "backup_bytes",
        "transfer_bytes", "routed",
    }
)  # fmt: skip

FinishReason = Literal["stop", "length", "abort", "error"]


@attrs.frozen
class GenerateRequest:
    """One generation: `rid` is unique per node (the front door makes it); `tenant` salts the
    cache keys (None: the shared namespace) and comes from the caller's API key; `session` names
    the conversation for a session-affinity router ("": none)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    tenant: str | None = None
    session: str = ""


@attrs.frozen
class Tokens:
    """New output tokens, in order; the first event's first id is the first token.

    `cached_tokens` is optional: a backend that knows the prompt's tier account when the first
    token comes out may put it here ({"l1", "l2", "l3"} -> tokens), so that a request the front
    door ends early (a stop string, which aborts it) still reports its cache hits.
    """

    ids: list[int]
    cached_tokens: Mapping[str, int] | None = None
    # When the request's sampling asks for them, one per id: [logprob, [[id, logprob], ...]]
    # (the chosen token's log-probability and the most likely tokens', best first).
    logprobs: Sequence[Any] | None = None
    # When the sampling asks for them (`prompt_logprobs_from`), with the first token: one per
    # prompt token from there on, the first None, the others as `logprobs`.
    prompt_logprobs: Sequence[Any] | None = None


@attrs.frozen
class Finished:
    """The last event. `reason`: "stop" (EOS or a stop token id, which is then the last id
    yielded), "length" (max_new_tokens reached), "abort" (the node gave up: overload, shutdown,
    eviction) or "error" (a fault; `message` says which). `cached_tokens` maps "l1", "l2", "l3"
    to the prompt tokens whose KV came from that tier; `ttft_s` is the backend's own view."""

    reason: FinishReason
    message: str = ""
    prompt_tokens: int = 0
    cached_tokens: Mapping[str, int] = attrs.field(factory=dict)
    ttft_s: float | None = None
    prefill_cached_tokens: int | None = None  # prompt tokens prefill did not compute, if known
    transferred_tokens: int | None = None  # prompt tokens whose KV came over P->D, if known
    # Where the time to the prompt's KV went, in seconds, if known: decode_wait_s, prefill_wait_s,
    # prefill_compute_s, transfer_s (the decode node's `transfers._phases`).
    phases: Mapping[str, float] | None = None
    # The node refused the request as it is (asking again fails again): the client's to change.
    refused: bool = False


GenerateEvent = Tokens | Finished


@attrs.frozen
class ModelInfo:
    """Read once by `create_app`. `name` is the model path/id reported by /get_model_info."""

    name: str
    max_context_tokens: int  # prompt + output, in tokens
    eos_token_ids: tuple[int, ...]
    vocab_size: int


@runtime_checkable
class Backend(Protocol):
    """A decode node as the front door drives it (all methods run in the app's trio loop)."""

    def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        """Written as `async def generate(self, req): ... yield ...`.

        Yields `Tokens` as tokens come out, then exactly one `Finished`, then returns. If the
        consumer stops early — `aclose()` on the generator, or cancellation while it waits in
        it — the backend aborts the request and frees everything it held for it. The front door
        calls `aclose()` inside a shielded scope with a grace period, so the cleanup may await.
        A request the backend refuses outright (queue full, shutting down) is one `Finished`
        with reason "abort" and no `Tokens`; the front door answers it with 503.
        """
        ...

    async def flush(self) -> None:
        """Evict the node's cached KV from L1 and L2 (SGLang's /flush_cache). Raising refuses
        (e.g. while requests run); the message is shown to the client with a 503."""
        ...

    async def stats(self) -> Mapping[str, float]:
        """Gauges for /metrics, e.g. queue lengths, pool occupancy per tier, restore bytes and
        batches, transfer bytes. Names are snake_case; each becomes `hicache_backend_<name>`, a
        counter if it is in `CUMULATIVE_STATS`, else a gauge."""
        ...

    def model_info(self) -> ModelInfo: ...


@runtime_checkable
class TextCodec(Protocol):
    """The tokenizer and chat template. `decode` skips special tokens (EOS never shows in the
    text) and must accept any prefix of a token sequence (an incomplete UTF-8 character decodes
    to U+FFFD, as `tokenizers` and `bytes.decode(errors="replace")` do)."""

    def encode(self, text: str) -> list[int]:
        """No special tokens added beyond what the model's prompts need (e.g. BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int] | str:
        """`messages` are [{"role", "content"}] with string content (and an assistant's
        `tool_calls`, a tool's `tool_call_id`, when the codec's `chat_features` name them; a
        codec that takes `tools` lists "tools" there and takes them as a keyword). A str result
        is encoded with `encode`; errors (e.g. a jinja2 `raise_exception`) reach the client as a
        400."""
        ...
