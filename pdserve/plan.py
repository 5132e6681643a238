"""``pdserve plan``: predict each deployment's latency and best rate from a worker profile.

Pure functions (no I/O): a :class:`~pdserve.profile.WorkerProfile`, a :class:`Workload`
(request classes: input/output lengths with weights), an :class:`SLO` and a core budget in;
predicted TTFT/TPOT, the highest rate meeting the SLO and a recommendation out.

The model, per worker; a pool of ``n`` workers gets ``1/n`` of the Poisson arrivals (the router
spreads load). ``S(I)`` is the profile's prefill time of an ``I``-token prompt at the worker's
thread count, ``D(B, c)`` its decode step time for a batch of ``B`` sequences of ``c`` context
tokens, ``T(I)`` the KV transfer time (latency + bytes / bandwidth), ``r`` the worker's rate.

- **Prefill worker (disaggregated): an M/G/1 queue** on the prompts' prefill times ``S``:
  utilization ``rho = r E[S]``, mean wait (Pollaczek-Khinchine) ``E[W] = r E[S^2] / 2(1-rho)``.
  The wait's distribution: no wait with probability ``1 - rho``, else exponential with the
  mean that gives ``E[W]`` (``P(W > x) = rho exp(-rho x / E[W])``). ``TTFT = W + S(I)``.
- **Decode worker: Little's law as a fixed point.** A request holds a batch slot for its
  ``O - 1`` steps, so the mean batch is ``B = r E[O-1] tau(B)`` with ``tau(B)`` the time per
  step; solved for ``B`` by bisection. The batch is capped by ``max_num_seqs`` and by the KV
  pool (``pool tokens / mean context``): a rate that needs more is one the worker cannot keep.
  The context is the slot-time-weighted mean ``I + O/2``. Disaggregated ``tau = D(B, c)``
  and a request's ``TPOT = D + (T(I) + D/2) / (O-1)``: its KV pull and the wait for the
  step in progress are spread over its output tokens.
- **Colocated worker (chunked prefill): decode steps stretched by the prefills they share the
  core with.** A prompt is computed inside a step with the decode batch, in the same forward
  pass, so it adds ``S'(I) = S(I) - D(1, 0)`` (its prefill less a one-token step's fixed cost,
  paid once per step anyway). A fraction ``rho = r E[S']`` of the time goes to prefill and
  ``tau = D(B, c) / (1 - rho)`` on average. A request's TPOT is ``D + X / (O-1)`` where ``X``
  is the prefill work that lands in its decode lifetime ``L = (O-1) tau``: compound Poisson,
  ``N ~ Poisson(r L)`` prompts of work drawn from the workload (``N = 1`` exact, ``N >= 2``
  normal). Its TTFT is an M/G/1 wait on the prefill work ``S'`` (prompts waiting together
  share a step), plus, while a batch runs (chance ``a = 1 - exp(-B)``), half a step in
  progress and its own step's decode part ``1.5 D``, else a step's fixed cost; plus ``S'(I)``.

SLO statistic: a percentile of the per-request TTFT and of the per-request TPOT (``p90`` by
default: 90% of requests within each SLO), or their ``mean``. A rate meets the SLO when both
statistics are within it; the max rate is found by bisection on the rate. A pool of ``n``
workers meets it up to ``n`` times the rate one worker does, so the pool sizes for a target
rate are ``ceil(rate / per-worker rate)`` for the prefill and the decode pool separately (the
prefill pool decides TTFT, the decode pool TPOT), or for the colocated workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.profile import ThreadProfile, WorkerProfile
from pdserve.queueing import (
    MG1,
    compound_poisson_cdf,
    highest_rate,
    latency_statistic,
    quantile,
)

# -- the inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestClass:
    """Requests with ``input_tokens`` prompts asking for ``output_tokens``; ``weight`` of all."""

    input_tokens: int
    output_tokens: int
    weight: float


@dataclass(frozen=True)
class Workload:
    """A mix of request classes (weights sum to 1)."""

    name: str
    classes: tuple[RequestClass, ...]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(weights, input lengths, output lengths)`` as float arrays."""
        rows = np.array([(c.weight, c.input_tokens, c.output_tokens) for c in self.classes])
        return rows[:, 0] / rows[:, 0].sum(), rows[:, 1], rows[:, 2]

    @property
    def mean_input(self) -> float:
        w, i, _ = self.arrays()
        return float(w @ i)

    @property
    def mean_output(self) -> float:
        w, _, o = self.arrays()
        return float(w @ o)


