"""Configuration of a decode node's core: tier sizes, policies and the driver's estimates."""

from __future__ import annotations

import enum
import math

import attrs

from hicache.core.errors import PolicyError
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.policy_enum import parse_policy
from hicache.core.write_policy import WritePolicy


class PromisePolicy(enum.StrEnum):
    """How much of a matched prefix to promise to prefill (see `hicache.core.promise`)."""

    EAGER = "eager"  # L1 + L2 + L3 as soon as the L3 hit is known; fall back on a shortfall
    CONFIRMED = "confirmed"  # L3 pages only once they are in L2
    ADAPTIVE = "adaptive"  # a tier's part only where restoring it beats receiving it


class PrefetchPolicy(enum.StrEnum):
    """When a prefetch stops (see `hicache.core.prefetch_rule`)."""

    BEST_EFFORT = "best_effort"  # as soon as the request could otherwise be scheduled
    WAIT_COMPLETE = "wait_complete"  # when every page is in
    TIMEOUT = "timeout"  # when every page is in or its deadline passes


class RetractPolicy(enum.StrEnum):
    """Which running request to retract under memory pressure."""

    NEWEST = "newest"
    FEWEST_DECODED = "fewest_decoded"
    MOST_PAGES = "most_pages"


PROMISE_POLICIES = tuple(p.value for p in PromisePolicy)
PREFETCH_POLICIES = tuple(p.value for p in PrefetchPolicy)
RETRACT_POLICIES = tuple(p.value for p in RetractPolicy)


def _policy(kind: type[enum.StrEnum], name: str, default: enum.StrEnum):
    """An attrs field holding a policy enum, given as a member or by its name."""
    return attrs.field(default=default, converter=lambda v: parse_policy(kind, v, f"{name}: unknown policy"))


def _one_of(choices: tuple[str, ...]):
    def check(inst: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise PolicyError(
                f"{attribute.name}: unknown policy {value!r}; expected one of: {', '.join(choices)}"
            )

    return check


def _at_least(low: float):
    def check(inst: object, attribute: attrs.Attribute, value: float) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= low:
            raise ValueError(f"{attribute.name}: expected a number >= {low}, got {value!r}")

    return check


def _finite_at_least(low: float):
    def check(inst: object, attribute: attrs.Attribute, value: float) -> None:
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
            or not value >= low
        ):
            raise ValueError(f"{attribute.name}: expected a finite number >= {low}, got {value!r}")

    return check


@attrs.frozen(slots=True)
class DecodeConfig:
    """Everything the decode-node core decides with. Sizes are in pages unless named tokens."""

    l1_pages: int = attrs.field(validator=_at_least(1))
    l2_pages: int = attrs.field(validator=_at_least(0))
    page_size: int = attrs.field(default=64, validator=_at_least(1))
    eviction: str = attrs.field(default="lru", validator=_one_of(tuple(EVICTION_POLICIES)))
    write_policy: WritePolicy = _policy(WritePolicy, "write_policy", WritePolicy.WRITE_THROUGH)
    storage: bool = True  # an L3 is attached: query it, prefetch from it, store to it
    radix: bool = True  # keep finished sequences in the tree; False: no decode-side cache at all
    # At most this share of L2 may wait on stores to L3; beyond it pages are not stored (writes
    # to L3 are best-effort: L2 must not fill up with pages a slow store still reads).
    store_backlog: float = attrs.field(default=0.25, validator=_at_least(0))
    promise: PromisePolicy = _policy(PromisePolicy, "promise", PromisePolicy.EAGER)
    prefetch_policy: PrefetchPolicy = _policy(PrefetchPolicy, "prefetch_policy", PrefetchPolicy.TIMEOUT)
    prefetch_threshold_tokens: int = attrs.field(default=256, validator=_at_least(0))
    prefetch_timeout_base: float = attrs.field(default=2.0, validator=_at_least(0))
    prefetch_timeout_per_ki_token: float = attrs.field(default=0.1, validator=_at_least(0))
    prefetch_timeout_max: float = attrs.field(default=30.0, validator=_at_least(0))
    load_batches_in_flight: int = attrs.field(default=3, validator=_at_least(1))
    decode_reserve_tokens: int = attrs.field(default=512, validator=_at_least(0))
    transfer_retries: int = attrs.field(default=2, validator=_at_least(0))
    # Seconds before the first retry of a failed transfer, doubling per retry up to the cap and
    # scaled by a deterministic jitter in [0.5, 1) (`hicache.core.backoff`); 0: retry at once.
    transfer_backoff_s: float = attrs.field(default=0.0, validator=_finite_at_least(0))
    transfer_backoff_max_s: float = attrs.field(default=5.0, validator=_finite_at_least(0))
    retract_policy: RetractPolicy = _policy(RetractPolicy, "retract_policy", RetractPolicy.NEWEST)
    # Requests in the decode batch at once (0: no limit). A request whose KV is complete waits
    # in READY, holding its L1 pages, until the batch has room.
    max_running: int = attrs.field(default=0, validator=_at_least(0))
    tp_size: int = attrs.field(default=1, validator=_at_least(1))
    # Estimates for the adaptive promise (the driver supplies them; bytes and seconds).
    kv_bytes_per_token: float = attrs.field(default=131072.0, validator=_at_least(0))
    l3_bandwidth: float = attrs.field(default=5e9, validator=_at_least(1))
    l3_latency: float = attrs.field(default=2e-3, validator=_at_least(0))
    host_to_device_bandwidth: float = attrs.field(default=25e9, validator=_at_least(1))
    network_bandwidth: float = attrs.field(default=25e9, validator=_at_least(1))
    network_latency: float = attrs.field(default=50e-6, validator=_at_least(0))
    # How prefill ships KV: 0, once it has computed the whole prompt; G > 0, layer by layer in G
    # groups while it computes (SGLang's way), so the transfer hides behind prefill.
    transfer_groups: int = attrs.field(default=0, validator=_at_least(0))
    prefill_tokens_per_s: float = attrs.field(default=20000.0, validator=_at_least(1))
    # Prefill's attention: seconds per (new token, earlier token) pair, on top of the linear
    # rate above; 0: prefill time is linear in the tokens.
    prefill_attention_seconds: float = attrs.field(default=0.0, validator=_finite_at_least(0))

    def __attrs_post_init__(self) -> None:
        if not self.radix and (self.storage or self.l2_pages):
            raise ValueError("radix=False (no decode cache) needs storage=False and l2_pages=0")

    @property
    def decode_reserve_pages(self) -> int:
        return math.ceil(self.decode_reserve_tokens / self.page_size)

    @property
    def prefetch_threshold_pages(self) -> int:
        return math.ceil(self.prefetch_threshold_tokens / self.page_size)

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds a `timeout` prefetch of `tokens` may take: base + per-KiB-token term, capped."""
        t = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(t, self.prefetch_timeout_max)
