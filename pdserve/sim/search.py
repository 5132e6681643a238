"""``pdserve plan --simulate``: the closed-form plan's layouts checked, and its router thresholds
searched, with the discrete-event simulator.

The closed-form model (``pdserve.plan``) is the fast pre-filter: it ranks every layout the core
budget allows. The simulator then runs one trace - the load tester's requests for the plan's
workload and seed, at the target rate (or, without one, at the best layout's predicted max
rate) - on the ``top`` layouts of that ranking and on the pool sizes for the target rate; a
layout with a prefill pool runs with ``always`` and with ``conditional`` over a small grid of
``--local-prefill-tokens`` / ``--prefill-busy-tokens`` around the closed-form thresholds and the
router's defaults. Each is scored as the load tester scores a run (``loadtest.metrics``): the
SLO statistic of TTFT and TPOT, goodput (requests within both SLOs per second) and attainment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loadtest.arrivals import Schedule
from loadtest.datasets import DatasetConfig, load
from pdserve.plan import Deployment, Plan, disaggregation_thresholds
from pdserve.profile import WorkerProfile
from pdserve.sim.cluster import Layout, simulate
from pdserve.sim.results import metrics_of
from pdserve.sim.timing import timing_from_worker_profile
from pdserve.sim.trace import Trace, scale_samples, trace_from_samples

ROUTER_DEFAULTS = (256, 2048)  # --local-prefill-tokens, --prefill-busy-tokens


@dataclass(frozen=True)
class TraceSpec:
    """The load tester's dataset for the plan's workload: a preset (scaled), or fixed lengths."""

    preset: str | None
    isl: int | None = None
    osl: int | None = None
    input_scale: float = 1.0
    output_scale: float = 1.0
    num_requests: int = 400
    seed: int = 0

    def trace(self, rate: float) -> Trace:
        if self.preset:
            cfg = DatasetConfig(name=self.preset, num_prompts=self.num_requests, seed=self.seed)
        else:
            assert self.isl and self.osl
            cfg = DatasetConfig(
                name="random",
                num_prompts=self.num_requests,
                input_len=self.isl,
                output_len=self.osl,
                seed=self.seed,
            )
        samples = load(cfg)
        if (self.input_scale, self.output_scale) != (1.0, 1.0):
            samples = scale_samples(samples, self.input_scale, self.output_scale)
        return trace_from_samples(samples, Schedule(rate=rate), self.seed)


@dataclass(frozen=True)
class SimulatedLayout:
    deployment: Deployment
    layout: Layout
    ttft_s: float  # the SLO's statistic
    tpot_s: float
    goodput: float  # req/s within both SLOs
    attainment: float
    meets: bool

    @property
    def router(self) -> str:
        if not self.layout.is_disaggregated:
            return "-"
        if self.layout.disaggregation == "always":
            return "always"
        return f"conditional {self.layout.local_prefill_tokens}/{self.layout.prefill_busy_tokens}"


@dataclass(frozen=True)
class SimulationCheck:
    rate: float
    spec: TraceSpec
    results: list[SimulatedLayout]  # the best router settings of each deployment

    @property
    def best(self) -> SimulatedLayout | None:
        """Among those meeting the SLOs: the fewest cores, then the most goodput (at one
        trace and rate, goodputs of layouts that all keep up differ by their last requests)."""
        meeting = [r for r in self.results if r.meets]
        if not meeting:
            return None
        return max(meeting, key=lambda r: (-r.deployment.cores, r.goodput))


def layouts_for(deployment: Deployment, local: int, busy: int) -> list[Layout]:
    """The router settings tried for ``deployment`` (thresholds ``local``/``busy`` from the
    closed-form model, and the router's defaults)."""
    if not deployment.is_disaggregated:
        return [Layout(num_colocated=deployment.num_colocated)]
    pools = Layout(num_prefill=deployment.num_prefill, num_decode=deployment.num_decode)
    grid = {(0, busy), (local, busy), (local, 2 * busy), (2 * local, busy), ROUTER_DEFAULTS}
    out = [replace(pools, disaggregation="always")]
    out += [replace(pools, local_prefill_tokens=a, prefill_busy_tokens=b) for a, b in sorted(grid)]
    return out


def score(
    profile: WorkerProfile, plan: Plan, trace: Trace, deployment: Deployment, layout: Layout
) -> SimulatedLayout:
    timing = timing_from_worker_profile(profile, deployment.threads)
    slo = plan.slo
    q = slo.quantile
    result = simulate(trace, layout, timing)
    m = metrics_of(
        trace,
        result,
        {"ttft": slo.ttft_s * 1e3, "tpot": slo.tpot_s * 1e3},
        percentiles=(q * 100,) if q else (50.0,),
    )
    key = f"p{round(q * 100)}" if q else "mean"
    ttft = m.stats.get(f"{key}_ttft_ms")
    tpot = m.stats.get(f"{key}_tpot_ms")
    ttft_s = math.inf if ttft is None else ttft / 1e3
    tpot_s = 0.0 if tpot is None else tpot / 1e3
    meets = not m.failed and ttft_s <= slo.ttft_s and tpot_s <= slo.tpot_s
    return SimulatedLayout(
        deployment,
        layout,
        ttft_s,
        tpot_s,
        m.request_goodput or 0.0,
        m.slo_attainment or 0.0,
        meets,
    )


def splits(cores: int) -> list[Deployment]:
    """P:D splits of ``cores`` one-core workers with 1/8 .. 3/4 of them prefilling: the
    closed-form ranking's top may all sit at one end of the range."""
    counts = {round(cores * f / 8) for f in range(1, 7)}
    return [
        Deployment(num_prefill=p, num_decode=cores - p) for p in sorted(counts) if 0 < p < cores
    ]


def check_plan(
    profile: WorkerProfile, plan: Plan, spec: TraceSpec, top: int = 4
) -> SimulationCheck:
    """Simulate the plan's ``top`` layouts (by the closed-form max rate) and its pool sizes."""
    ranked = sorted(plan.candidates, key=lambda c: -c.max_rate)
    rate = plan.rate or next((c.max_rate for c in ranked if c.max_rate > 0), 0.0)
    if rate <= 0:  # no layout meets the SLOs in the model: try its best at a gentle rate
        rate = 0.1
    deployments = [c.deployment for c in ranked[:top]]
    deployments += [s.deployment for s in plan.sizing]
    deployments += splits(plan.cores)
    # in order, once each; with shared cores, one-thread workers only (as the plan says)
    deployments = [d for d in dict.fromkeys(deployments) if plan.is_eligible(d)]
    trace = spec.trace(rate)
    results = []
    for deployment in deployments:
        t = disaggregation_thresholds(profile, plan.slo, deployment.threads)
        local = t.local_prefill_tokens or 16
        busy = t.prefill_busy_tokens or 16
        tried = [
            score(profile, plan, trace, deployment, layout)
            for layout in layouts_for(deployment, local, busy)
        ]
        results.append(max(tried, key=lambda r: (r.meets, r.goodput, r.attainment)))
    return SimulationCheck(rate, spec, results)


def format_check(check: SimulationCheck, plan: Plan) -> list[str]:
    """The simulator's table and its pick, for ``pdserve plan``'s report."""
    stat = plan.slo.statistic
    spec = check.spec
    what = spec.preset or f"isl {spec.isl} / osl {spec.osl}"
    lines = [
        "",
        f"Simulated (pdserve.sim): {spec.num_requests} requests of {what} at {check.rate:.3g} "
        f"req/s (seed {spec.seed}), the best router settings per layout:",
        f"  {'layout':22s} {'router':22s} {'TTFT ' + stat:>10s} {'TPOT ' + stat:>10s} "
        f"{'goodput':>8s} {'attain':>7s}  SLOs",
    ]
    for r in check.results:
        ttft = "inf" if math.isinf(r.ttft_s) else f"{r.ttft_s * 1e3:.0f}"
        lines.append(
            f"  {r.deployment.name:22s} {r.router:22s} {ttft:>10s} {r.tpot_s * 1e3:>10.0f} "
            f"{r.goodput:>8.3f} {r.attainment:>7.2f}  {'met' if r.meets else 'missed'}"
        )
    best = check.best
    if best is None:
        closest = max(check.results, key=lambda r: (r.attainment, r.goodput))
        lines.append(
            "The simulator finds no layout meeting the SLOs at this rate; the closest is "
            f"{closest.deployment.name} ({closest.router}): {closest.attainment:.0%} of "
            "requests within both SLOs."
        )
    else:
        flags = ""
        if best.layout.is_disaggregated and best.layout.disaggregation == "conditional":
            flags = (
                f" (router: --local-prefill-tokens {best.layout.local_prefill_tokens} "
                f"--prefill-busy-tokens {best.layout.prefill_busy_tokens})"
            )
        elif best.layout.is_disaggregated:
            flags = " (router: --disaggregation always)"
        lines.append(
            f"Simulator's pick: {best.deployment.name}{flags}, goodput {best.goodput:.3f} req/s."
        )
    return lines


def check_dict(check: SimulationCheck) -> dict:
    """The check as JSON-ready data."""
    best = check.best
    return {
        "rate": check.rate,
        "num_requests": check.spec.num_requests,
        "seed": check.spec.seed,
        "layouts": [
            {
                "deployment": r.deployment.name,
                "router": r.router,
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "goodput": r.goodput,
                "attainment": r.attainment,
                "meets": r.meets,
            }
            for r in check.results
        ],
        "best": None
        if best is None
        else {"deployment": best.deployment.name, "router": best.router},
    }