def uniform_points(lo: int, hi: int, num_points: int) -> list[int]:
    """``num_points`` lengths at the quantile midpoints of the integers uniform in [lo, hi]."""
    return [round(lo + (hi - lo) * (j + 0.5) / num_points) for j in range(num_points)]


def preset_workload(
    name: str, input_scale: float = 1.0, output_scale: float = 1.0, num_points: int = 6
) -> Workload:
    """A loadtest preset (``loadtest.datasets.PRESETS``, or ``mixed``: an equal mix of them)
    with its lengths scaled as ``benchmarks/goodput.py`` scales them (``max(1, round(x s))``)."""
    from loadtest.datasets import MIXED, PRESETS

    kinds = list(MIXED) if name == "mixed" else [name]
    if any(k not in PRESETS for k in kinds):
        raise ValueError(f"unknown preset {name!r}; one of {sorted([*PRESETS, 'mixed'])}")
    classes = []
    for kind in kinds:
        (ilo, ihi), (olo, ohi) = PRESETS[kind]
        ins = uniform_points(*scaled(ilo, ihi, input_scale), num_points)
        outs = uniform_points(*scaled(olo, ohi, output_scale), num_points)
        weight = 1.0 / (len(kinds) * num_points**2)
        classes += [RequestClass(i, o, weight) for i in ins for o in outs]
    scales = f" (inputs x{input_scale:g}, outputs x{output_scale:g})"
    return Workload(
        name + (scales if (input_scale, output_scale) != (1, 1) else ""), tuple(classes)
    )


def scaled(lo: int, hi: int, scale: float) -> tuple[int, int]:
    return max(1, round(lo * scale)), max(1, round(hi * scale))


def fixed_workload(input_tokens: int, output_tokens: int) -> Workload:
    """Every request the same: ``input_tokens`` in, ``output_tokens`` out."""
    if input_tokens < 1 or output_tokens < 1:
        raise ValueError("--isl and --osl must be >= 1")
    name = f"isl {input_tokens} / osl {output_tokens}"
    return Workload(name, (RequestClass(input_tokens, output_tokens, 1.0),))


@dataclass(frozen=True)
class SLO:
    """Limits on per-request TTFT and TPOT, for a statistic: ``"mean"`` or ``"pNN"``."""

    ttft_s: float
    tpot_s: float
    statistic: str = "p90"

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLOs must be > 0")
        if self.statistic != "mean":
            q = self.statistic[1:]
            if not (self.statistic.startswith("p") and q.isdigit() and 0 < int(q) < 100):
                raise ValueError(f"statistic must be 'mean' or p1..p99, got {self.statistic!r}")

    @property
    def quantile(self) -> float | None:
        """0.9 for ``p90``; None for the mean."""
        return None if self.statistic == "mean" else int(self.statistic[1:]) / 100


