"""Where a run's TTFT went, from the router's own metrics: the mean of each TTFT phase
(``pdserve_router_ttft_phase_seconds{phase}``), how requests got their KV
(``pdserve_router_kv_sources_total{source}``) and the disaggregation decisions
(``pdserve_router_disaggregation_decisions_total{decision, reason}``), as the difference of two
scrapes of ``/metrics`` taken around the run (docs/metrics.md defines them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PHASE = "pdserve_router_ttft_phase_seconds"
SOURCES = "pdserve_router_kv_sources_total"
DECISIONS = "pdserve_router_disaggregation_decisions_total"
PHASES = (
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "kv_transfer_exposed",
    "decode_queue",
    "decode_first_step",
)


@dataclass
class Snapshot:
    """The router's phase sums and counts, KV sources and decisions at one moment."""

    phase_sum: dict[str, float] = field(default_factory=dict)
    phase_count: dict[str, float] = field(default_factory=dict)
    sources: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)


def scrape(router_url: str) -> Snapshot:
    """One read of the router's ``/metrics``."""
    text = httpx.get(router_url + "/metrics", timeout=10).text
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == PHASE + "_sum":
                snap.phase_sum[labels["phase"]] = sample.value
            elif sample.name == PHASE + "_count":
                snap.phase_count[labels["phase"]] = sample.value
            elif sample.name == SOURCES:
                snap.sources[labels["source"]] = sample.value
            elif sample.name == DECISIONS:
                key = f"{labels['decision']}:{labels['reason']}"
                snap.decisions[key] = sample.value
    return snap


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def difference(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """What happened between two scrapes: mean ms per phase (phases no request went through
    are left out), and the counts of KV sources and decisions."""
    sums = _delta(after.phase_sum, before.phase_sum)
    counts = _delta(after.phase_count, before.phase_count)
    mean_ms = {p: 1000.0 * sums.get(p, 0.0) / counts[p] for p in PHASES if counts.get(p)}
    return {
        "mean_ms": mean_ms,
        "requests_per_phase": counts,
        "kv_sources": _delta(after.sources, before.sources),
        "decisions": _delta(after.decisions, before.decisions),
    }


def format_row(name: str, rate: str, phases: dict[str, Any]) -> str:
    """One line: the phase means (ms) and the KV sources of one run."""
    cells = "".join(
        f"{phases['mean_ms'][p]:>10.0f}" if p in phases["mean_ms"] else f"{'-':>10}" for p in PHASES
    )
    sources = ", ".join(f"{k} {v:.0f}" for k, v in sorted(phases["kv_sources"].items()))
    return f"{name:<12}{rate:>6}{cells}  {sources}"


def header() -> str:
    short = ("P queue", "P compute", "transfer", "exposed", "D queue", "D 1st step")
    return f"{'config':<12}{'rate':>6}" + "".join(f"{s:>10}" for s in short) + "  KV sources"
