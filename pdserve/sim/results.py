"""A simulated run as the load tester's results, so its statistics are the load tester's own.

Every simulated request becomes a ``loadtest.client.RequestResult`` (TTFT, E2EL, the gaps
between its tokens, one streamed message per token) in a ``RunOutput``, and
``loadtest.metrics.compute`` summarises it: TTFT/TPOT/ITL percentiles, goodput and SLO
attainment have exactly the definitions of a measured run.
"""

from __future__ import annotations

import numpy as np

from loadtest.arrivals import achieved_rate
from loadtest.client import RequestResult, RunOutput
from loadtest.metrics import Metrics, compute
from pdserve.sim.cluster import SimResult
from pdserve.sim.trace import Trace
from pdserve.sim.worker import SimRequest


def request_result(request: SimRequest) -> RequestResult:
    times = request.token_times
    return RequestResult(
        index=request.index,
        ok=True,
        prompt_len=request.prompt_tokens,
        output_len=len(times),
        ttft=times[0] - request.arrival_s,
        e2el=times[-1] - request.arrival_s,
        start=request.arrival_s,
        itls=np.diff(times).tolist(),
        chunk_times=list(times),
        usage_reported=True,
    )


def run_output(trace: Trace, result: SimResult) -> RunOutput:
    """The load tester's ``RunOutput`` of a simulated run (failed requests: not admitted)."""
    results = [request_result(r) for r in result.requests]
    results += [
        RequestResult(index=r.index, error="refused", prompt_len=r.prompt_tokens, start=r.arrival_s)
        for r in result.failed
    ]
    sends = [r.arrival_s for r in trace.requests]
    ends = [r.end for r in results if r.ok] or [sends[-1]]
    return RunOutput(
        results=sorted(results, key=lambda r: r.index),
        duration=max(ends) - sends[0],
        send_times=sends,
        schedule=trace.schedule,
        achieved_rate=achieved_rate(sends),
    )


def metrics_of(
    trace: Trace,
    result: SimResult,
    slos_ms: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0),
) -> Metrics:
    """``loadtest.metrics.compute`` on the simulated run; ``slos_ms`` as ``--goodput`` takes
    them (``ttft``, ``tpot``, ``e2el``, ``itl_p99`` in ms)."""
    return compute(run_output(trace, result), slos_ms, percentiles)