@dataclass(frozen=True)
class Deployment:
    """Disaggregated ``num_prefill`` P + ``num_decode`` D, or ``num_colocated`` colocated
    workers; each worker runs ``threads`` torch threads on as many cores."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    threads: int = 1

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def cores(self) -> int:
        return (self.num_prefill + self.num_decode + self.num_colocated) * self.threads

    @property
    def name(self) -> str:
        if self.is_disaggregated:
            return f"{self.num_prefill}P:{self.num_decode}D"
        threads = f", {self.threads} threads" if self.threads > 1 else ""
        return f"{self.num_colocated}x colocated{threads}"


# -- one worker ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPrediction:
    """One worker at one rate: the SLO statistic of TTFT and TPOT (inf: cannot keep up)."""

    ttft_s: float
    tpot_s: float
    decode_batch: float = 0.0
    prefill_utilization: float = 0.0
    problem: str = ""  # why it cannot keep up ('' when it can)


def decode_context(workload: Workload) -> float:
    """Mean context of a batch slot: each request weighs by its ``O - 1`` steps, at ``I + O/2``."""
    w, i, o = workload.arrays()
    steps = w * np.maximum(o - 1, 0)
    return float(steps @ (i + o / 2) / steps.sum()) if steps.sum() > 0 else float(w @ i)


def decode_batch(
    profile: WorkerProfile, curve: ThreadProfile, workload: Workload, rate: float, stretch: float
) -> tuple[float, str]:
    """Little's law ``B = rate E[O-1] tau(B)``, ``tau = D(B, c) * stretch``, solved for ``B``.

    Returns ``(B, '')``, or ``(cap, why)`` when the batch the rate needs exceeds the cap.
    """
    w, _, o = workload.arrays()
    demand = rate * float(w @ np.maximum(o - 1, 0))
    context = decode_context(workload)
    cap = min(float(profile.max_num_seqs), profile.kv_pool_tokens / max(context, 1.0))

    def excess(b: float) -> float:
        return demand * curve.decode_step_time(b, context) * stretch - b

    if excess(cap) > 0:
        return cap, f"decode batch would exceed {cap:.0f} (max_num_seqs or the KV pool)"
    lo, hi = 0.0, cap
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return hi, ""


def predict_prefill_worker(
    curve: ThreadProfile, workload: Workload, rate: float, slo: SLO
) -> WorkerPrediction:
    """A disaggregated prefill worker: TTFT of an M/G/1 queue on prefill times."""
    w, i, _ = workload.arrays()
    service = np.array([curve.prefill_time(n) for n in i])
    queue = MG1(rate, service, w)
    if queue.utilization >= 1:
        problem = f"prefill utilization {queue.utilization:.2f} >= 1"
        return WorkerPrediction(math.inf, math.nan, 0.0, queue.utilization, problem)
    ttft = latency_statistic(service, w, queue, slo.quantile)
    return WorkerPrediction(ttft, math.nan, 0.0, queue.utilization)


def predict_decode_worker(
    profile: WorkerProfile, curve: ThreadProfile, workload: Workload, rate: float, slo: SLO
) -> WorkerPrediction:
    """A disaggregated decode worker: batch from Little's law, TPOT with the KV pull."""
    batch, problem = decode_batch(profile, curve, workload, rate, 1.0)
    if problem:
        return WorkerPrediction(math.nan, math.inf, batch, 0.0, problem)
    w, i, o = workload.arrays()
    step = curve.decode_step_time(batch, decode_context(workload))
    keep = o >= 2  # TPOT needs a second token
    if not keep.any():
        return WorkerPrediction(math.nan, 0.0, batch, 0.0)
    pull = np.array([profile.transfer_time(n) for n in i[keep]])
    tpots = step + (pull + step / 2) / (o[keep] - 1)
    weights = w[keep] / w[keep].sum()
    if slo.quantile is None:
        tpot = float(weights @ tpots)
    else:
        order = np.argsort(tpots)
        cumulative = np.cumsum(weights[order])
        tpot = float(tpots[order][np.searchsorted(cumulative, slo.quantile - 1e-12)])
    return WorkerPrediction(math.nan, tpot, batch, 0.0)


