"""Runs of several rates: a sweep over given rates, and the search for the highest rate that
still meets the SLOs (bisection on the rate)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.arrivals import Schedule
from loadtest.client import ClientConfig, RunOutput, run
from loadtest.control import Stop
from loadtest.datasets import Sample
from loadtest.metrics import Metrics, compute
from loadtest.report import result_dict


@dataclass
class Probe:
    """One run at one rate."""

    rate: float
    attainment: float
    summary: dict[str, Any]


@dataclass
class SearchResult:
    """The highest rate that met the SLOs (0 when none did), and every probe on the way."""

    max_rate: float
    target: float
    probes: list[Probe] = field(default_factory=list)
    converged: bool = False
    stopped: str = ""  # why the search ended early (Ctrl-C, a 4xx)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_rate": self.max_rate,
            "slo_attainment_target": self.target,
            "converged": self.converged,
            "stopped": self.stopped or None,
            "probes": [
                {"rate": p.rate, "slo_attainment": p.attainment, **p.summary} for p in self.probes
            ],
        }


@dataclass
class RunSpec:
    """Everything except the rate: what a sweep or a search repeats at each rate."""

    cfg: ClientConfig
    samples: list[Sample]
    schedule: Schedule
    num_prompts: int | None
    duration: float | None = None
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)
    count: Callable[[str], int] | None = None
    stop: Stop | None = None  # Ctrl-C ends the current run and the series
    settings: dict[str, Any] = field(default_factory=dict)  # the saved results' config

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set


async def run_at(spec: RunSpec, rate: float) -> tuple[RunOutput, Metrics]:
    """One run of ``spec`` at ``rate`` (the same samples and seed each time, so rates differ
    only in their timing)."""
    schedule = replace(spec.schedule, rate=rate, ramp_start_rate=None, ramp_end_rate=None)
    out = await run(
        spec.cfg,
        spec.samples,
        schedule,
        spec.num_prompts,
        spec.duration,
        spec.seed,
        spec.count,
        spec.stop,
    )
    return out, compute(out, spec.slos, spec.percentiles)


async def sweep(
    spec: RunSpec, rates: list[float], on_run: Callable[[float, RunOutput, Metrics], None]
) -> list[dict[str, Any]]:
    """A run per rate; ``on_run`` sees each (to print or save it). Returns the summaries (of
    the runs done so far when the series is stopped)."""
    points = []
    for rate in rates:
        out, m = await run_at(spec, rate)
        on_run(rate, out, m)
        summary = result_dict(spec.cfg, out, m, detail=False, settings=spec.settings)
        summary["slo_attainment"] = m.slo_attainment
        points.append(summary)
        if spec.stopped:
            break
    return points


async def search(
    spec: RunSpec,
    target: float = 0.95,
    start_rate: float = 1.0,
    tolerance: float = 0.05,
    max_probes: int = 12,
    on_probe: Callable[[Probe], None] | None = None,
) -> SearchResult:
    """Bisection on the rate for the highest one whose SLO attainment (good requests over all
    requests sent, failures included) is at least ``target``. The rate doubles from
    ``start_rate`` until a run misses, then the bracket halves until it is within
    ``tolerance`` (relative) or ``max_probes`` runs have been spent.

    Attainment falls with the rate because queueing grows, not smoothly in a single run's noise,
    so each probe should be long enough (``num_prompts``/``duration``) to build a queue."""
    if not spec.slos:
        raise ValueError("--slo-search needs limits: --goodput ttft:<ms> tpot:<ms>")
    result = SearchResult(max_rate=0.0, target=target)
    passing, failing = 0.0, math.inf
    rate = start_rate
    while len(result.probes) < max_probes:
        out, m = await run_at(spec, rate)
        attainment = m.slo_attainment or 0.0
        summary = result_dict(spec.cfg, out, m, detail=False, settings=spec.settings)
        probe = Probe(rate, attainment, summary)
        if spec.stop is not None and spec.stop.is_set:  # a cut-short probe says nothing
            result.stopped = spec.stop.reason
            break
        result.probes.append(probe)
        if on_probe is not None:
            on_probe(probe)
        if attainment >= target:
            passing = max(passing, rate)
        else:
            failing = min(failing, rate)
        if math.isinf(failing):
            rate = rate * 2
        elif passing == 0.0:
            rate = rate / 2
        else:
            if (failing - passing) / failing <= tolerance:
                result.converged = True
                break
            rate = (passing + failing) / 2
    result.max_rate = passing
    return result
