"""``pdserve plan``'s report: the candidates as a table, the recommendation in words, JSON.

Pure functions over a :class:`~pdserve.plan.Plan` (no I/O; the command prints what they return).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pdserve.plan import Candidate, Deployment, Plan, Prediction
from pdserve.plan_commands import compose_command, k8s_commands, router_flags, up_command


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
        lines = [
            f"No deployment of {plan.cores} core(s) meets the {stat} SLOs. The closest is "
            f"{best.deployment.name}, which misses them: {best.limit}."
        ]
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
    lines += thresholds_in_words(plan)
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


def thresholds_in_words(plan: Plan) -> list[str]:
    """The router's per-request disaggregation settings, or why there are none."""
    disaggregated = [c for c in plan.candidates if c.deployment.is_disaggregated]
    if not disaggregated:
        return []
    t = plan.thresholds
    if t is None:
        misses = "; ".join(f"{c.deployment.name}: {c.limit}" for c in disaggregated)
        return [
            "No layout with a prefill pool meets the SLOs, so no per-request disaggregation "
            f"settings ({misses})."
        ]
    local = (
        "a local prefill within one TPOT SLO"
        if t.local_prefill_tokens
        else "no prompt prefills within one TPOT SLO, so none is computed on a decode worker "
        "for being short"
    )
    return [
        "For layouts with a prefill pool, the router's per-request disaggregation: "
        f"{' '.join(t.router_flags())} ({local}; a prefill queue of half the TTFT SLO)."
    ]


@dataclass(frozen=True)
class Commands:
    """What runs the recommendation: ``pdserve up`` for the best layout; Compose and Kubernetes
    run prefill and decode pools only (no colocated service), so for a colocated best they run
    the best layout with a prefill pool that meets the SLOs (``pools``; none: no such layout)."""

    layout: Candidate
    up: str
    pools: Candidate | None
    compose: str | None
    kubernetes: list[str]


def plan_commands(plan: Plan) -> Commands:
    """The :class:`Commands` of ``plan``'s recommendation."""
    best = plan.best
    up = up_command(best.deployment, router_flags(best.deployment, plan.slo, plan.thresholds))
    if best.deployment.is_disaggregated:
        pools: Candidate | None = best
    else:
        meeting = [c for c in plan.candidates if c.deployment.is_disaggregated and c.max_rate > 0]
        pools = max(meeting, key=lambda c: c.max_rate) if meeting else None
    if pools is None:
        return Commands(best, up, None, None, [])
    flags = router_flags(pools.deployment, plan.slo, plan.thresholds)
    return Commands(
        best,
        up,
        pools,
        compose_command(pools.deployment, flags),
        k8s_commands(pools.deployment, flags),
    )


def commands_in_words(plan: Plan) -> list[str]:
    """The commands, each under a line that says what it runs (the commands come last)."""
    run = plan_commands(plan)
    best = run.layout
    head = f"To run {best.deployment.name}"
    if best.max_rate == 0:
        head = f"To run the closest, {best.deployment.name} (it misses the SLOs: {best.limit})"
    if run.pools is None:
        return [
            f"{head} (docker-compose.yml and k8s/ run prefill and decode pools only, and no "
            "layout with them meets the SLOs):",
            f"  {run.up}",
        ]
    lines = [f"{head}:", f"  {run.up}"]
    if run.pools is best:
        lines.append("With docker-compose.yml, or k8s/ (namespace pdserve):")
    else:
        lines.append(
            "docker-compose.yml and k8s/ run prefill and decode pools only; their best layout "
            f"is {run.pools.deployment.name} (up to {run.pools.max_rate:.2f} req/s):"
        )
    return lines + [f"  {line}" for line in [run.compose or "", *run.kubernetes]]


@dataclass(frozen=True)
class Column:
    """A column of the candidates' table: its title, width (> 0: right-aligned in it; < 0:
    left-aligned in -width; 0: the last, after two spaces) and what the legend says of it."""

    title: str
    width: int
    legend: str


def columns(plan: Plan) -> list[Column]:
    """The table's columns; those at the target rate only with --rate."""
    stat = plan.slo.statistic
    cols = [
        Column("deployment", -26, "prefill:decode workers, or colocated workers"),
        Column("unloaded TTFT", 15, f"one request alone, {stat}, ms"),
        Column("TPOT", 6, f"one request alone, {stat}, ms"),
    ]
    if plan.rate:
        at = f"at {plan.rate:g} req/s"
        cols += [
            Column(f"{at} TTFT", len(at) + 7, f"{stat}, ms"),
            Column("TPOT", 6, f"{stat}, ms"),
            Column("batch", 7, "mean decode batch per decode worker"),
        ]
    return cols + [
        Column("max rate", 10, "req/s meeting both SLOs"),
        Column("limited by", 0, "what misses the SLOs just above the max rate"),
    ]


def cell(text: str, column: Column) -> str:
    if column.width < 0:
        return f"{text:<{-column.width}}"
    return f"  {text}" if column.width == 0 else f"{text:>{column.width}}"


def legend(cols: list[Column]) -> str:
    """Every printed column, in order, with what it holds (neighbours alike said together)."""
    groups: dict[str, list[str]] = {}
    for c in cols:
        groups.setdefault(c.legend, []).append(c.title)
    return "(" + "; ".join(f"{', '.join(titles)}: {text}" for text, titles in groups.items()) + ")"


def format_plan(plan: Plan) -> str:
    """The candidates as a table, then the recommendation, then the commands that run it."""
    w = plan.workload
    slo = plan.slo
    lines = [
        f"workload: {w.name}: mean input {w.mean_input:.0f}, mean output {w.mean_output:.0f} "
        f"tokens ({len(w.classes)} classes)",
        f"SLOs ({slo.statistic} per request): TTFT <= {slo.ttft_s * 1e3:.0f} ms, "
        f"TPOT <= {slo.tpot_s * 1e3:.1f} ms; {plan.cores} core(s)",
        "",
    ]
    cols = columns(plan)
    lines.append("".join(cell(c.title, c) for c in cols))
    for c in plan.candidates:
        values = [c.deployment.name, ms(c.unloaded.ttft_s), ms(c.unloaded.tpot_s)]
        if plan.rate:
            a = c.at_rate
            assert a is not None
            values += [ms(a.ttft_s), ms(a.tpot_s), "-" if a.problem else f"{a.decode_batch:.1f}"]
        note = "" if plan.is_eligible(c.deployment) else " (not recommended: shared cores)"
        values += [f"{c.max_rate:.2f}", c.limit + note]
        lines.append("".join(cell(v, col) for v, col in zip(values, cols)))
    lines.append(legend(cols))
    warnings = [f"warning: {w}" for w in plan.warnings]
    return "\n".join(
        [
            *warnings,
            *([""] if warnings else []),
            *lines,
            "",
            *recommendation(plan),
            "",
            *commands_in_words(plan),
        ]
    )


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
            "commands": commands_dict(plan),
            "disaggregation_thresholds": asdict(plan.thresholds) if plan.thresholds else None,
            "sizing": [
                {"deployment": deployment(s.deployment), "per_worker_rates": s.per_worker_rates}
                for s in plan.sizing
            ],
        }
    )  # type: ignore[return-value]


def commands_dict(plan: Plan) -> dict[str, object]:
    run = plan_commands(plan)
    return {
        "layout": run.layout.deployment.name,
        "meets_slo": run.layout.max_rate > 0,
        "up": run.up,
        "pools_layout": run.pools.deployment.name if run.pools else None,
        "compose": run.compose,
        "kubernetes": run.kubernetes,
    }
