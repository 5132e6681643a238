"""Costs of a real deployment outside the workers' engine steps, for :mod:`pdserve.sim`.

A measured TTFT is not only steps: the client sends over HTTP, the router picks workers and
opens gRPC streams, the worker tokenizes and queues the request, and the first token travels
back the same way. ``benchmarks/sim_accuracy.py`` measures that ``hop`` from a sweep's
unloaded rows only (a least-squares line ``hop + step(prompt)`` through their TTFTs, see its
``calibrate``): 6 ms on the Zen 4 sweep recorded before 2026-11-26, 0 on the one recorded since
(``benchmarks/recorded/goodput-zen4.json``: the prefill scale absorbs it).

The simulator takes such a cost as a delay between a request's send and its arrival in the
router's queue: its first token, and every later one, comes that much later, so TTFT and E2EL
grow by it and the gaps between tokens do not (the per-token part of the relay, ~30-40 us a
token in ``benchmarks/gateway_overhead.py``, is hidden behind steps of tens of ms).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overheads:
    """Per-request costs outside the engine steps (seconds)."""

    request_s: float = 0.0  # send -> in the router's hands and the first token back, together

    def __post_init__(self) -> None:
        if self.request_s < 0:
            raise ValueError(f"request_s must be >= 0, got {self.request_s}")

    def arrival(self, send_s: float) -> float:
        """When a request sent at ``send_s`` reaches the router's routing decision."""
        return send_s + self.request_s
