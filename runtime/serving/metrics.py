"""Prometheus metrics of one app, in a registry of its own (two apps in one process, as in the
tests, must not count into each other or into the global registry).

The `sglang:*` series carry SGLang's names, types, buckets and `model_name` label, as SGLang's
`python/sglang/srt/observability/metrics_collector.py` declares them, so that SGLang's Grafana
dashboards and AIPerf's server-metrics summary read this server unchanged. The `hicache_*`
series add what SGLang has no name for: outcomes by API, cached tokens by our tier names, the
front door's queue limits, and every stat the decode nodes report (`hicache_backend_*`, counters
for the cumulative ones, gauges for the rest).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.backend import CUMULATIVE_STATS, TIERS

log = logging.getLogger(__name__)

MODEL_LABEL = "model_name"
# SGLang's default buckets: TokenizerMetricsCollector (TTFT, inter-token, end to end) and
# SchedulerMetricsCollector (queue time).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
    400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip
CACHE_SOURCES = {"l1": "device", "l2": "host", "l3": "storage"}  # our tier -> SGLang's cache_source
ABORTED = frozenset({"abort", "error", "disconnect"})  # outcomes SGLang counts as aborted requests
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
_NODE = re.compile(r"^node\d+_")  # a routed backend's per-node copy of a stat
BACKEND_PREFIX = "hicache_backend_"


def _one(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float) -> Metric:
    family.add_metric(labels, value)
    return family


class _ScrapeFamilies:
    """What is read at the scrape: the front door's queue, the backend's last `stats()` (which
    /metrics refreshes just before) and the gauges SGLang derives from them."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.snapshot: Mapping[str, float] = {}
        self.admission: Admission | None = None

    def describe(self) -> list[Metric]:
        return []  # names depend on the backend; nothing to reserve at registration

    def collect(self) -> Iterator[Metric]:
        yield from self._sglang()
        yield from self._admission()
        yield from self._backend()

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        return _one(GaugeMetricFamily(name, doc, labels=[MODEL_LABEL]), [self.metrics.model], value)

    def _sglang(self) -> Iterator[Metric]:
        s, a, g = self.snapshot, self.admission, self._gauge
        running = s.get("requests_running", None if a is None else float(a.running))
        if running is not None:
            yield g("sglang:num_running_reqs", "The number of running requests.", running)
        if a is not None or "requests_waiting" in s:
            queued = (0.0 if a is None else a.queued) + s.get("requests_waiting", 0.0)
            yield g(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue (the front door's queue and the "
                "decode nodes' requests not yet decoding).",
                queued,
            )
        m = self.metrics
        rate = m.cached_total / m.prompt_total if m.prompt_total else 0.0
        yield g("sglang:cache_hit_rate", "The prefix cache hit rate (all tiers, since start).", rate)
        pages, total = s.get("l1_pages", 0.0), s.get("max_total_tokens", 0.0)
        if not (pages > 0 and total > 0):
            return
        page = total / pages
        used = s.get("l1_pages_used", 0.0)
        yield g("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total)
        yield g("sglang:num_used_tokens", "The number of used tokens.", used * page)
        yield g("sglang:token_usage", "The token usage.", used / pages)
        if s.get("l2_pages", 0.0) > 0:
            yield g("sglang:hicache_host_used_tokens", "Host (L2) tokens in use.", s["l2_pages_used"] * page)
            yield g("sglang:hicache_host_total_tokens", "Host (L2) tokens in all.", s["l2_pages"] * page)
        info = GaugeMetricFamily(
            "sglang:cache_config_info", "Cache configuration information.", labels=["page_size", "num_pages"]
        )
        yield _one(info, [f"{page:g}", f"{pages:g}"], 1.0)
        if "retracted" in s:
            # SGLang's current name, and the older one AIPerf reads its preemptions from.
            for name in ("sglang:num_retracted_requests", "sglang:num_retracted_reqs"):
                doc = "Total number of retracted requests."
                yield _one(CounterMetricFamily(name, doc, labels=[MODEL_LABEL]), [m.model], s["retracted"])

    def _admission(self) -> Iterator[Metric]:
        a = self.admission
        if a is None:
            return
        for name, doc, value in (
            (
                "hicache_requests_running",
                "Requests the front door let through to the decode nodes",
                a.running,
            ),
            ("hicache_requests_queued", "Requests waiting at the front door", a.queued),
            ("hicache_max_running_requests", "Requests the decode nodes take at once", a.max_running),
            ("hicache_max_queued_requests", "Requests the front door queues before a 503", a.max_queued),
            ("hicache_admitted_tokens", "L1 tokens the requests at the decode nodes take", a.tokens),
        ):
            yield GaugeMetricFamily(name, doc, value=value)

    def _backend(self) -> Iterator[Metric]:
        for key, value in sorted(self.snapshot.items()):
            name = BACKEND_PREFIX + _UNSAFE.sub("_", key)
            if _NODE.sub("", key) in CUMULATIVE_STATS:
                yield CounterMetricFamily(name, f"backend count {key}", value=value)
            else:
                yield GaugeMetricFamily(name, f"backend stat {key}", value=value)


class Metrics:
    def __init__(self, model: str = "") -> None:
        """`model`: the `model_name` label of SGLang's series (the served model name)."""
        self.model = model
        self.registry = CollectorRegistry()
        r, label = self.registry, [MODEL_LABEL]
        self.requests = Counter(
            "hicache_requests",
            "Generation requests by API and outcome "
            "(stop, length, abort, error, disconnect, rejected, overloaded)",
            ["api", "outcome"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "hicache_cached_tokens", "Prompt tokens whose KV came from a cache tier", ["tier"], registry=r
        )
        for tier in TIERS:
            self.cached_tokens.labels(tier)  # present at 0 before the first hit

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*label, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r)

        # SGLang's TokenizerMetricsCollector, name for name.
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_by_source = counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            ("cache_source",),
        )
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.num_aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", QUEUE_BUCKETS
        )
        for series in (self.prompt_tokens, self.generation_tokens, self.num_requests, self.num_aborted):
            series.labels(model)  # present at 0 before the first request
        for source in CACHE_SOURCES.values():
            self.cached_by_source.labels(model, source)
        self.prompt_total = 0  # for sglang:cache_hit_rate
        self.cached_total = 0
        self._scrape = _ScrapeFamilies(self)
        r.register(self._scrape)

    def watch(self, admission: Admission) -> None:
        """Report this queue's depth and limits at each scrape."""
        self._scrape.admission = admission

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_time.labels(self.model).observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        """`tokens` came together after `seconds`: one sample each, of their mean gap (as SGLang)."""
        child = self.itl.labels(self.model)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def finished(
        self, api: str, outcome: str, prompt: int, generated: int, cached: Mapping[str, int], e2e_s: float
    ) -> None:
        """A request that reached the backend has ended, whatever the outcome."""
        m = self.model
        self.requests.labels(api, outcome).inc()
        self.num_requests.labels(m).inc()
        if outcome in ABORTED:
            self.num_aborted.labels(m).inc()
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_tokens.labels(m).inc(prompt)
        self.generation_tokens.labels(m).inc(generated)
        for tier in TIERS:
            self.cached_tokens.labels(tier).inc(cached[tier])
            self.cached_by_source.labels(m, CACHE_SOURCES[tier]).inc(cached[tier])
        self.prompt_total += prompt
        self.cached_total += sum(cached[tier] for tier in TIERS)

    def set_backend_stats(self, stats: Mapping[str, object]) -> None:
        clean: dict[str, float] = {}
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not isinstance(key, str):
                log.warning("backend stat %r = %r is not a number; left out of /metrics", key, value)
                continue
            clean[key] = float(value) if math.isfinite(value) else math.nan
        self._scrape.snapshot = clean

    def render(self) -> bytes:
        return generate_latest(self.registry)