def marginal_prefill(curve: ThreadProfile, inputs: np.ndarray) -> tuple[np.ndarray, float]:
    """``(work, fixed)``: what each prompt adds to a step that runs anyway, and the fixed cost
    of a step (a one-token step, ``D(1, 0)``).

    A chunked-prefill step computes the decode batch and the prompt in one forward pass, so the
    weights are read and the per-step costs paid once: a prompt adds its prefill time less that
    fixed cost. (Measured here, 2 threads: 8 decodes + a 768-token prompt in one step took
    1.07 s, against 0.14 s + 1.05 s apart; 16 decodes + 256 tokens 0.42 s against 0.46 s.)
    """
    fixed = curve.decode_step_time(1, 0)
    full = np.array([curve.prefill_time(n) for n in inputs])
    return np.maximum(full - fixed, 0.0), fixed


def predict_colocated_worker(
    profile: WorkerProfile, curve: ThreadProfile, workload: Workload, rate: float, slo: SLO
) -> WorkerPrediction:
    """A colocated worker (chunked prefill): see the module doc."""
    w, i, o = workload.arrays()
    work, fixed = marginal_prefill(curve, i)
    rho = rate * float(w @ work)
    if rho >= 1:
        return WorkerPrediction(math.inf, math.inf, 0.0, rho, f"prefill utilization {rho:.2f}")
    batch, problem = decode_batch(profile, curve, workload, rate, 1 / (1 - rho))
    if problem:
        return WorkerPrediction(math.inf, math.inf, batch, rho, problem)
    step = curve.decode_step_time(max(batch, 1.0), decode_context(workload))
    busy = 1 - math.exp(-batch)  # the chance a decode batch is running (Poisson occupancy)
    # a prompt waits for the step in progress (half of one, on average) and its own step
    # computes the decode batch too; with no batch running, its step costs the fixed part
    own_step = busy * 1.5 * step + (1 - busy) * fixed
    ttft = latency_statistic(work + own_step, w, MG1(rate, work, w), slo.quantile)
    keep = o >= 2  # TPOT needs a second token
    if not keep.any():
        return WorkerPrediction(ttft, 0.0, batch, rho)
    tpot = colocated_tpot(slo, step, rho, rate, (o[keep] - 1, w[keep]), (work, w))
    return WorkerPrediction(ttft, tpot, batch, rho)


def colocated_tpot(
    slo: SLO,
    step: float,
    rho: float,
    rate: float,
    classes: tuple[np.ndarray, np.ndarray],
    prefill_work: tuple[np.ndarray, np.ndarray],
) -> float:
    """The TPOT statistic when prefills share the decode steps.

    A class with ``O - 1`` decode steps (``classes``: steps, weights) lives
    ``L = (O-1) step / (1 - rho)`` on average and meets ``Poisson(rate L)`` prefills whose work
    is drawn from ``prefill_work`` (sizes, weights): ``TPOT = step + X / (O-1)``.
    """
    if slo.quantile is None:
        return step / (1 - rho)
    steps, weights = classes
    weights = weights / weights.sum()
    mean_count = rate * steps * step / (1 - rho)

    def cdf(t: float) -> float:
        budget = (t - step) * steps
        return float(weights @ compound_poisson_cdf(budget, mean_count, *prefill_work))

    return quantile(cdf, slo.quantile, step / (1 - rho))


# -- deployments --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """A deployment at ``rate`` req/s (per-worker batch and utilization)."""

    deployment: Deployment
    rate: float
    ttft_s: float
    tpot_s: float
    decode_batch: float
    prefill_utilization: float
    problem: str = ""

    def miss(self, slo: SLO) -> str:
        """Why this prediction misses the SLO ('' when it meets it)."""
        if self.problem:
            return self.problem
        why = []
        if self.ttft_s > slo.ttft_s:
            why.append(f"TTFT {slo.statistic} {self.ttft_s * 1e3:.0f} ms > {slo.ttft_s * 1e3:.0f}")
        if self.tpot_s > slo.tpot_s:
            why.append(f"TPOT {slo.statistic} {self.tpot_s * 1e3:.0f} ms > {slo.tpot_s * 1e3:.0f}")
        return ", ".join(why)


