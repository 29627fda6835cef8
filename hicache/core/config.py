"""Configuration of a decode node's core: tier sizes, policies and the driver's estimates.

Every field says how users state it (`hicache.core.settings.Setting` in its metadata: the help,
our flag, SGLang's names, the scenario key): the runtime's flags and the scenario's `[cache]` keys
are built from it. `l2_pages` is the one rule that sizes L2 from what a user gives.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from hicache.core.errors import PolicyError
from hicache.core.eviction import EVICTION_POLICIES
from hicache.core.policy_enum import parse_policy
from hicache.core.settings import ESTIMATE, NODE, SETTING, TRANSFER, Setting, field_settings
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


# Each helper below makes a field's check and its `Setting` from the one bound or set of choices,
# so the core, the flags and the scenario cannot disagree on what a setting accepts.


def _count(low: int, default: Any = attrs.NOTHING, **about: Any) -> Any:
    """An integer field >= `low`."""
    return attrs.field(
        default=default, validator=_at_least(low), metadata={SETTING: Setting(kind=int, low=low, **about)}
    )


def _amount(low: float, default: Any, *, finite: bool = False, **about: Any) -> Any:
    """A number field >= `low` (and finite, when `finite`)."""
    check = _finite_at_least(low) if finite else _at_least(low)
    return attrs.field(
        default=default, validator=check, metadata={SETTING: Setting(kind=float, low=low, **about)}
    )


def _policy(kind: type[enum.StrEnum], name: str, default: enum.StrEnum, **about: Any) -> Any:
    """A field holding a policy enum, given as a member or by its name."""
    return attrs.field(
        default=default,
        converter=lambda v: parse_policy(kind, v, f"{name}: unknown policy"),
        metadata={SETTING: Setting(kind=str, choices=tuple(p.value for p in kind), **about)},
    )


def _choice(choices: tuple[str, ...], default: str, **about: Any) -> Any:
    """A field holding one of `choices` by name."""
    return attrs.field(
        default=default,
        validator=_one_of(choices),
        metadata={SETTING: Setting(kind=str, choices=choices, **about)},
    )


def _switch(default: bool, **about: Any) -> Any:
    """A true/false field that flags of their own decide (no flag of its own)."""
    return attrs.field(default=default, metadata={SETTING: Setting(kind=bool, group=None, **about)})


NODE_L1_PAGES = 1024  # a runtime node's L1 when --l1-pages is not given
# A runtime node retries a failed transfer 6 times from 0.2 s, doubling (about 6-11 s in all), so
# that a prefill node that restarts costs no request; scenarios keep the core's 2 immediate
# retries (`cache.transfer_retries`, `cache.transfer_backoff_s`), as the simulator always has.
RESTART_WHY = "a runtime node rides out a prefill node's restart"
# A runtime node's L1 is host memory (its model computes on the CPU), the same RAM as L2: there,
# write-through keeps every cached page twice and buys nothing that an eviction's memcpy costs,
# unless an L3 is named, where it carries pages on to storage at once (for the prefill node that
# reads the decode nodes' L3, and for a restart).
NODE_WRITE_POLICY_WHY = "L1 and L2 share host memory: with no L3, write_back keeps each page once"


@attrs.frozen(slots=True)
class DecodeConfig:
    """Everything the decode-node core decides with. Sizes are in pages unless named tokens."""

    l1_pages: int = _count(
        1,
        help="GPU (L1) pool pages",
        flag="--l1-pages",
        unit="pages",
        metavar="N",
        node_default=NODE_L1_PAGES,
        why_node_default="the core has no default: every driver sizes L1",
    )
    l2_pages: int = _count(
        0,
        help="host-memory (L2) pool pages; overrides --hicache-ratio and --hicache-size",
        flag="--l2-pages",
        unit="pages",
        metavar="N",
        node_default=None,
        why_node_default="not given: `l2_pages` sizes L2 from --hicache-ratio or --hicache-size",
        default_text="--hicache-ratio x --l1-pages",
    )
    page_size: int = _count(
        1,
        64,
        help="tokens per page",
        flag="--page-size",
        sglang=("--page-size",),
        scenario="cache.page_size",
        unit="tokens",
        group=NODE,
        node_default=16,
        why_node_default="the runtime's small models and tests use small pages",
    )
    eviction: str = _choice(
        tuple(EVICTION_POLICIES),
        "lru",
        help="which tree leaves go first",
        flag="--eviction",
        sglang=("--radix-eviction-policy",),
        scenario="cache.eviction",
    )
    write_policy: WritePolicy = _policy(
        WritePolicy,
        "write_policy",
        WritePolicy.WRITE_THROUGH,
        help="when L1 pages are backed up to L2 (and on to L3)",
        flag="--write-policy",
        sglang=("--hicache-write-policy",),
        scenario="cache.write_policy",
        node_default=None,
        why_node_default=NODE_WRITE_POLICY_WHY,
        default_text="write_through with an L3, else write_back",
    )
    storage: bool = _switch(True, help="an L3 is attached: query it, prefetch from it, store to it")
    radix: bool = _switch(True, help="keep finished sequences in the tree; false: no decode-side cache")
    # At most this share of L2 may wait on stores to L3; beyond it pages are not stored (writes
    # to L3 are best-effort: L2 must not fill up with pages a slow store still reads).
    store_backlog: float = _amount(0, 0.25, help="the share of L2 that may wait on stores to L3", group=None)
    promise: PromisePolicy = _policy(
        PromisePolicy,
        "promise",
        PromisePolicy.EAGER,
        help="which cached tiers a request is promised to restore locally",
        flag="--promise",
        scenario="cache.promise",
    )
    prefetch_policy: PrefetchPolicy = _policy(
        PrefetchPolicy,
        "prefetch_policy",
        PrefetchPolicy.TIMEOUT,
        help="when an L3 prefetch stops",
        flag="--prefetch-policy",
        sglang=("--hicache-storage-prefetch-policy",),
        scenario="cache.prefetch_policy",
    )
    prefetch_threshold_tokens: int = _count(
        0,
        256,
        help="fewer L3 hit tokens than this are not prefetched",
        flag="--prefetch-threshold-tokens",
        sglang_extra_config="prefetch_threshold",
        scenario="cache.prefetch_threshold_tokens",
        unit="tokens",
        metavar="N",
    )
    prefetch_timeout_base: float = _amount(
        0,
        2.0,
        help="a timeout prefetch's base seconds",
        flag="--prefetch-timeout-base",
        sglang_extra_config="prefetch_timeout_base",
        scenario="cache.prefetch_timeout_base",
        unit="seconds",
        metavar="S",
    )
    prefetch_timeout_per_ki_token: float = _amount(
        0,
        0.1,
        help="seconds added per 1,024 tokens",
        flag="--prefetch-timeout-per-ki-token",
        sglang_extra_config="prefetch_timeout_per_ki_token",
        scenario="cache.prefetch_timeout_per_ki_token",
        unit="seconds",
        metavar="S",
    )
    prefetch_timeout_max: float = _amount(
        0,
        30.0,
        help="a timeout prefetch's cap",
        flag="--prefetch-timeout-max",
        sglang_extra_config="prefetch_timeout_max",
        scenario="cache.prefetch_timeout_max",
        unit="seconds",
        metavar="S",
    )
    load_batches_in_flight: int = _count(
        1,
        3,
        help="L2 -> L1 load-back batches at once",
        flag="--load-batches-in-flight",
        scenario="cache.load_batches_in_flight",
        metavar="N",
    )
    decode_reserve_tokens: int = _count(
        0,
        512,
        help="L1 tokens held back per request for its output",
        flag="--decode-reserve-tokens",
        sglang=("--num-reserved-decode-tokens",),
        scenario="cache.decode_reserve_tokens",
        unit="tokens",
        metavar="N",
    )
    transfer_retries: int = _count(
        0,
        2,
        help="retries of a failed prefill transfer (with the backoff, about 6-11 s: a prefill restart)",
        flag="--transfer-retries",
        scenario="cache.transfer_retries",
        metavar="N",
        group=TRANSFER,
        node_default=6,
        why_node_default=RESTART_WHY,
    )
    # Seconds before the first retry of a failed transfer, doubling per retry up to the cap and
    # scaled by a deterministic jitter in [0.5, 1) (`hicache.core.backoff`); 0: retry at once.
    transfer_backoff_s: float = _amount(
        0,
        0.0,
        finite=True,
        help="delay before the first retry, doubling per retry, jittered to 50-100%",
        flag="--transfer-backoff",
        scenario="cache.transfer_backoff_s",
        unit="seconds",
        metavar="SECONDS",
        group=TRANSFER,
        node_default=0.2,
        why_node_default=RESTART_WHY,
    )
    transfer_backoff_max_s: float = _amount(
        0,
        5.0,
        finite=True,
        help="longest delay between two retries",
        flag="--transfer-backoff-max",
        scenario="cache.transfer_backoff_max_s",
        unit="seconds",
        metavar="SECONDS",
        group=TRANSFER,
    )
    retract_policy: RetractPolicy = _policy(
        RetractPolicy,
        "retract_policy",
        RetractPolicy.NEWEST,
        help="which running request leaves L1 when it is full",
        flag="--retract-policy",
        scenario="cache.retract_policy",
    )
    # Requests in the decode batch at once (0: no limit). A request whose KV is complete waits
    # in READY, holding its L1 pages, until the batch has room.
    max_running: int = _count(
        0,
        0,
        help="requests in the decode batch at once, 0: no limit",
        flag="--max-running",
        sglang=("--max-running-requests",),
        scenario="cluster.max_running",
        metavar="N",
    )
    tp_size: int = _count(
        1,
        1,
        help="tensor-parallel ranks, one process each (rank 0 starts the others and serves clients); "
        "the model's KV heads must be a multiple of it",
        flag="--tp-size",
        sglang=("--tp-size",),
        group=NODE,
    )
    # Estimates for the adaptive promise (the driver supplies them; bytes and seconds).
    kv_bytes_per_token: float = _amount(
        0, 131072.0, help="KV bytes of one token (the driver's model)", unit="bytes", group=None
    )
    l3_bandwidth: float = _amount(
        1,
        5e9,
        help="L3 read bytes/s",
        flag="--l3-bandwidth",
        scenario="storage.bandwidth",
        unit="bytes/s",
        metavar="B/S",
        group=ESTIMATE,
    )
    l3_latency: float = _amount(
        0,
        2e-3,
        help="L3 seconds per operation",
        flag="--l3-latency",
        scenario="storage.latency",
        unit="seconds",
        metavar="S",
        group=ESTIMATE,
    )
    host_to_device_bandwidth: float = _amount(
        1,
        25e9,
        help="L2 -> L1 bytes/s",
        flag="--host-to-device-bandwidth",
        aliases=("--host-bandwidth",),
        scenario="hardware.host_bandwidth",
        unit="bytes/s",
        metavar="B/S",
        group=ESTIMATE,
    )
    network_bandwidth: float = _amount(
        1,
        25e9,
        help="P->D bytes/s",
        flag="--network-bandwidth",
        scenario="hardware.network_bandwidth",
        unit="bytes/s",
        metavar="B/S",
        group=ESTIMATE,
    )
    network_latency: float = _amount(
        0,
        50e-6,
        help="P->D seconds per transfer",
        flag="--network-latency",
        scenario="hardware.network_latency",
        unit="seconds",
        metavar="S",
        group=ESTIMATE,
    )
    # How prefill ships KV: 0, once it has computed the whole prompt; G > 0, layer by layer in G
    # groups while it computes (SGLang's way), so the transfer hides behind prefill.
    transfer_groups: int = _count(
        0,
        0,
        help="layer groups the prefill node streams KV in (its --layer-groups); 0: sent after prefill",
        flag="--transfer-groups",
        scenario="cluster.layerwise_transfer",
        metavar="G",
        group=ESTIMATE,
    )
    prefill_tokens_per_s: float = _amount(
        1,
        20000.0,
        help="prefill's tokens/s",
        flag="--prefill-tokens-per-s",
        unit="tokens/s",
        metavar="N",
        group=ESTIMATE,
    )
    # Prefill's attention: seconds per (new token, earlier token) pair, on top of the linear
    # rate above; 0: prefill time is linear in the tokens.
    prefill_attention_seconds: float = _amount(
        0,
        0.0,
        finite=True,
        help="prefill seconds per (new, earlier) token pair",
        flag="--prefill-attention-seconds",
        unit="seconds",
        metavar="S",
        group=ESTIMATE,
    )

    def __attrs_post_init__(self) -> None:
        if not self.radix and (self.storage or self.l2_pages):
            raise ValueError("radix=False (no decode cache) needs storage=False and l2_pages=0")

    @property
    def decode_reserve_pages(self) -> int:
        return math.ceil(self.decode_reserve_tokens / self.page_size)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt admission can ever take: L1 less one request's decode reserve."""
        return max(0, self.l1_pages - self.decode_reserve_pages) * self.page_size

    @property
    def max_running_requests(self) -> int:
        """Requests the node can hold at once: `max_running` when set, else as many as L1
        holds when each takes the least admission reserves (one prompt page and its decode
        reserve); a front door sends no more than this and queues the rest."""
        held = max(1, self.l1_pages // (1 + self.decode_reserve_pages))
        return min(self.max_running, held) if self.max_running else held

    @property
    def prefetch_threshold_pages(self) -> int:
        return math.ceil(self.prefetch_threshold_tokens / self.page_size)

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds a `timeout` prefetch of `tokens` may take: base + per-KiB-token term, capped."""
        t = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(t, self.prefetch_timeout_max)


def decode_settings() -> dict[str, Setting]:
    """Every `DecodeConfig` field's `Setting`, by field name, in the class's order."""
    return field_settings(DecodeConfig)


# --- L2's size ---------------------------------------------------------------------------------

HICACHE_RATIO = 2.0  # L2 = 2 x L1 unless told otherwise, as SGLang

# The inputs of `l2_pages` that users state, besides L2's pages themselves (`DecodeConfig.l2_pages`).
L2_SIZE: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            name="hicache_ratio",
            default=HICACHE_RATIO,
            low=0,
            help="L2 pages as a multiple of L1 pages",
            flag="--hicache-ratio",
            sglang=("--hicache-ratio",),
            scenario="cache.hicache_ratio",
            unit="x L1",
            metavar="X",
        ),
        Setting(
            name="hicache_size_gb",
            default=0.0,
            low=0,
            help="L2 in GB of host memory, per rank; overrides --hicache-ratio when > 0",
            flag="--hicache-size",
            sglang=("--hicache-size",),
            unit="GB",
            metavar="GB",
        ),
        Setting(
            name="l2_tokens",
            default=0,
            kind=int,
            low=0,
            help="L2 in tokens (whole pages of them); 0: hicache_ratio x L1",
            scenario="cache.l2_tokens",
            unit="tokens",
            group=None,
        ),
    )
}


def l2_pages(
    l1_pages: int,
    page_size: int,
    *,
    hicache_ratio: float = HICACHE_RATIO,
    l2_tokens: int = 0,
    l2_bytes: float = 0.0,
    page_bytes: int = 0,
) -> int:
    """Pages of a decode node's L2 (host memory), by the first rule that applies:

    - `l2_tokens` > 0: that many tokens, in whole pages (a scenario's `cache.l2_tokens`);
    - `l2_bytes` > 0 with `page_bytes` > 0: that many bytes of host memory, in whole pages of
      `page_bytes` each (SGLang's `--hicache-size`, once the model says what a page weighs);
    - otherwise `hicache_ratio` x L1, counted in tokens and rounded down to whole pages (SGLang's
      `--hicache-ratio`, which multiplies the device pool's tokens).

    An explicit page count (`--l2-pages`) needs no rule: the caller takes it as it is."""
    if l2_tokens > 0:
        return l2_tokens // page_size
    if l2_bytes > 0 and page_bytes > 0:
        return int(l2_bytes // page_bytes)
    return int(hicache_ratio * (l1_pages * page_size)) // page_size


def hicache_ratio_of(l1_pages: int, l2: int, page_size: int) -> float | None:
    """The reverse of `l2_pages`' ratio rule: the ratio (L2 / L1) from which `l2_pages` gives
    back exactly `l2` pages of L1's `l1_pages` (>= 1) -- its token count, not just its pages --
    or None where float rounding of the ratio would lose a token, so that L2 must be stated
    in tokens instead."""
    ratio = l2 / l1_pages
    return ratio if int(ratio * (l1_pages * page_size)) == l2 * page_size else None
