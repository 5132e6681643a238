"""Prometheus metrics of KV transfers, safe to share between many servers and clients.

The metric objects are created once per ``CollectorRegistry`` (the default registry unless one
is passed) and cached, so building a second server or client in the same process reuses them
instead of failing with "Duplicated timeseries":

- ``pdserve_kv_transfer_bytes_total{transport, direction}`` (direction: sent | received)
- ``pdserve_kv_transfer_seconds{transport}`` (histogram of completed transfers)
- ``pdserve_kv_transfer_failures_total{transport, reason}``
- ``pdserve_kv_transfer_faults_injected_total{transport, kind}`` (testing only: faults a server
  injected on purpose, see :mod:`kvtransfer.faults`)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# 100 us .. ~100 s: a 16-token pull on loopback is well under a millisecond.
SECONDS_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


@dataclass(frozen=True)
class TransferMetrics:
    """The KV transfer metrics registered in one registry."""

    bytes_total: Counter
    seconds: Histogram
    failures_total: Counter
    faults_total: Counter

    def observe(self, transport: str, direction: str, num_bytes: int, seconds: float) -> None:
        """Count one completed transfer."""
        self.bytes_total.labels(transport=transport, direction=direction).inc(num_bytes)
        self.seconds.labels(transport=transport).observe(seconds)

    def fail(self, transport: str, reason: str) -> None:
        """Count one failed or refused transfer."""
        self.failures_total.labels(transport=transport, reason=reason).inc()

    def inject(self, transport: str, kind: str) -> None:
        """Count one fault injected on purpose (kvtransfer.faults)."""
        self.faults_total.labels(transport=transport, kind=kind).inc()


_lock = threading.Lock()
_by_registry: dict[int, tuple[CollectorRegistry, TransferMetrics]] = {}


def get_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    """The metrics of ``registry`` (default: the global one), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        cached = _by_registry.get(id(registry))
        if cached is not None and cached[0] is registry:
            return cached[1]
        metrics = TransferMetrics(
            bytes_total=Counter(
                "pdserve_kv_transfer_bytes",
                "KV cache bytes moved by the KV transfer layer.",
                ["transport", "direction"],
                registry=registry,
            ),
            seconds=Histogram(
                "pdserve_kv_transfer_seconds",
                "Wall time of completed KV transfers.",
                ["transport"],
                buckets=SECONDS_BUCKETS,
                registry=registry,
            ),
            failures_total=Counter(
                "pdserve_kv_transfer_failures",
                "KV transfers that failed or were refused, by reason.",
                ["transport", "reason"],
                registry=registry,
            ),
            faults_total=Counter(
                "pdserve_kv_transfer_faults_injected",
                "Faults injected on purpose into served KV pulls (--kv-faults; testing only).",
                ["transport", "kind"],
                registry=registry,
            ),
        )
        _by_registry[id(registry)] = (registry, metrics)
        return metrics
