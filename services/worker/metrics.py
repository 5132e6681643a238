"""Prometheus metrics of a worker (names prefixed ``pdserve_``), on a registry of its own.

Counters and histograms are updated where things happen; engine gauges (blocks, queue, running)
are read from the engine at scrape time, so they are never stale and cost nothing between
scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    """All metrics of one worker process."""

    def __init__(self, role: str, engine: LLMEngine, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prefill_seconds = Histogram(
            "pdserve_prefill_seconds",
            "Queue + prefill time of a request on a prefill worker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pull_seconds = Histogram(
            "pdserve_kv_pull_seconds",
            "Reservation + KV pull time on a decode worker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pulls = Counter(
            "pdserve_kv_pulls",
            "KV pulls by outcome (pulled, recomputed, failed)",
            ["outcome"],
            registry=r,
        )
        self.lease_expirations = Counter(
            "pdserve_lease_expirations",
            "Pinned block leases that ran out before Release",
            registry=r,
        )
        self.itl_seconds = Histogram(
            "pdserve_inter_token_seconds",
            "Time between streamed chunks of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grpc_refused = Counter(
            "pdserve_grpc_refused",
            "gRPC calls refused for a missing or wrong cluster token",
            registry=r,
        )
        self.grpc_malformed = Counter(
            "pdserve_grpc_malformed",
            "gRPC calls whose request bytes did not parse (answered INVALID_ARGUMENT)",
            registry=r,
        )
        self._engine_gauges(role, engine)

    def _engine_gauges(self, role: str, engine: LLMEngine) -> None:
        r, pool, sched = self.registry, engine.pool, engine.scheduler
        Gauge(
            "pdserve_worker_info", "Constant 1, labelled with the role", ["role"], registry=r
        ).labels(role=role).set(1)
        blocks = Gauge("pdserve_kv_blocks", "KV blocks by state", ["state"], registry=r)
        blocks.labels(state="total").set_function(lambda: pool.num_blocks)
        blocks.labels(state="used").set_function(lambda: pool.num_used_blocks)
        blocks.labels(state="cached").set_function(lambda: pool.num_cached_blocks)
        blocks.labels(state="free").set_function(lambda: pool.num_free_blocks)
        Gauge("pdserve_num_running", "Sequences in the running batch", registry=r).set_function(
            lambda: len(sched.running)
        )
        Gauge(
            "pdserve_num_waiting",
            "Sequences not running yet: queued, swapped out, or (decode) waiting for their KV",
            registry=r,
        ).set_function(lambda: sched.num_waiting + engine.num_pulling_requests)
        Gauge(
            "pdserve_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache",
            registry=r,
        ).set_function(lambda: pool.prefix_hit_rate)
        Gauge(
            "pdserve_preemptions",
            "Preemptions since start (a counter, read from the engine)",
            registry=r,
        ).set_function(lambda: sched.num_preemptions)
        Gauge(
            "pdserve_pinned_requests", "Prefill-only requests holding pinned blocks", registry=r
        ).set_function(lambda: engine.num_pinned_requests)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
