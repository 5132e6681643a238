"""What a run leaves behind: the summary table, the ``--save-result`` JSON, the per-request CSV,
and ``--compare`` of two saved runs."""

from __future__ import annotations

import csv
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.arrivals import scheduled_rate_note
from loadtest.client import ClientConfig, RunOutput
from loadtest.metrics import METRICS, Metrics, meets, percentile_name

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
CONFIG_KEY = "config"  # ours, beside vLLM's keys
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


def run_config(cfg: ClientConfig, run: RunOutput, settings: dict[str, Any] | None = None) -> dict:
    """The run's ``config``: what was sent where (endpoint, sampling), how it ended, and the
    caller's ``settings`` (dataset, seed, SLOs, limits) so that a saved result describes itself."""
    return {
        "endpoint": cfg.url,
        "stream": cfg.stream,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "request_timeout": cfg.request_timeout,
        "num_warmups": cfg.num_warmups,
        "schedule": run.schedule.describe(),
        "scheduled_rate": None if math.isinf(run.scheduled_rate) else run.scheduled_rate,
        "scheduled_rate_note": scheduled_rate_note(
            run.schedule, run.scheduled_rate, len(run.send_times)
        )
        or None,
        **(settings or {}),
        "interrupted": bool(run.stopped),
        "stopped": run.stopped or None,
        "num_cancelled": run.num_cancelled,
    }


def result_dict(
    cfg: ClientConfig,
    run: RunOutput,
    m: Metrics,
    detail: bool = True,
    settings: dict[str, Any] | None = None,
) -> dict:
    """The ``--save-result`` document: exactly ``SUMMARY_KEYS``, the ``{mean,median,std,pNN}_
    {ttft,tpot,itl,e2el}_ms`` statistics (null when a metric has no samples), and (with
    ``detail``) the per-request lists, as ``vllm bench serve`` writes them; and beside them one
    key of ours, ``config`` (``run_config``)."""
    schedule = run.schedule
    rate: Any = _number(schedule.rate)
    if schedule.ramped:
        rate = f"ramp:{schedule.ramp_start_rate:g}-{schedule.ramp_end_rate:g}"
    doc: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend(cfg),
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
    doc[CONFIG_KEY] = run_config(cfg, run, settings)
    return doc


def backend(cfg: ClientConfig) -> str:
    """vLLM's backend name for the endpoint."""
    return "openai-chat" if cfg.chat else "openai"


def default_filename(cfg: ClientConfig, run: RunOutput) -> str:
    """``openai-4qps-concurrency8-Model-20250101-120000.json`` (vLLM's pattern)."""
    rate = run.schedule.describe().split(" ")[0].replace("->", "to")
    if not run.schedule.ramped:
        rate = "inf" if math.isinf(run.schedule.rate) else f"{run.schedule.rate:g}"
    conc = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency else ""
    model = cfg.model.split("/")[-1]
    return f"{backend(cfg)}-{rate}qps{conc}-{model}-{datetime.now():%Y%m%d-%H%M%S}.json"


def _finite(value: Any) -> Any:
    """NaN (a rate over a run of no duration) as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def save_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=2) + "\n", encoding="utf-8")
    return path


def save_csv(run: RunOutput, path: Path, slos: dict[str, float] | None = None) -> Path:
    """One row per request: when it was sent, what it asked for, how it went, and ``good``
    (1 when it completed within every ``--goodput`` limit; empty without SLOs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ["index", "turn", "start_s", "ok", "good", "error", "input_len", "output_len",
              "ttft_ms", "tpot_ms", "e2el_ms", "num_chunks", "mean_itl_ms"]  # fmt: skip
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in run.results:
            tpot = r.tpot
            itl = sum(r.itls) / len(r.itls) * 1000 if r.itls else None
            w.writerow(
                [
                    r.index,
                    r.turn,
                    f"{r.start:.6f}",
                    int(r.ok),
                    int(meets(r, slos)) if slos else "",
                    r.error,
                    r.prompt_len,
                    r.output_len,
                    f"{r.ttft * 1000:.3f}" if r.ok else "",
                    "" if tpot is None else f"{tpot * 1000:.3f}",
                    f"{r.e2el * 1000:.3f}",
                    len(r.chunk_times),
                    "" if itl is None else f"{itl:.3f}",
                ]
            )
    return path


def describe_slos(slos: dict[str, float]) -> str:
    """``{"ttft": 500, "tpot": 50}`` -> ``"ttft<=500 tpot<=50"`` (ms)."""
    return " ".join(f"{name}<={limit:g}" for name, limit in slos.items())


def summary_table(
    cfg: ClientConfig,
    run: RunOutput,
    m: Metrics,
    selected: tuple[str, ...] = ("ttft", "tpot", "itl"),
    slos: dict[str, float] | None = None,
) -> str:
    """The human-readable summary (vLLM's layout); a metric without samples reads ``n/a``."""
    title = " Serving Benchmark Result " if not run.stopped else " PARTIAL Result (stopped) "
    lines = ["{s:{c}^60}".format(s=title, c="=")]
    if run.stopped:
        lines.append(f"Stopped early: {run.stopped}")

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        missing = value is None or isinstance(value, float) and math.isnan(value)
        text = "n/a" if missing else format(value, fmt) if fmt else str(value)
        lines.append(f"{label:<45}{text:>15}")

    row("Successful requests:", m.completed, "d")
    row("Failed requests:", m.failed, "d")
    if run.stopped:
        row("Cancelled in flight (not counted):", run.num_cancelled, "d")
    row("Request rate configured (RPS):", run.schedule.describe(), "")
    if not math.isinf(run.scheduled_rate):
        row("Scheduled arrival rate (RPS):", run.scheduled_rate)
        if note := scheduled_rate_note(run.schedule, run.scheduled_rate, len(run.send_times)):
            lines.append(f"  ({note})")
    row("Achieved arrival rate (RPS):", run.achieved_rate)
    if cfg.max_concurrency:
        row("Maximum request concurrency:", cfg.max_concurrency, "d")
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens, "d")
    row("Total generated tokens:", m.total_output_tokens, "d")
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Goodput SLOs (ms):", describe_slos(slos or {}) or "?", "")
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
            if p == 50:  # the median, already shown
                continue
            key = percentile_name(p)
            row(f"P{key[1:]} {name.upper()} (ms):", m.stats[f"{key}_{name}_ms"])
    if m.errors:
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        for kind, n in sorted(m.errors.items(), key=lambda kv: -kv[1]):
            row(f"{kind}:", n, "d")
    lines.append("=" * 60)
    return "\n".join(lines)


