"""Queueing arithmetic for ``pdserve plan``: quantiles, an M/G/1 queue, compound Poisson sums.

Pure functions of numbers and numpy arrays; :mod:`pdserve.plan` builds its model from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_RATE = 1e5  # req/s: the ceiling of highest_rate's search


def quantile(cdf: Callable[[float], float], q: float, scale: float) -> float:
    """The smallest ``t >= 0`` with ``cdf(t) >= q`` (bisection; ``scale`` is a first guess)."""
    hi = max(scale, 1e-6)
    while cdf(hi) < q:
        hi *= 2
        if hi > 1e6:
            return math.inf
    lo = 0.0
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cdf(mid) >= q else (mid, hi)
    return hi


@dataclass(frozen=True)
class MG1:
    """An M/G/1 queue: arrivals at ``rate``, service times ``service`` with ``weights``."""

    rate: float
    service: np.ndarray
    weights: np.ndarray

    @property
    def utilization(self) -> float:
        return float(self.rate * (self.weights @ self.service))

    @property
    def mean_wait(self) -> float:
        """Pollaczek-Khinchine: ``rate E[S^2] / 2(1 - rho)``."""
        rho = self.utilization
        if rho >= 1:
            return math.inf
        return float(self.rate * (self.weights @ self.service**2) / (2 * (1 - rho)))

    def wait_cdf(self, x: np.ndarray) -> np.ndarray:
        """``P(W <= x)``: no wait w.p. ``1 - rho``, else exponential with mean ``E[W]/rho``."""
        rho, mean = self.utilization, self.mean_wait
        if rho <= 0 or mean == 0:
            return (x >= 0).astype(float)
        tail = rho * np.exp(-np.maximum(x, 0) * rho / mean)
        return np.where(x >= 0, 1 - tail, 0.0)


def latency_statistic(fixed: np.ndarray, weights: np.ndarray, wait: MG1, q: float | None) -> float:
    """The ``q``-quantile (None: the mean) of ``wait + fixed[class]``, classes drawn with
    ``weights``."""
    if wait.utilization >= 1:
        return math.inf
    if q is None:
        return float(wait.mean_wait + weights @ fixed)

    def cdf(t: float) -> float:
        return float(weights @ wait.wait_cdf(t - fixed))

    return quantile(cdf, q, float(fixed.max()) + wait.mean_wait)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """The standard normal CDF (erf by Abramowitz & Stegun 7.1.26, error < 1.5e-7)."""
    z = np.abs(x) / math.sqrt(2)
    t = 1 / (1 + 0.3275911 * z)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = 1 - poly * np.exp(-z * z)
    return 0.5 * (1 + np.sign(x) * erf)


def compound_poisson_cdf(
    budget: np.ndarray, mean_count: np.ndarray, sizes: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """``P(X_i <= budget_i)``, ``X_i`` the sum of ``Poisson(mean_count_i)`` draws of ``sizes``.

    One draw exactly (the step function of ``sizes``), two or more with the normal
    approximation of their sum; counts beyond ``mean + 8 sd + 8`` are ignored.
    """
    mu = float(weights @ sizes)
    sd = math.sqrt(max(float(weights @ sizes**2) - mu**2, 0.0))
    max_count = int(np.max(mean_count + 8 * np.sqrt(mean_count))) + 8
    counts = np.arange(max_count + 1)[None, :]
    m = mean_count[:, None]
    log_pmf = counts * np.log(np.maximum(m, 1e-300)) - m - np.vectorize(math.lgamma)(counts + 1)
    pmf = np.where(m > 0, np.exp(log_pmf), (counts == 0).astype(float))
    b = budget[:, None]
    given = np.empty((len(budget), max_count + 1))
    given[:, 0] = budget >= 0
    given[:, 1] = (sizes[None, :] <= b).astype(float) @ weights
    n = counts[:, 2:]
    if sd > 0:
        given[:, 2:] = normal_cdf((b - n * mu) / (sd * np.sqrt(n)))
    else:
        given[:, 2:] = (b >= n * mu).astype(float)
    return np.asarray((pmf * given).sum(axis=1))


def highest_rate(meets: Callable[[float], bool]) -> float:
    """The highest rate at which ``meets`` holds (it must hold below it and fail above it)."""
    if not meets(1e-9):
        return 0.0
    lo, hi = 1e-9, 1.0
    while meets(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_RATE:
            return MAX_RATE
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
