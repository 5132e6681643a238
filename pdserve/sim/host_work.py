"""Steps lengthened by the serving work of the host they run on (issue #32).

A profile times each engine step with nothing else running. On a host that also runs the router
and the clients (the recorded sweep's 2-core machine), every request costs CPU outside the
engine: the client's send, the router's admission and its call to the worker, the worker's own
handler; and again when its stream ends. That CPU comes out of whatever steps are computing at
the time. A 2-thread step is as slow as its slower thread, so it loses about what was taken
from either core. ``benchmarks/host_work.py`` measures this from a worker's ``--step-log`` and
the router's trace: decode steps during which a request arrived, or finished, against the same
steps without one. On the Zen 4 VM (``benchmarks/profiles/zen4-host-work.json``) an arrival
costs a 2-thread step about 5 ms and each 1-thread step about 3 ms, and a finish 1-2 ms. For the
short chatbot prompts at a busy worker, this is most of what the simulator lacked
(docs/simulator.md, "Where the ~20 ms goes").

The rule: when a request reaches the router, every step in progress on the host ends
``arrival_s`` later; when a request finishes, every step in progress then, the finishing
worker's next one included, ends ``finish_s`` later. An idle host loses nothing, so the
unloaded rows the simulator is calibrated on are unchanged. ``HostWork()`` (both zero) is a host
of its own per worker, as in a real cluster where the router runs elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostWork:
    """Seconds every step in progress on the host loses per request event."""

    arrival_s: float = 0.0
    finish_s: float = 0.0

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.finish_s < 0:
            raise ValueError(f"host work must be >= 0, got {self}")

    @classmethod
    def load(cls, path: Path, threads: int) -> HostWork:
        """The figures for workers of ``threads`` torch threads in a file written by
        ``benchmarks/host_work.py``."""
        by_threads = json.loads(Path(path).read_text())["threads"]
        figures = by_threads[str(threads)]
        return cls(float(figures["arrival_s"]), float(figures["finish_s"]))