def predict(
    profile: WorkerProfile, deployment: Deployment, workload: Workload, rate: float, slo: SLO
) -> Prediction:
    """Predicted TTFT and TPOT (the SLO's statistic) of ``deployment`` at ``rate`` req/s."""
    curve = profile.for_threads(deployment.threads)
    if not deployment.is_disaggregated:
        per_worker = rate / deployment.num_colocated
        c = predict_colocated_worker(profile, curve, workload, per_worker, slo)
        return Prediction(
            deployment, rate, c.ttft_s, c.tpot_s, c.decode_batch, c.prefill_utilization, c.problem
        )
    p = predict_prefill_worker(curve, workload, rate / deployment.num_prefill, slo)
    d = predict_decode_worker(profile, curve, workload, rate / deployment.num_decode, slo)
    problem = "; ".join(x for x in (p.problem, d.problem) if x)
    return Prediction(
        deployment, rate, p.ttft_s, d.tpot_s, d.decode_batch, p.prefill_utilization, problem
    )


@dataclass(frozen=True)
class Candidate:
    """A deployment's highest rate meeting the SLO, and what stops it there."""

    deployment: Deployment
    max_rate: float
    limit: str  # what misses the SLO just above max_rate (or unloaded, when it is 0)
    unloaded: Prediction
    at_rate: Prediction | None = None  # at the rate asked for


def evaluate(
    profile: WorkerProfile,
    deployment: Deployment,
    workload: Workload,
    slo: SLO,
    rate: float | None = None,
) -> Candidate:
    """``deployment``'s max rate under ``slo``, unloaded latency, and latency at ``rate``."""

    def at(r: float) -> Prediction:
        return predict(profile, deployment, workload, r, slo)

    best = highest_rate(lambda r: not at(r).miss(slo))
    unloaded = at(1e-9)
    limit = at(best * 1.01 if best > 0 else 1e-9).miss(slo)
    if best == 0:
        limit = f"unloaded: {limit} (the SLO is tighter than one request alone)"
    return Candidate(deployment, best, limit, unloaded, at(rate) if rate else None)


def deployments(profile: WorkerProfile, cores: int) -> list[Deployment]:
    """What ``cores`` cores can run: every xP:yD with x + y = cores (one core each), ``cores``
    one-core colocated workers, and one colocated worker on all cores when the profile has
    that thread count. (Leaving cores idle never raises the rate, so x + y < cores is left out.)"""
    out = [Deployment(num_prefill=x, num_decode=cores - x) for x in range(1, cores)]
    out.append(Deployment(num_colocated=cores))
    if cores > 1 and profile.has_threads(cores):
        out.append(Deployment(num_colocated=1, threads=cores))
    return out


@dataclass(frozen=True)
class Sizing:
    """The fewest workers of one kind that meet the SLO at a target rate."""

    deployment: Deployment
    per_worker_rates: dict[str, float]  # one worker's max rate: 'prefill'/'decode'/'colocated'

    @property
    def max_rate(self) -> float:
        """What the pools meet together (each pool: workers x one worker's rate)."""
        d, r = self.deployment, self.per_worker_rates
        if d.is_disaggregated:
            return min(d.num_prefill * r["prefill"], d.num_decode * r["decode"])
        return d.num_colocated * r["colocated"]


