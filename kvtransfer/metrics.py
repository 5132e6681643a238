"""Prometheus metrics of KV transfers: one ``TransferMetrics`` per registry, shared by every
server and client of a process (a worker makes one on its own registry and hands it to its
transport). An endpoint built without one counts into a private registry of its own.

- ``pdserve_kv_transfer_bytes_total{transport, direction}`` (direction: sent | received)
- ``pdserve_kv_transfer_seconds{transport}`` (histogram of completed transfers)
- ``pdserve_kv_transfer_failures_total{transport, reason}``
- ``pdserve_kv_transfer_faults_injected_total{transport, kind}`` (testing only: faults a server
  injected on purpose, see :mod:`kvtransfer.faults`)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# 100 us .. ~100 s: a 16-token pull on loopback is well under a millisecond.
SECONDS_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


class TransferMetrics:
    """The KV transfer metrics, registered in ``registry`` (a new private one if None)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.bytes_total = Counter(
            "pdserve_kv_transfer_bytes",
            "KV cache bytes moved by the KV transfer layer",
            ["transport", "direction"],
            registry=r,
        )
        self.seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Wall time of completed KV transfers",
            ["transport"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.failures_total = Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that failed or were refused, by reason",
            ["transport", "reason"],
            registry=r,
        )
        self.faults_total = Counter(
            "pdserve_kv_transfer_faults_injected",
            "Faults injected on purpose into served KV pulls (--kv-faults; testing only)",
            ["transport", "kind"],
            registry=r,
        )

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
