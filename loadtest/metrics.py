"""Statistics of a run, with ``vllm bench serve``'s definitions and names.

* TTFT: request sent -> first SSE message with non-empty text.
* TPOT (per request): ``(E2EL - TTFT) / (output tokens - 1)``; requests of one token have none.
* ITL: every gap between consecutive text-carrying messages, pooled over all requests.
* E2EL: request sent -> last byte of the response.
* Throughputs divide by the run's duration (first send to last completion).
* Goodput: requests per second that completed *and* met every ``--goodput`` limit (``ttft``,
  ``tpot``, ``e2el``, and ``itl_p99``: the request's own 99th-percentile gap, a stall bound).
* SLO attainment: those good requests over *all* requests sent, failed ones included, so a
  server that sheds load cannot look better than one that serves it slowly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadtest.client import RequestResult, RunOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el", "itl_p99")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds) -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, _, value = part.partition(":")
            if name not in SLO_METRICS or not value:
                raise ValueError(f"--goodput takes {'/'.join(SLO_METRICS)}:<ms>, got {part!r}")
            slos[name] = float(value)
            if slos[name] <= 0:
                raise ValueError(f"an SLO must be positive, got {part!r}")
    return slos


def percentile_name(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9" (vLLM's key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    """Completed and within every limit (a one-token request has no TPOT to miss)."""
    if not result.ok:
        return False
    if "ttft" in slos and result.ttft * 1000 > slos["ttft"]:
        return False
    tpot = result.tpot
    if "tpot" in slos and tpot is not None and tpot * 1000 > slos["tpot"]:
        return False
    stalls = slos.get("itl_p99")
    if stalls is not None and result.itls and np.percentile(result.itls, 99) * 1000 > stalls:
        return False
    return not ("e2el" in slos and result.e2el * 1000 > slos["e2el"])


@dataclass
class Metrics:
    """The summary of one run (times in ms in ``stats``)."""

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    slo_attainment: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, float | None] = field(default_factory=dict)  # None: no samples
    errors: dict[str, int] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (99.0,)


def samples_of(results: list[RequestResult]) -> dict[str, np.ndarray]:
    """Per-metric samples in seconds from the completed requests."""
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    return {
        "ttft": np.array([r.ttft for r in ok]),
        "tpot": np.array(tpots),
        "itl": np.array([x for r in ok for x in r.itls]),
        "e2el": np.array([r.e2el for r in ok]),
    }


def output_timeline(results: list[RequestResult], bucket: float = 1.0) -> np.ndarray:
    """Output tokens per ``bucket`` seconds. A chunk carrying several tokens is not
    distinguishable from the stream, so each request's count is spread over its chunks."""
    ends = [r.chunk_times[-1] for r in results if r.ok and r.chunk_times]
    if not ends:
        return np.zeros(0)
    counts = np.zeros(int(max(ends) // bucket) + 1)
    for r in results:
        if r.ok and r.chunk_times:
            weight = r.output_len / len(r.chunk_times)
            idx = (np.asarray(r.chunk_times) // bucket).astype(int)
            np.add.at(counts, idx, weight)
    return counts / bucket


def concurrency_steps(results: list[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(times, requests in flight just after each time): the exact step function."""
    events = sorted(
        [(r.start, 1) for r in results] + [(r.end, -1) for r in results],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    if not events:
        return np.zeros(0), np.zeros(0)
    times = np.array([t for t, _ in events])
    level = np.cumsum([d for _, d in events])
    return times, level


def compute(
    run: RunOutput,
    slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99.0,),
) -> Metrics:
    """The summary statistics of ``run``."""
    slos = slos or {}
    results = run.results
    ok = [r for r in results if r.ok]
    duration = run.duration if run.duration > 0 else float("nan")
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    good = sum(meets(r, slos) for r in results) if slos else None
    _, level = concurrency_steps(results)
    timeline = output_timeline(results)
    stats: dict[str, float | None] = {}
    for name, values in samples_of(results).items():
        ms = values * 1000
        # A metric without samples (nothing completed, no stream, one-token answers) is None:
        # "n/a" in the table and null in the JSON, never a 0 that reads as a measurement.
        stats[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        stats[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else None
        stats[f"std_{name}_ms"] = float(ms.std()) if ms.size else None
        for p in percentiles:
            value = float(np.percentile(ms, p)) if ms.size else None
            stats[f"{percentile_name(p)}_{name}_ms"] = value
    return Metrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration=run.duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        request_goodput=None if good is None else good / duration,
        slo_attainment=None if good is None else good / max(len(results), 1),
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        max_output_tokens_per_s=float(timeline.max()) if timeline.size else 0.0,
        max_concurrent_requests=int(level.max()) if level.size else 0,
        stats=stats,
        errors=dict(Counter(r.error for r in results if not r.ok)),
        percentiles=tuple(percentiles),
    )