def worker_max_rates(profile: WorkerProfile, workload: Workload, slo: SLO) -> dict[str, float]:
    """One worker's highest rate meeting its part of ``slo``: a one-core prefill worker (TTFT),
    a one-core decode worker (TPOT), a colocated worker at each profiled thread count (both),
    keyed ``prefill``, ``decode``, ``colocated-<threads>``."""
    one = profile.for_threads(1)

    def prefill_ok(r: float) -> bool:
        return predict_prefill_worker(one, workload, r, slo).ttft_s <= slo.ttft_s

    def decode_ok(r: float) -> bool:
        return predict_decode_worker(profile, one, workload, r, slo).tpot_s <= slo.tpot_s

    def colocated_ok(curve: ThreadProfile) -> Callable[[float], bool]:
        def ok(r: float) -> bool:
            c = predict_colocated_worker(profile, curve, workload, r, slo)
            return c.ttft_s <= slo.ttft_s and c.tpot_s <= slo.tpot_s

        return ok

    rates = {"prefill": highest_rate(prefill_ok), "decode": highest_rate(decode_ok)}
    for curve in profile.threads:
        rates[f"colocated-{curve.num_threads}"] = highest_rate(colocated_ok(curve))
    return rates


def size_pools(profile: WorkerProfile, workload: Workload, slo: SLO, rate: float) -> list[Sizing]:
    """For ``rate``: the prefill and decode pool sizes (one-core workers, each pool sized on its
    own: the prefill pool decides TTFT, the decode pool TPOT), and the number of colocated
    workers at each profiled thread count; fewest cores first (then the most headroom). Kinds
    that cannot meet the SLO at any rate are left out."""
    rates = worker_max_rates(profile, workload, slo)
    out = []
    if rates["prefill"] > 0 and rates["decode"] > 0:
        pools = Deployment(
            num_prefill=math.ceil(rate / rates["prefill"]),
            num_decode=math.ceil(rate / rates["decode"]),
        )
        out.append(Sizing(pools, {k: rates[k] for k in ("prefill", "decode")}))
    for curve in profile.threads:
        key = f"colocated-{curve.num_threads}"
        if rates[key] > 0:
            workers = Deployment(
                num_colocated=math.ceil(rate / rates[key]), threads=curve.num_threads
            )
            out.append(Sizing(workers, {"colocated": rates[key]}))
    return sorted(out, key=lambda s: (s.deployment.cores, -s.max_rate))


@dataclass(frozen=True)
class Plan:
    """Every deployment of the core budget, the best one, and pool sizes for a target rate
    (only those within the budget), with warnings where the plan extrapolates the profile."""

    workload: Workload
    slo: SLO
    cores: int
    rate: float | None
    candidates: list[Candidate]
    sizing: list[Sizing] = field(default_factory=list)
    shared_cores: bool = False  # other processes run on the workers' cores
    warnings: list[str] = field(default_factory=list)
    thresholds: DisaggregationThresholds | None = None  # for layouts with a prefill pool
    # that meet the SLOs (None: there are none)

    def is_eligible(self, deployment: Deployment) -> bool:
        """With shared cores, only one-thread workers are recommended: a worker whose torch
        threads span several cores stalls all of them whenever another process takes one
        (see docs/planning.md); a one-thread worker loses only the time taken."""
        return not self.shared_cores or deployment.threads == 1

    @property
    def best(self) -> Candidate:
        """The highest max rate among the eligible; ties go to the lower unloaded TTFT."""
        eligible = [c for c in self.candidates if self.is_eligible(c.deployment)]
        return max(eligible, key=lambda c: (c.max_rate, -c.unloaded.ttft_s))


@dataclass(frozen=True)
class DisaggregationThresholds:
    """The router's per-request disaggregation settings for a disaggregated layout, from the
    profile and the SLOs (``--local-prefill-tokens``, ``--prefill-busy-tokens``)."""

    local_prefill_tokens: int  # a local prefill this long stalls the decode batch <= one TPOT
    prefill_busy_tokens: int  # a prefill queue this long waits half the TTFT SLO

    def router_flags(self) -> list[str]:
        return [
            "--local-prefill-tokens",
            str(self.local_prefill_tokens),
            "--prefill-busy-tokens",
            str(self.prefill_busy_tokens),
        ]


THRESHOLD_STEP, THRESHOLD_MAX = 16, 8192  # tokens: the grid the thresholds are read on


