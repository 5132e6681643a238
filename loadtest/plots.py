"""PNG plots of a run (matplotlib, imported only here and only when plotting, with the Agg
backend so that no display is needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loadtest.client import RunOutput
from loadtest.metrics import concurrency_steps, output_timeline, samples_of


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: np.ndarray, title: str) -> None:
    if values_ms.size:
        xs = np.sort(values_ms)
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
        for p in (50, 90, 99):
            v = np.percentile(xs, p)
            ax.axvline(v, color="grey", linestyle=":", linewidth=0.8)
            ax.text(v, 0.02 + p / 400, f"p{p} {v:.1f}", fontsize=7, rotation=90, va="bottom")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples <= x")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)


def plot_run(run: RunOutput, stem: Path) -> list[Path]:
    """``<stem>_latency_cdf.png``, ``<stem>_timeline.png`` and ``<stem>_workload.png``."""
    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    samples = samples_of(run.results)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _cdf(axes[0], samples["ttft"] * 1000, "TTFT CDF")
    _cdf(axes[1], samples["itl"] * 1000, "ITL CDF (all chunk gaps)")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "_latency_cdf.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    tokens = output_timeline(run.results)
    if tokens.size:
        top.bar(np.arange(tokens.size) + 0.5, tokens, width=1.0, alpha=0.7)
    top.set_ylabel("output tokens/s (1 s buckets)")
    top.set_title("Throughput and concurrency over time")
    top.grid(alpha=0.3)
    times, level = concurrency_steps(run.results)
    if times.size:
        bottom.step(times, level, where="post")
    sends = np.asarray(run.send_times)
    if sends.size:
        bottom.plot(sends, np.zeros_like(sends), "|", color="tab:red", label="arrivals")
        bottom.legend(loc="upper right")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since start")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "_timeline.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 5))
    ins = np.array([r.prompt_len for r in run.results])
    outs = np.array([r.output_len for r in run.results])
    if ins.size:
        h = ax.hist2d(ins, outs, bins=min(30, max(ins.size // 2, 2)), cmap="viridis", cmin=1)
        fig.colorbar(h[3], ax=ax, label="requests")
    ax.set_xlabel("input tokens (ISL)")
    ax.set_ylabel("output tokens (OSL)")
    ax.set_title("Workload: ISL x OSL")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "_workload.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def plot_sweep(points: list[dict], path: Path, percentile: str = "p99") -> Path:
    """Latency vs offered rate for a sweep (``points``: saved-result dicts, one per rate):
    median and ``percentile`` TTFT/TPOT/E2EL, and achieved throughput on the right axis."""
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    rates = [float(p["request_rate"]) if p["request_rate"] != "inf" else np.nan for p in points]
    finite = [r for r in rates if not np.isnan(r)]
    top = max(finite) * 2 if finite else 1.0
    xs = [top if np.isnan(r) else r for r in rates]  # "inf" is drawn at twice the top rate
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        ax.plot(xs, [p[f"median_{name}_ms"] for p in points], "o-", label="median")
        ax.plot(
            xs, [p.get(f"{percentile}_{name}_ms", np.nan) for p in points], "s--", label=percentile
        )
        ax.set_title(f"{name.upper()} vs request rate")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(xs, [p["request_throughput"] for p in points], "x:", color="grey")
        twin.set_ylabel("achieved req/s", color="grey")
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
