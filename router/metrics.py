"""Prometheus metrics of the router (``pdserve_router_*``), on a registry of its own.

Besides request counts and latency histograms, the router exports what an autoscaler needs, per
pool (prefill, decode, colocated) and read at scrape time: the requests this router has on the
pool's workers, the share of the pool's KV blocks in use and its routable workers. With SLOs set
(``--ttft-slo-seconds``, ``--itl-slo-seconds``) it also exports the share of recent requests
that met each one, over a sliding window, and counters of the requests judged and of those over
the SLO. Every update is O(1) per request; gauges that need the registry view are computed when
Prometheus scrapes.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
POOLS = ("prefill", "decode", "colocated")
SLO_NAMES = ("ttft", "itl")
SLO_WINDOW_SECONDS = 60.0  # how far back the attainment gauges look
SLO_BUCKET_SECONDS = 1.0  # their resolution: outcomes are counted per second, not kept one by one


class RouterMetrics:
    """Requests by status, latency histograms, routing decisions and retries; pool gauges and
    SLO attainment once ``watch_pools`` / ``track_slos`` wire them to their sources."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests",
            "API requests by endpoint and status code (probes and scrapes are not counted)",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pdserve_router_ttft_seconds",
            "Time from request arrival to the first token sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl_seconds = Histogram(
            "pdserve_router_itl_seconds",
            "Time between tokens sent to a streaming client (per token)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "pdserve_router_e2e_seconds",
            "Time from request arrival to its last byte",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.routing = Counter(
            "pdserve_router_routing_decisions",
            "Workers chosen, by pool and policy",
            ["pool", "policy"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_router_retries",
            "Requests moved to another worker, by pool and the failed worker's gRPC status",
            ["pool", "reason"],
            registry=r,
        )
        self.disaggregation = Counter(
            "pdserve_router_disaggregation_decisions",
            "Where prompts were computed when both pools existed: remote (a prefill worker) or "
            "local (the decode worker), and why",
            ["decision", "reason"],
            registry=r,
        )
        self.kv_sources = Counter(
            "pdserve_router_kv_sources",
            "How requests got their prompt's KV: pulled from a prefill worker, recomputed by the "
            "decode worker after a failed pull, local (computed there by choice), colocated",
            ["source"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "pdserve_router_ttft_phase_seconds",
            "The phases on a request's way to its first tokens: prefill_queue, prefill_compute, "
            "kv_transfer, kv_transfer_exposed (after the prefill ended), decode_queue, "
            "decode_first_step (local and colocated prompts: their prefill)",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Tokens generated for clients", registry=r
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight",
            "Sub-requests (prompts x n) being served now: the slots --max-concurrency bounds",
            registry=r,
        )
        self.rejected = Counter(
            "pdserve_router_rejected",
            "Requests refused at admission, by reason (router.admission): unauthenticated, "
            "body_too_large, body_too_deep, over_limit, text_too_long, predicted_wait, and "
            "<pool>_<full|queue_full|queue_timeout> for the tokenizer and the slots",
            ["reason"],
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "pdserve_router_queue_wait_seconds",
            "Time admitted requests waited for their concurrency slots",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.predicted_wait = Gauge(
            "pdserve_router_predicted_wait_seconds",
            "The wait for a first token the router predicted for the latest request "
            "(--max-queue-wait refuses more)",
            registry=r,
        )
        self.slo_requests = Counter(
            "pdserve_router_slo_requests",
            "Requests judged against each latency SLO (only SLOs that are set)",
            ["slo"],
            registry=r,
        )
        self.slo_violations = Counter(
            "pdserve_router_slo_violations",
            "Requests over each latency SLO",
            ["slo"],
            registry=r,
        )
        self.slos: dict[str, SLOTracker] = {}

    def watch_workers(self, count: Callable[[str], int]) -> None:
        """A gauge of routable workers per pool, read at scrape time."""
        gauge = Gauge(
            "pdserve_router_workers", "Routable workers by pool", ["pool"], registry=self.registry
        )
        for pool in POOLS:
            gauge.labels(pool=pool).set_function(functools.partial(count, pool))

    def watch_registry(self, num_rejected: Callable[[], int]) -> None:
        """A gauge of the registry records the view skipped (bad, or not proven), at scrape."""
        Gauge(
            "pdserve_router_registry_records_rejected",
            "Worker records in the registry that the router skips: malformed, or without a valid "
            "proof of the cluster token (each is logged once, with why)",
            registry=self.registry,
        ).set_function(num_rejected)

    def watch_pools(
        self, num_requests: Callable[[str], int], kv_usage: Callable[[str], float]
    ) -> None:
        """Per-pool gauges read at scrape time: ``num_requests(pool)``, the requests this router
        has on the pool's workers, and ``kv_usage(pool)``, the pool's share of KV blocks in use."""
        requests = Gauge(
            "pdserve_router_pool_requests_in_flight",
            "Requests (one per prompt) this router has on the pool's workers now: Prefill calls "
            "queued or computing, Generate streams open",
            ["pool"],
            registry=self.registry,
        )
        usage = Gauge(
            "pdserve_router_pool_kv_blocks_used_ratio",
            "KV blocks in use over KV blocks in all, summed over the pool's routable workers as "
            "they last published them (0 with no worker)",
            ["pool"],
            registry=self.registry,
        )
        for pool in POOLS:
            requests.labels(pool=pool).set_function(functools.partial(num_requests, pool))
            usage.labels(pool=pool).set_function(functools.partial(kv_usage, pool))

    def track_slos(
        self,
        ttft_seconds: float | None,
        itl_seconds: float | None,
        window_seconds: float = SLO_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Judge requests against the SLOs that are set (None: off, and no series for it)."""
        attainment = Gauge(
            "pdserve_router_slo_attainment",
            f"Share of the requests judged in the last {window_seconds:g} s that met the SLO "
            "(1 when none was judged)",
            ["slo"],
            registry=self.registry,
        )
        for name, target in zip(SLO_NAMES, (ttft_seconds, itl_seconds)):
            if target is None:
                continue
            window = SlidingShare(window_seconds, min(SLO_BUCKET_SECONDS, window_seconds), clock)
            self.slos[name] = SLOTracker(
                target,
                self.slo_requests.labels(slo=name),
                self.slo_violations.labels(slo=name),
                window,
            )
            attainment.labels(slo=name).set_function(window.share)

    def judge(self, slo: str, seconds: float) -> None:
        """Count one request's latency against the SLO named ``slo`` (nothing when it is off)."""
        tracker = self.slos.get(slo)
        if tracker is not None:
            tracker.judge(seconds)

    def judge_unanswered(self, waited_seconds: float) -> None:
        """A request that ended without a token: a TTFT miss if it had waited past the SLO (it
        can no longer meet it), not judged otherwise (it failed fast, e.g. on bad input)."""
        tracker = self.slos.get("ttft")
        if tracker is not None and waited_seconds > tracker.target_seconds:
            tracker.judge(waited_seconds)


class SLOTracker:
    """One latency SLO: each judged request counts once, into the counters and the window."""

    def __init__(
        self, target_seconds: float, requests: Counter, violations: Counter, window: SlidingShare
    ):
        self.target_seconds = target_seconds
        self.requests = requests  # this SLO's children of the labelled counters
        self.violations = violations
        self.window = window

    def judge(self, seconds: float) -> None:
        met = seconds <= self.target_seconds
        self.requests.inc()
        if not met:
            self.violations.inc()
        self.window.add(met)


class SlidingShare:
    """The share of good outcomes over the last ``window_seconds`` (1 when there were none).

    Outcomes are counted in buckets of ``bucket_seconds``, so memory is bounded by the window,
    not by the request rate, and ``add`` is amortized O(1). The window's edge moves a bucket at a
    time: an outcome counts for between ``window - bucket`` and ``window`` seconds.
    """

    def __init__(
        self,
        window_seconds: float = SLO_WINDOW_SECONDS,
        bucket_seconds: float = SLO_BUCKET_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < bucket_seconds <= window_seconds:
            raise ValueError(
                f"need 0 < bucket_seconds <= window_seconds, got {bucket_seconds}, {window_seconds}"
            )
        self.bucket_seconds = bucket_seconds
        self.num_buckets = math.ceil(window_seconds / bucket_seconds)
        self.clock = clock
        self._buckets: deque[list[int]] = deque()  # [bucket index, good, total], oldest first
        self._num_good = 0
        self._num_total = 0

    def add(self, good: bool) -> None:
        index = self._expire()
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append([index, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += good
        bucket[2] += 1
        self._num_good += good
        self._num_total += 1

    def share(self) -> float:
        self._expire()
        return self._num_good / self._num_total if self._num_total else 1.0

    def _expire(self) -> int:
        """Drop the buckets that left the window; returns the current bucket's index."""
        index = int(self.clock() // self.bucket_seconds)
        while self._buckets and self._buckets[0][0] <= index - self.num_buckets:
            _, good, total = self._buckets.popleft()
            self._num_good -= good
            self._num_total -= total
        return index