def disaggregation_thresholds(
    profile: WorkerProfile, slo: SLO, threads: int = 1
) -> DisaggregationThresholds:
    """The longest prompt a decode worker may compute itself: its prefill stalls every running
    stream, so it must fit in one TPOT SLO (and, its own first token, in the TTFT SLO); and the
    prefill-pool queue beyond which a shorter prompt is better computed locally: the queue a
    prefill worker clears in half the TTFT SLO. 0 where not even the grid's first step fits."""
    curve = profile.for_threads(threads)

    def longest_within(seconds: float) -> int:
        n = 0
        while (
            n + THRESHOLD_STEP <= THRESHOLD_MAX
            and curve.prefill_time(n + THRESHOLD_STEP) <= seconds
        ):
            n += THRESHOLD_STEP
        return n

    return DisaggregationThresholds(
        longest_within(min(slo.tpot_s, slo.ttft_s)), longest_within(slo.ttft_s / 2)
    )


def thresholds_for(
    profile: WorkerProfile, slo: SLO, candidates: list[Candidate]
) -> DisaggregationThresholds | None:
    """The router's thresholds, for layouts with a prefill pool; None when none of them meets
    the SLOs at any rate (settings for a layout the model rejects are no recommendation)."""
    meeting = [c for c in candidates if c.deployment.is_disaggregated and c.max_rate > 0]
    if not meeting:
        return None
    return disaggregation_thresholds(profile, slo, meeting[0].deployment.threads)


def make_plan(
    profile: WorkerProfile,
    workload: Workload,
    slo: SLO,
    cores: int,
    rate: float | None = None,
    shared_cores: bool = False,
) -> Plan:
    """Evaluate every deployment ``cores`` allow; with ``rate``, also size the pools for it."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    candidates = [evaluate(profile, d, workload, slo, rate) for d in deployments(profile, cores)]
    thresholds = thresholds_for(profile, slo, candidates)
    plan = Plan(workload, slo, cores, rate, candidates, [], shared_cores, thresholds=thresholds)
    plan.warnings.extend(beyond_the_profile(profile, workload, cores, candidates))
    if rate:
        sizes = size_pools(profile, workload, slo, rate)
        plan.sizing.extend(
            s for s in sizes if plan.is_eligible(s.deployment) and s.deployment.cores <= cores
        )
    return plan


def beyond_the_profile(
    profile: WorkerProfile, workload: Workload, cores: int, candidates: list[Candidate]
) -> list[str]:
    """Where the plan leaves what the profile measured (its numbers there are extrapolated)."""
    measured = sorted(t.num_threads for t in profile.threads)
    warnings = []
    if cores > max(measured):
        warnings.append(
            f"the profile has workers of {', '.join(map(str, measured))} thread(s) only: "
            f"layouts of {cores} cores are built from those (measure more with "
            "`pdserve plan --measure --profile-threads ...`)"
        )
    _, inputs, outputs = workload.arrays()
    longest = max(max(t.prefill_tokens) for t in profile.threads)
    if inputs.max() > longest:
        warnings.append(
            f"prompts of up to {int(inputs.max())} tokens, the profile's prefill goes to "
            f"{longest}: longer ones are extrapolated"
        )
    contexts = max(p.context for t in profile.threads for p in t.decode)
    if (inputs + outputs).max() > contexts:
        warnings.append(
            f"contexts of up to {int((inputs + outputs).max())} tokens, the profile's decode "
            f"steps go to {contexts}: longer ones are extrapolated"
        )
    batches = max(p.batch_size for t in profile.threads for p in t.decode)
    busiest = max(
        (c.at_rate.decode_batch for c in candidates if c.at_rate and not c.at_rate.problem),
        default=0.0,
    )
    if busiest > batches:
        warnings.append(
            f"decode batches of {busiest:.0f} at the target rate, the profile measured up to "
            f"{batches}: their step times are extrapolated"
        )
    return warnings
