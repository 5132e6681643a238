"""Prometheus metrics of the router (``pdserve_router_*``), on a registry of its own."""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    """Requests by status, latency histograms, routing decisions and retries."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests",
            "HTTP requests by endpoint and status code",
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
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_router_generation_tokens", "Tokens generated for clients", registry=r
        )
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight", "Requests being served now", registry=r
        )

    def watch_workers(self, count: Callable[[str], int]) -> None:
        """A gauge of routable workers per role, read at scrape time."""
        gauge = Gauge(
            "pdserve_router_workers", "Routable workers by role", ["role"], registry=self.registry
        )
        for role in ("prefill", "decode", "colocated"):
            gauge.labels(role=role).set_function(functools.partial(count, role))
