"""Prometheus metrics of a worker (names prefixed ``pdserve_``), on a registry of its own.

Counters and histograms are updated where things happen; the engine's state (blocks, queue,
running, pinned, pulling, prefix-cache and preemption counters) is read from its latest
``EngineStats`` when Prometheus scrapes, so it is never stale and costs nothing in between. A
worker exports only what its role does: prefill metrics on prefill and colocated workers, decode
metrics on decode and colocated workers. Every metric is described in docs/metrics.md (a test
compares the two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.engine.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STEP_KINDS = ("prompt", "decode", "mixed")  # services.worker.async_engine.StepTiming.kind
PREFILL_ROLES = ("prefill", "colocated")
DECODE_ROLES = ("decode", "colocated")


class WorkerMetrics:
    """All metrics of one worker process."""

    def __init__(
        self,
        role: str,
        stats: Callable[[], EngineStats],
        registry: CollectorRegistry | None = None,
        gemm_paths: Sequence[tuple[str, str, str]] = (),
    ):
        """``gemm_paths``: (layer shape, row bucket, path) of the engine's CPU GEMMs."""
        self.registry = registry or CollectorRegistry()
        r = self.registry
        Gauge("pdserve_worker_info", "Constant 1, labelled with the worker's pool", ["pool"],
              registry=r).labels(pool=role).set(1)  # fmt: skip
        paths = Gauge(
            "pdserve_gemm_path_info",
            "Constant 1 per CPU GEMM shape (outxin) and row bucket, labelled with the path the "
            "engine runs it on",
            ["shape", "rows", "path"],
            registry=r,
        )
        for shape, rows, path in gemm_paths:
            paths.labels(shape=shape, rows=rows, path=path).set(1)
        self.requests = Counter(
            "pdserve_requests",
            "Requests a worker ended, by outcome: finished, pinned (prefill: KV handed over), "
            "aborted (prefill: its pin ended while it computed, or the engine failed), "
            "invalid (refused as bad input), rejected (draining or full)",
            ["outcome"],
            registry=r,
        )
        self.grpc_refused = Counter(
            "pdserve_grpc_refused",
            "gRPC calls refused for a missing or wrong cluster token",
            registry=r,
        )
        self.step_seconds = Histogram(
            "pdserve_engine_step_seconds",
            "Wall time of one engine step on its thread, by what it held: prompt (prompt "
            "chunks only), decode (decoding sequences only), mixed (both)",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for kind in STEP_KINDS:  # every series from the start, at zero
            self.step_seconds.labels(kind=kind)
        self.grpc_malformed = Counter(
            "pdserve_grpc_malformed",
            "gRPC calls whose request bytes did not parse (answered INVALID_ARGUMENT)",
            registry=r,
        )
        if role in PREFILL_ROLES:
            self.prefill_seconds = Histogram(
                "pdserve_prefill_seconds",
                "Queue + prefill time of a request on a prefill worker",
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
            self.lease_expirations = Counter(
                "pdserve_lease_expirations",
                "Pinned-block leases that ran out before the decode worker released them",
                registry=r,
            )
        if role in DECODE_ROLES:
            self.pull_seconds = Histogram(
                "pdserve_kv_pull_seconds",
                "Wait for room + KV pull time of a disaggregated request on a decode worker",
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
            self.pulls = Counter(
                "pdserve_kv_pulls",
                "How disaggregated requests got their prompt's KV: pulled, recomputed (the pull "
                "failed or the prefill worker's blocks were gone), failed (--on-pull-failure fail)",
                ["outcome"],
                registry=r,
            )
            self.itl_seconds = Histogram(
                "pdserve_inter_token_seconds",
                "Time between streamed chunks of a request",
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        r.register(EngineCollector(role, stats))

    def watch_pins(self, num_pins: Callable[[], int], num_readers: Callable[[], int]) -> None:
        """Export the pin owner's state (a prefill worker's): read at scrape time."""
        Gauge(
            "pdserve_kv_pins",
            "KV handles whose blocks are held: pinned, or released or expired while still read",
            registry=self.registry,
        ).set_function(num_pins)
        Gauge(
            "pdserve_kv_readers",
            "Transfers reading pinned KV blocks now (no block is freed under one)",
            registry=self.registry,
        ).set_function(num_readers)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


class EngineCollector(Collector):
    """The engine's state, read from its latest stats at scrape time."""

    def __init__(self, role: str, stats: Callable[[], EngineStats]):
        self.role = role
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        blocks = GaugeMetricFamily(
            "pdserve_kv_blocks",
            "KV blocks by state: used (held by a sequence), cached (held by no sequence, keeping "
            "a reusable prefix until evicted), free (holding nothing); they sum to the capacity",
            labels=["state"],
        )
        blocks.add_metric(["used"], s.kv_blocks_used)
        blocks.add_metric(["cached"], s.kv_blocks_cached)
        blocks.add_metric(["free"], s.kv_blocks_free)
        yield blocks
        yield GaugeMetricFamily(
            "pdserve_kv_blocks_capacity", "KV blocks in the pool", value=s.kv_blocks_total
        )
        yield GaugeMetricFamily(
            "pdserve_num_running", "Sequences in the running batch", value=s.num_running
        )
        yield GaugeMetricFamily(
            "pdserve_num_waiting",
            "Sequences not running yet: queued, swapped out, or (decode) waiting for their KV",
            value=s.num_waiting,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (hit rate: rate(hits) / rate(queries))",
            value=s.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            "pdserve_preemptions",
            "Sequences preempted for lack of KV blocks",
            value=s.num_preemptions,
        )
        if self.role in PREFILL_ROLES:
            yield GaugeMetricFamily(
                "pdserve_pinned_requests",
                "Prefill-only requests whose blocks wait to be pulled",
                value=s.num_pinned,
            )
        if self.role in DECODE_ROLES:
            yield GaugeMetricFamily(
                "pdserve_pulling_requests",
                "Disaggregated requests waiting for room to pull their KV, or pulling it",
                value=s.num_pulling,
            )
