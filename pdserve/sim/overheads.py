"""Costs of a real deployment outside the workers' engine steps, for :mod:`pdserve.sim`.

A measured TTFT is not only steps: the client sends over HTTP, the router picks workers and
opens gRPC streams, the worker tokenizes and queues the request, and the first token travels
back the same way. On the recorded Zen 4 sweep (``benchmarks/recorded/goodput-zen4.json``) the
unloaded TTFTs of every configuration sit on ``hop + step(prompt)`` with one ``hop`` of a few
tens of ms that no step explains; ``benchmarks/sim_accuracy.py`` measures it from those
unloaded rows only (a least-squares line through them, see its ``calibrate``).

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
