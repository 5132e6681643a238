"""What a run leaves behind: the summary table, the ``--save-result`` JSON, the per-request CSV,
and ``--compare`` of two saved runs."""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.client import ClientConfig, RunOutput
from loadtest.metrics import METRICS, Metrics, percentile_name

SUMMARY_KEYS = (
    "date",
    "backend",
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
)
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
NAMES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _number(value: float) -> float | str:
    """JSON has no infinity; vLLM writes it as the string "inf"."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def result_dict(cfg: ClientConfig, run: RunOutput, m: Metrics, detail: bool = True) -> dict:
    """The ``--save-result`` document: exactly ``SUMMARY_KEYS``, the ``{mean,median,std,pNN}_
    {ttft,tpot,itl,e2el}_ms`` statistics, and (with ``detail``) the per-request lists."""
    schedule = run.schedule
    rate: Any = _number(schedule.rate)
    if schedule.ramped:
        rate = f"ramp:{schedule.ramp_start_rate:g}-{schedule.ramp_end_rate:g}"
    doc: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.chat else "openai",
        "model_id": cfg.model,
        "num_prompts": len(run.send_times),
        "request_rate": rate,
        "burstiness": _number(schedule.burstiness),
        "max_concurrency": cfg.max_concurrency,
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    doc.update(m.stats)
    if detail:
        doc["input_lens"] = [r.prompt_len for r in run.results]
        doc["output_lens"] = [r.output_len for r in run.results]
        doc["ttfts"] = [r.ttft for r in run.results]
        doc["itls"] = [r.itls for r in run.results]
        doc["generated_texts"] = [r.generated_text for r in run.results]
        doc["errors"] = [r.error_detail or r.error for r in run.results]
    return doc


def default_filename(cfg: ClientConfig, run: RunOutput) -> str:
    """``openai-4qps-concurrency8-Model-20250101-120000.json`` (vLLM's pattern)."""
    rate = run.schedule.describe().split(" ")[0].replace("->", "to")
    if not run.schedule.ramped:
        rate = "inf" if math.isinf(run.schedule.rate) else f"{run.schedule.rate:g}"
    conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
    model = cfg.model.split("/")[-1]
    backend = "openai-chat" if cfg.chat else "openai"
    return f"{backend}-{rate}qps{conc}-{model}-{datetime.now():%Y%m%d-%H%M%S}.json"


def save_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def save_csv(run: RunOutput, path: Path) -> Path:
    """One row per request: when it was sent, what it asked for, how it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "index",
                "turn",
                "start_s",
                "ok",
                "error",
                "input_len",
                "output_len",
                "ttft_ms",
                "tpot_ms",
                "e2el_ms",
                "num_chunks",
                "mean_itl_ms",
            ]
        )
        for r in run.results:
            tpot = r.tpot
            itl = sum(r.itls) / len(r.itls) * 1000 if r.itls else ""
            w.writerow(
                [
                    r.index,
                    r.turn,
                    f"{r.start:.6f}",
                    int(r.ok),
                    r.error,
                    r.prompt_len,
                    r.output_len,
                    f"{r.ttft * 1000:.3f}",
                    "" if tpot is None else f"{tpot * 1000:.3f}",
                    f"{r.e2el * 1000:.3f}",
                    len(r.chunk_times),
                    itl if itl == "" else f"{itl:.3f}",
                ]
            )
    return path


def summary_table(
    cfg: ClientConfig,
    run: RunOutput,
    m: Metrics,
    selected: tuple[str, ...] = ("ttft", "tpot", "itl"),
) -> str:
    """The human-readable summary (vLLM's layout)."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else format(value, fmt) if fmt else str(value)
        lines.append(f"{label:<45}{text:>15}")

    row("Successful requests:", m.completed, "d")
    row("Failed requests:", m.failed, "d")
    row("Request rate configured (RPS):", run.schedule.describe(), "")
    if not math.isinf(run.scheduled_rate):
        row("Scheduled arrival rate (RPS):", run.scheduled_rate)
    row("Achieved arrival rate (RPS):", run.achieved_rate)
    if cfg.max_concurrency:
        row("Maximum request concurrency:", cfg.max_concurrency, "d")
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens, "d")
    row("Total generated tokens:", m.total_output_tokens, "d")
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
        row("SLO attainment (incl. failed):", m.slo_attainment, ".3f")
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s)
    row("Peak concurrent requests:", m.max_concurrent_requests, "d")
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name in METRICS:
        if name not in selected:
            continue
        lines.append("{s:{c}^60}".format(s=f" {NAMES[name]} ", c="-"))
        row(f"Mean {name.upper()} (ms):", m.stats[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", m.stats[f"median_{name}_ms"])
        row(f"Std {name.upper()} (ms):", m.stats[f"std_{name}_ms"])
        for p in m.percentiles:
            key = percentile_name(p)
            row(f"P{key[1:]} {name.upper()} (ms):", m.stats[f"{key}_{name}_ms"])
    if m.errors:
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        for kind, n in sorted(m.errors.items(), key=lambda kv: -kv[1]):
            row(f"{kind}:", n, "d")
    lines.append("=" * 60)
    return "\n".join(lines)


# Which direction is better, for marking --compare output: lower for latencies and failures,
# higher for the rest, and no mark for what describes the load rather than the server.
LOWER_IS_BETTER = ("_ms", "failed")
NEUTRAL = {"num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
           "total_input_tokens", "total_output_tokens", "max_concurrent_requests"}  # fmt: skip


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """A table of every numeric summary value two saved runs share: A, B, B - A, change."""
    lines = [f"{'metric':<32}{name_a[-14:]:>14}{name_b[-14:]:>14}{'B-A':>12}{'change':>10}"]
    for key, va in a.items():
        vb = b.get(key)
        if key in DETAIL_KEYS or isinstance(va, bool) or isinstance(vb, bool):
            continue
        if not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
            if va != vb and key != "date" and key in b:
                lines.append(f"{key:<32}{str(va)[-14:]:>14}{str(vb)[-14:]:>14}")
            continue
        delta = vb - va
        change = f"{delta / va * 100:+.1f}%" if va else ""
        mark = ""
        if delta and key not in NEUTRAL:
            better = (delta < 0) == key.endswith(LOWER_IS_BETTER)
            mark = " better" if better else " worse"
        lines.append(f"{key:<32}{va:>14.4g}{vb:>14.4g}{delta:>+12.4g}{change:>10}{mark}")
    return "\n".join(lines)


def load_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))
