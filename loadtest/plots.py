"""PNG plots of a run and of a sweep (matplotlib, imported only here and only when plotting, with
the Agg backend so that no display is needed).

Each ``*_figure`` function builds and returns a figure (tests read its texts); ``plot_run`` and
``plot_sweep`` save them. Every figure carries a subtitle naming the run (``RunLabel``), so a
PNG handed on says what it shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.client import RunOutput
from loadtest.metrics import concurrency_steps, output_timeline, samples_of

PERCENTILES = (50, 90, 99)
COLORS = {50: "tab:green", 90: "tab:orange", 99: "tab:red"}
SLO_OF_PANEL = {"ttft": "ttft", "tpot": "tpot", "itl": "itl_p99", "e2el": "e2el"}
PANELS = {
    "ttft": "TTFT",
    "tpot": "TPOT (per request)",
    "itl": "ITL (all gaps between chunks)",
    "e2el": "E2E latency",
}


@dataclass
class RunLabel:
    """What the figures say about the run they show."""

    model: str
    endpoint: str
    dataset: str
    rate: str
    date: str = field(default_factory=lambda: datetime.now().strftime("%Y-%m-%d %H:%M"))
    stopped: str = ""
    slos: dict[str, float] = field(default_factory=dict)
    ranges: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    chat: bool = False

    def subtitle(self) -> str:
        text = f"{self.model} | {self.endpoint} | {self.dataset} | {self.rate} | {self.date}"
        return text + ("  |  INTERRUPTED: partial run" if self.stopped else "")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axis_end(values: np.ndarray, slo: float | None) -> float:
    """The x-axis end: the largest value or past the SLO line, unless a few outliers lie far
    beyond the p99 (then 1.5 x p99, or past the SLO line); the points cut off are named in the
    legend. The p99 is a
    sample's own value (not interpolated towards the outlier, as in a run of few samples)."""
    p99, top = float(np.percentile(values, 99, method="lower")), float(values.max())
    past_slo = (slo or 0.0) * 1.15  # the SLO line is always on the axis
    end = max(p99 * 1.5, past_slo)
    return max(top * 1.02, past_slo) if top <= end else end


def _cdf(ax: Any, values_ms: np.ndarray, title: str, slo: float | None, slo_name: str) -> None:
    """One CDF with its percentiles and SLO as labelled lines (the legend keeps the labels from
    overlapping), and an x-axis that one outlier cannot stretch."""
    if values_ms.size:
        xs = np.sort(values_ms)
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", color="tab:blue")
        for p in PERCENTILES:
            v = float(np.percentile(xs, p))
            ax.axvline(v, color=COLORS[p], linestyle=":", linewidth=1.2, label=f"p{p} {v:.1f} ms")
        end = _axis_end(xs, slo)
        ax.set_xlim(0, end)
        beyond = int((xs > end).sum())
        if beyond:
            ax.plot([], [], " ", label=f"{beyond} beyond the axis (max {xs[-1]:.0f} ms)")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
    if slo is not None:
        ax.axvline(
            slo, color="black", linestyle="--", linewidth=1.2, label=f"SLO {slo_name} {slo:g} ms"
        )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{title} CDF (n={values_ms.size})")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction <= x")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)


def latency_figure(run: RunOutput, label: RunLabel) -> Any:
    """TTFT, TPOT, ITL and E2EL CDFs, with p50/p90/p99 and the ``--goodput`` limits."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    samples = samples_of(run.results)
    for ax, (name, title) in zip(axes.flat, PANELS.items()):
        slo_name = SLO_OF_PANEL[name]
        _cdf(ax, samples[name] * 1000, title, label.slos.get(slo_name), slo_name)
    fig.suptitle(f"Latency CDFs\n{label.subtitle()}", fontsize=10)
    fig.tight_layout()
    return fig


def timeline_figure(run: RunOutput, label: RunLabel) -> Any:
    """Output tokens/s in 1 s buckets over requests in flight, arrivals and failures."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    tokens = output_timeline(run.results)
    if tokens.size:
        top.bar(np.arange(tokens.size) + 0.5, tokens, width=1.0, alpha=0.7, label="output tok/s")
        top.legend(loc="upper right", fontsize=8)
    top.set_ylabel("output tokens/s")
    top.set_title("Throughput (1 s buckets) and requests in flight")
    top.grid(alpha=0.3)
    times, level = concurrency_steps(run.results)
    if times.size:
        bottom.step(times, level, where="post", label="in flight")
    sends = np.asarray(run.send_times)
    if sends.size:
        bottom.plot(sends, np.zeros_like(sends), "|", color="tab:green", label="arrivals")
    failed = [r.end for r in run.results if not r.ok]
    if failed:
        bottom.plot(failed, np.zeros(len(failed)), "x", color="tab:red", label="failed (end)")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since the first request")
    bottom.grid(alpha=0.3)
    fig.suptitle(label.subtitle(), fontsize=10)
    fig.tight_layout()
    return fig


