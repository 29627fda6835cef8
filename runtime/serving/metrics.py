"""Prometheus metrics of one app, in a registry of its own (two apps in one process, as in the
tests, must not count into each other or into the global registry)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from hicache.runtime.serving.admission import Admission
from hicache.runtime.serving.backend import TIERS

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
BACKEND_PREFIX = "hicache_backend_"


class _BackendGauges:
    """Renders the last `Backend.stats()` snapshot; /metrics refreshes it just before."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, float] = {}

    def describe(self) -> list[Metric]:
        return []  # names depend on the backend; nothing to reserve at registration

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self.snapshot.items()):
            yield GaugeMetricFamily(
                BACKEND_PREFIX + _UNSAFE.sub("_", key), f"backend stat {key}", value=value
            )


class _AdmissionGauges:
    """The front door's queue as it is at the scrape, under our names and SGLang's."""

    def __init__(self) -> None:
        self.admission: Admission | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        a = self.admission
        if a is None:
            return
        running, queued = float(a.running), float(a.queued)
        yield GaugeMetricFamily("sglang:num_running_reqs", "Requests running (SGLang's name)", value=running)
        yield GaugeMetricFamily("sglang:num_queue_reqs", "Requests queued (SGLang's name)", value=queued)
        yield GaugeMetricFamily("hicache_requests_running", "Requests at the decode nodes", value=running)
        yield GaugeMetricFamily("hicache_requests_queued", "Requests waiting at the front door", value=queued)
        yield GaugeMetricFamily(
            "hicache_max_running_requests", "Requests the decode nodes take at once", value=a.max_running
        )
        yield GaugeMetricFamily(
            "hicache_max_queued_requests", "Requests the front door queues before a 503", value=a.max_queued
        )
        yield GaugeMetricFamily(
            "hicache_admitted_tokens", "L1 tokens the requests at the decode nodes take", value=a.tokens
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hicache_requests",
            "Generation requests by API and outcome "
            "(stop, length, abort, error, disconnect, rejected, overloaded)",
            ["api", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "hicache_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "hicache_inter_token_latency_seconds",
            "Time per output token after the first (TPOT), one sample per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hicache_e2e_request_latency_seconds",
            "From the request's arrival to its end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "hicache_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("hicache_generation_tokens", "Output tokens produced", registry=r)
        self.cached_tokens = Counter(
            "hicache_cached_tokens", "Prompt tokens whose KV came from a cache tier", ["tier"], registry=r
        )
        for tier in TIERS:
            self.cached_tokens.labels(tier)  # present at 0 before the first hit
        self.queue_wait = Histogram(
            "hicache_queue_wait_seconds",
            "Time a request waited in the front door's queue before reaching a decode node",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "The same wait, under SGLang's name",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._backend = _BackendGauges()
        r.register(self._backend)
        self._admission = _AdmissionGauges()
        r.register(self._admission)

    def watch(self, admission: Admission) -> None:
        """Report this queue's depth and limits at each scrape."""
        self._admission.admission = admission

    def observe_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)
        self.queue_time.observe(seconds)

    def set_backend_stats(self, stats: Mapping[str, object]) -> None:
        clean: dict[str, float] = {}
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not isinstance(key, str):
                log.warning("backend stat %r = %r is not a number; left out of /metrics", key, value)
                continue
            clean[key] = float(value) if math.isfinite(value) else math.nan
        self._backend.snapshot = clean

    def render(self) -> bytes:
        return generate_latest(self.registry)
