"""When requests are sent: Poisson, gamma (bursty), constant, all-at-once, and a linear ramp.

A schedule is a sequence of *gaps* (seconds between consecutive arrivals). Gaps are drawn from
a gamma distribution with shape ``b`` (the burstiness) and scale ``1 / (rate * b)``, so the mean
gap is always ``1 / rate`` while the coefficient of variation is ``1 / sqrt(b)``:

* ``b = 1``   -> exponential gaps, i.e. a Poisson process (CV 1);
* ``b < 1``   -> burstier than Poisson (b = 0.5: CV sqrt(2));
* ``b > 1``   -> more regular than Poisson (b = 4: CV 0.5);
* ``b = inf`` -> constant gaps (CV 0);
* ``rate = inf`` -> every gap is zero (all requests at once).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass
class Schedule:
    """How fast to send. ``ramp_start_rate``/``ramp_end_rate`` (both set) override ``rate``
    with a rate that moves linearly from start to end over the run (by request index when the
    run has a request count, otherwise by elapsed time over ``ramp_duration``)."""

    rate: float = math.inf
    burstiness: float = 1.0
    ramp_start_rate: float | None = None
    ramp_end_rate: float | None = None
    ramp_duration: float | None = None

    @property
    def ramped(self) -> bool:
        return self.ramp_start_rate is not None and self.ramp_end_rate is not None

    def describe(self) -> str:
        if self.ramped:
            return f"ramp {self.ramp_start_rate:g}->{self.ramp_end_rate:g} req/s"
        return "inf (all at once)" if math.isinf(self.rate) else f"{self.rate:g} req/s"


def gap(rate: float, burstiness: float, rng: np.random.Generator) -> float:
    """One gap for the given instantaneous rate (see the module docstring)."""
    if math.isinf(rate):
        return 0.0
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(burstiness):
        return 1.0 / rate
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    return float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


def gaps(rate: float, burstiness: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` independent gaps at a fixed rate (vectorised ``gap``)."""
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def ramp_rate(schedule: Schedule, index: int, total: int | None, elapsed: float) -> float:
    """The instantaneous rate of a linear ramp at request ``index`` / ``elapsed`` seconds."""
    assert schedule.ramp_start_rate is not None and schedule.ramp_end_rate is not None
    if total is not None and total > 1:
        fraction = index / (total - 1)
    elif schedule.ramp_duration:
        fraction = min(elapsed / schedule.ramp_duration, 1.0)
    else:
        fraction = 0.0
    start, end = schedule.ramp_start_rate, schedule.ramp_end_rate
    return max(start + (end - start) * fraction, 1e-9)


def offsets(schedule: Schedule, total: int | None, rng: np.random.Generator) -> Iterator[float]:
    """Arrival times in seconds from the start; the first request goes at 0. Infinite when
    ``total`` is None (the caller stops on its duration)."""
    t = 0.0
    index = 0
    while total is None or index < total:
        yield t
        index += 1
        rate = ramp_rate(schedule, index, total, t) if schedule.ramped else schedule.rate
        t += gap(rate, schedule.burstiness, rng)


async def arrivals(
    schedule: Schedule,
    total: int | None,
    rng: np.random.Generator,
    deadline: float | None = None,
) -> AsyncIterator[tuple[int, float]]:
    """Yield ``(index, scheduled_offset)`` at the scheduled wall-clock times, until ``total``
    requests or the monotonic ``deadline``. Sleeping to absolute times (not by gaps) keeps
    small sleep overshoots from accumulating into a lower achieved rate."""
    start = time.perf_counter()
    for index, offset in enumerate(offsets(schedule, total, rng)):
        wait = start + offset - time.perf_counter()
        if deadline is not None and time.monotonic() + max(wait, 0.0) >= deadline:
            return
        if wait > 0:
            await asyncio.sleep(wait)
        elif index % 64 == 63:
            # A burst of zero gaps would otherwise never yield to the event loop.
            await asyncio.sleep(0)
        yield index, offset


def scheduled_rate_note(schedule: Schedule, scheduled: float, num_sent: int) -> str:
    """Why a run's scheduled rate (that of the gaps it drew) differs from the configured one,
    in one line; '' when it does not (within 1%). A ramp's arrivals average its rates; random
    gaps average ``1 / rate`` only in the long run: the rate of ``n - 1`` gamma gaps of shape
    ``b`` has a relative spread (one sd) of about ``1 / sqrt(b (n - 1))``."""
    if math.isinf(scheduled) or num_sent < 2:
        return ""
    if schedule.ramped:
        return (
            f"a ramp from {schedule.ramp_start_rate:g} to {schedule.ramp_end_rate:g} req/s: "
            f"its {num_sent} arrivals average the rates between"
        )
    if math.isinf(schedule.rate) or abs(scheduled / schedule.rate - 1) <= 0.01:
        return ""
    b = schedule.burstiness
    spread = 1 / math.sqrt(b * (num_sent - 1))
    kind = "Poisson" if b == 1 else f"gamma (burstiness {b:g})"
    return (
        f"{num_sent} {kind} arrivals: random gaps give a run this short a rate of its own, "
        f"within ±{spread:.0%} of {schedule.rate:g} two times in three; more prompts narrow it"
    )


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` -> [1.0, 2.0, 4.0, inf] (for ``--sweep-rates``)."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep-rates: positive numbers separated by commas, got {text!r}")
    return rates


def achieved_rate(send_times: list[float]) -> float:
    """Arrivals per second actually achieved, from the send timestamps (inf for one)."""
    if len(send_times) < 2:
        return math.inf
    span = max(send_times) - min(send_times)
    return (len(send_times) - 1) / span if span > 0 else math.inf
