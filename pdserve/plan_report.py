"""``pdserve plan``'s report: the candidates as a table, the recommendation in words, JSON.

Pure functions over a :class:`~pdserve.plan.Plan` (no I/O; the command prints what they return).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from pdserve.plan import Deployment, Plan, Prediction


def ms(seconds: float) -> str:
    return (
        "-" if math.isnan(seconds) else ("inf" if math.isinf(seconds) else f"{seconds * 1e3:.0f}")
    )


def recommendation(plan: Plan) -> list[str]:
    """The plan in words: the best deployment for the cores, and for the target rate."""
    best, stat = plan.best, plan.slo.statistic
    others = ", ".join(
        f"{c.deployment.name} {c.max_rate:.2f}" for c in plan.candidates if c is not best
    )
    if best.max_rate == 0:
        lines = [f"No deployment of {plan.cores} core(s) meets the {stat} SLOs: {best.limit}."]
    else:
        lines = [
            f"On {plan.cores} core(s), run {best.deployment.name}: predicted to meet the {stat} "
            f"SLOs up to {best.max_rate:.2f} req/s (beyond: {best.limit})"
            + (f"; others: {others} req/s." if others else ".")
        ]
    for c in plan.candidates:
        if not plan.is_eligible(c.deployment) and c.max_rate > best.max_rate:
            lines.append(
                f"({c.deployment.name} is predicted higher, {c.max_rate:.2f} req/s, but its "
                "threads span every core: not recommended where other processes share them.)"
            )
    if plan.thresholds is not None:
        lines.append(
            "For layouts with a prefill pool, the router's per-request disaggregation: "
            f"{plan.thresholds.router_flags()} (a local prefill within one TPOT SLO; a prefill "
            "queue of half the TTFT SLO)."
        )
    if plan.rate is None:
        return lines
    if best.max_rate >= plan.rate:
        lines.append(
            f"It meets {plan.rate:g} req/s with {best.max_rate / plan.rate:.2f}x headroom."
        )
    else:
        lines.append(
            f"No deployment of {plan.cores} core(s) meets {plan.rate:g} req/s: give more cores "
            "(--cores), a lower rate, or looser SLOs."
        )
    for s in plan.sizing[:1]:  # within the budget only
        rates = ", ".join(f"one {k} worker {v:.2f} req/s" for k, v in s.per_worker_rates.items())
        lines.append(
            f"Cheapest for {plan.rate:g} req/s: {s.deployment.name} "
            f"({s.deployment.cores} cores; {rates})."
        )
    return lines


def format_plan(plan: Plan) -> str:
    """The candidates as a table, then the recommendation."""
    w = plan.workload
    slo = plan.slo
    lines = [
        f"workload: {w.name}: mean input {w.mean_input:.0f}, mean output {w.mean_output:.0f} "
        f"tokens ({len(w.classes)} classes)",
        f"SLOs ({slo.statistic} per request): TTFT <= {slo.ttft_s * 1e3:.0f} ms, "
        f"TPOT <= {slo.tpot_s * 1e3:.1f} ms; {plan.cores} core(s)",
        "",
    ]
    at = f"at {plan.rate:g} req/s" if plan.rate else ""
    head = f"{'deployment':<24}{'unloaded TTFT':>14}{'TPOT':>6}"
    if at:
        head += f"{at + ' TTFT':>22}{'TPOT':>6}{'batch':>6}"
    lines.append(head + f"{'max rate':>10}  limited by")
    for c in plan.candidates:
        row = f"{c.deployment.name:<24}{ms(c.unloaded.ttft_s):>14}{ms(c.unloaded.tpot_s):>6}"
        if c.at_rate is not None:
            a = c.at_rate
            batch = "-" if a.problem else f"{a.decode_batch:.1f}"
            row += f"{ms(a.ttft_s):>22}{ms(a.tpot_s):>6}{batch:>6}"
        note = "" if plan.is_eligible(c.deployment) else " (not recommended: shared cores)"
        lines.append(row + f"{c.max_rate:>10.2f}  {c.limit}{note}")
    lines.append(
        "(ms, the SLO statistic; batch: mean decode batch per decode worker; max rate in req/s)"
    )
    warnings = [f"warning: {w}" for w in plan.warnings]
    return "\n".join([*warnings, *([""] if warnings else []), *lines, "", *recommendation(plan)])


def prediction_dict(p: Prediction) -> dict[str, object]:
    return {
        "rate": p.rate,
        "ttft_s": p.ttft_s,
        "tpot_s": p.tpot_s,
        "decode_batch": p.decode_batch,
        "prefill_utilization": p.prefill_utilization,
        "problem": p.problem,
    }


def plan_dict(plan: Plan) -> dict[str, object]:
    """The plan as plain data (``--json``); infinities are written as None."""

    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    def deployment(d: Deployment) -> dict[str, object]:
        return {"name": d.name, "cores": d.cores, **asdict(d)}

    return clean(
        {
            "workload": {
                "name": plan.workload.name,
                "mean_input_tokens": plan.workload.mean_input,
                "mean_output_tokens": plan.workload.mean_output,
            },
            "slo": asdict(plan.slo),
            "cores": plan.cores,
            "shared_cores": plan.shared_cores,
            "rate": plan.rate,
            "candidates": [
                {
                    "deployment": deployment(c.deployment),
                    "max_rate": c.max_rate,
                    "limit": c.limit,
                    "unloaded": prediction_dict(c.unloaded),
                    "at_rate": prediction_dict(c.at_rate) if c.at_rate else None,
                    "eligible": plan.is_eligible(c.deployment),
                }
                for c in plan.candidates
            ],
            "best": plan.best.deployment.name if plan.best.max_rate > 0 else None,
            "recommendation": " ".join(recommendation(plan)),
            "warnings": plan.warnings,
            "disaggregation_thresholds": asdict(plan.thresholds) if plan.thresholds else None,
            "sizing": [
                {"deployment": deployment(s.deployment), "per_worker_rates": s.per_worker_rates}
                for s in plan.sizing
            ],
        }
    )  # type: ignore[return-value]