# Settings of a run (vLLM's keys that describe the load, not the server): differing ones are
# warned about and never marked better or worse.
SETTINGS = ("backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency")
# What --compare marks: latencies (lower is better) and rates of work (higher is better).
# Counts (completed, failed, tokens) follow from the settings and get no mark.
HIGHER_IS_BETTER = {"request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "max_output_tokens_per_s"}  # fmt: skip
SKIP = {"date", CONFIG_KEY, *DETAIL_KEYS}


def _text(value: Any) -> str:
    """A value in full (never cut): floats to 4 significant digits below 1, 2 decimals above."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.4g}"


def _flat(doc: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing_settings(a: dict, b: dict) -> list[str]:
    """``key: A vs B`` for each setting (vLLM's, and those in ``config``) that differs."""
    keys = [*SETTINGS, *(f"{CONFIG_KEY}.{k}" for k in _flat(a.get(CONFIG_KEY) or {}))]
    keys += [
        f"{CONFIG_KEY}.{k}"
        for k in _flat(b.get(CONFIG_KEY) or {})
        if f"{CONFIG_KEY}.{k}" not in keys
    ]
    flat_a, flat_b = _flat(a), _flat(b)
    return [
        f"{key}: {_text(flat_a.get(key))} vs {_text(flat_b.get(key))}"
        for key in keys
        if flat_a.get(key) != flat_b.get(key)
    ]


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Two saved runs side by side: every summary value of both, B - A, the change, and for
    latencies and throughputs whether B is better or worse; a warning first when the runs'
    settings differ (then not every difference is the server's)."""
    rows: list[list[str]] = []
    for key in [*a, *(k for k in b if k not in a)]:
        va, vb = a.get(key), b.get(key)
        if key in SKIP or key in SETTINGS and va == vb:
            continue
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        if not numeric:
            if va != vb or va is None:
                rows.append([key, _text(va), _text(vb), "", "", ""])
            continue
        assert isinstance(va, (int, float)) and isinstance(vb, (int, float))
        delta = vb - va
        change = f"{delta / va * 100:+.1f}%" if va else ""
        mark = ""
        lower, higher = key.endswith("_ms"), key in HIGHER_IS_BETTER
        if delta and (lower or higher) and key not in SETTINGS:
            mark = "better" if (delta < 0) == lower else "worse"
        rows.append([key, _text(va), _text(vb), f"{'+' if delta >= 0 else ''}{_text(delta)}",
                     change, mark])  # fmt: skip
    header = ["metric", name_a, name_b, "B-A", "change", ""]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    if warnings := differing_settings(a, b):
        lines.append("warning: the runs differ in these settings, so not every difference below")
        lines.append("is the server's:")
        lines += [f"  {w}" for w in warnings]
        lines.append("")
    for r in [header, *rows]:
        cells = [r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:5], widths[1:5])), r[5]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def load_json(path: str | Path) -> dict:
    """A saved result; ``ValueError`` naming the file when it is missing or not one."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no such file (give the .json a --save-result run wrote)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a saved result ({exc})") from None
    if not isinstance(doc, dict) or "completed" not in doc:
        raise ValueError(f"{path}: not a saved result of pdserve-loadtest or vllm bench serve")
    return doc