def workload_figure(run: RunOutput, label: RunLabel) -> Any:
    """The 2-D histogram of ISL x OSL (integer counts), the dataset's ranges outlined, and a
    note when prompts came out longer than the range (the server's count includes more)."""
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 6))
    ins = np.array([r.prompt_len for r in run.results if r.ok])
    outs = np.array([r.output_len for r in run.results if r.ok])
    if ins.size:
        h = ax.hist2d(ins, outs, bins=min(30, max(ins.size // 2, 2)), cmap="viridis", cmin=1)
        fig.colorbar(h[3], ax=ax, label="requests", ticks=MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, "no completed requests", ha="center", transform=ax.transAxes)
    for (name, ((ilo, ihi), (olo, ohi))), color in zip(
        label.ranges.items(), ("tab:red", "tab:orange", "tab:pink")
    ):
        box = Rectangle((ilo, olo), ihi - ilo, ohi - olo, fill=False, edgecolor=color,
                        linestyle="--", linewidth=1.5, label=f"{name} range")  # fmt: skip
        ax.add_patch(box)
    if label.ranges and ins.size:
        ax.autoscale_view()
        most = max(ihi for (_, ihi), _ in label.ranges.values())
        above = int((ins > most).sum())
        if above:
            why = "the chat template's tokens" if label.chat else "the server's own tokenizer"
            ax.plot([], [], " ", label=f"{above} above the ISL range: {why}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("input tokens (ISL, as the server counted them)")
    ax.set_ylabel("output tokens (OSL)")
    ax.set_title(f"Workload: ISL x OSL of {ins.size} completed requests")
    fig.suptitle(label.subtitle(), fontsize=9)
    fig.tight_layout()
    return fig


def sweep_figure(points: list[dict], label: RunLabel, percentile: str = "p99") -> Any:
    """Median and ``percentile`` TTFT/TPOT/E2EL against the offered rate, the SLOs as lines,
    and the achieved request throughput (right axis, in the legend too)."""
    plt = _pyplot()
    rates = [float(p["request_rate"]) if p["request_rate"] != "inf" else np.nan for p in points]
    finite = [r for r in rates if not np.isnan(r)]
    top = max(finite) * 2 if finite else 1.0
    xs = [top if np.isnan(r) else r for r in rates]  # "inf" is drawn at twice the top rate

    def values(key: str) -> list[float]:
        return [np.nan if p.get(key) is None else p[key] for p in points]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        ax.plot(xs, values(f"median_{name}_ms"), "o-", label="median")
        ax.plot(xs, values(f"{percentile}_{name}_ms"), "s--", label=percentile)
        if name in label.slos:
            ax.axhline(label.slos[name], color="black", linestyle="--", linewidth=1.0,
                       label=f"SLO {name} {label.slos[name]:g} ms")  # fmt: skip
        ax.set_title(f"{name.upper()} vs request rate")
        ax.set_xlabel("offered request rate (req/s)" + ("; inf drawn at 2x" if finite else ""))
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(xs, values("request_throughput"), "x:", color="grey", label="achieved req/s")
        twin.set_ylabel("achieved req/s", color="grey")
        handles, labels = ax.get_legend_handles_labels()
        more, more_labels = twin.get_legend_handles_labels()
        ax.legend(handles + more, labels + more_labels, loc="upper left", fontsize=8)
    fig.suptitle(f"Rate sweep\n{label.subtitle()}", fontsize=10)
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_run(run: RunOutput, stem: Path, label: RunLabel) -> list[Path]:
    """``<stem>_latency_cdf.png``, ``<stem>_timeline.png`` and ``<stem>_workload.png``."""
    figures = {
        "latency_cdf": latency_figure,
        "timeline": timeline_figure,
        "workload": workload_figure,
    }
    return [
        _save(make(run, label), stem.with_name(f"{stem.name}_{kind}.png"))
        for kind, make in figures.items()
    ]


def plot_sweep(points: list[dict], path: Path, label: RunLabel, percentile: str = "p99") -> Path:
    """The sweep's latency-vs-rate figure, saved to ``path``."""
    return _save(sweep_figure(points, label, percentile), path)
