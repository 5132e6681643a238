"""The plots say what they show: each figure of a real run (stand-in server, chat endpoint,
chatbot preset) is rendered and its texts read back from matplotlib: the subtitle naming the
run, panel titles, percentile and SLO labels in legends, the outlier note, the preset's outline,
integer colorbar ticks, the sweep legend's achieved-throughput line."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.arrivals import Schedule
from loadtest.client import CHAT, ClientConfig, RunOutput, run
from loadtest.datasets import DatasetConfig, length_ranges, load
from loadtest.metrics import compute
from loadtest.plots import (
    RunLabel,
    latency_figure,
    plot_run,
    sweep_figure,
    timeline_figure,
    workload_figure,
)
from loadtest.report import result_dict
from tests.loadtest.standin import MODEL, standin

SLOS = {"ttft": 500.0, "tpot": 50.0, "itl_p99": 80.0, "e2el": 9000.0}


@pytest.fixture(scope="module")
def chat_run() -> tuple[RunOutput, RunLabel, str]:
    dataset = DatasetConfig(name="chatbot", num_prompts=12, seed=3)
    samples = load(dataset)
    for s in samples:  # short answers keep the run to about a second
        s.max_tokens = 1 + s.max_tokens // 50
    with standin(ttft=0.02, itl=0.005) as url:
        cfg = ClientConfig(base_url=url, model=MODEL, endpoint=CHAT, disable_tqdm=True)
        out = asyncio.run(run(cfg, samples, Schedule(rate=50.0, burstiness=math.inf), 12))
    # One stalled gap far beyond the others, and one prompt longer than the preset allows.
    out.results[0].itls.append(3.0)
    out.results[1].prompt_len = 260
    label = RunLabel(
        MODEL,
        cfg.url,
        "chatbot",
        "50 req/s",
        "2026-01-02 03:04",
        slos=SLOS,
        ranges=length_ranges(dataset),
        chat=True,
    )
    return out, label, url


def legend_texts(ax: Any) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def assert_subtitle(fig: Any, url: str) -> None:
    title = fig._suptitle.get_text()
    for part in (MODEL, f"{url}/v1/chat/completions", "chatbot", "50 req/s", "2026-01-02"):
        assert part in title, (part, title)


def test_latency_cdfs(chat_run) -> None:  # type: ignore[no-untyped-def]
    out, label, url = chat_run
    fig = latency_figure(out, label)
    assert_subtitle(fig, url)
    axes = {ax.get_title().split(" ")[0]: ax for ax in fig.axes}
    assert set(axes) == {"TTFT", "TPOT", "ITL", "E2E"}
    for name, slo in (
        ("TTFT", "SLO ttft 500 ms"),
        ("TPOT", "SLO tpot 50 ms"),
        ("ITL", "SLO itl_p99 80 ms"),
        ("E2E", "SLO e2el 9000 ms"),
    ):
        texts = legend_texts(axes[name])
        assert slo in texts, (name, texts)
        assert [t.split(" ")[0] for t in texts[:3]] == ["p50", "p90", "p99"]
        # The SLO line is on the axis even when every sample is far below it.
        assert axes[name].get_xlim()[1] > SLOS[slo.split(" ")[1]], (name, axes[name].get_xlim())
    # The 3 s stall does not stretch the ITL axis; it is named instead.
    itl = axes["ITL"]
    assert itl.get_xlim()[1] < 200
    assert any("1 beyond the axis (max 3000 ms)" in t for t in legend_texts(itl))


def test_timeline(chat_run) -> None:  # type: ignore[no-untyped-def]
    out, label, url = chat_run
    fig = timeline_figure(out, label)
    assert_subtitle(fig, url)
    top, bottom = fig.axes
    assert "Throughput" in top.get_title()
    assert {"in flight", "arrivals"} <= set(legend_texts(bottom))


def test_workload(chat_run) -> None:  # type: ignore[no-untyped-def]
    out, label, url = chat_run
    fig = workload_figure(out, label)
    assert_subtitle(fig, url)
    ax, colorbar = fig.axes
    texts = legend_texts(ax)
    assert "chatbot range" in texts
    assert "1 above the ISL range: the chat template's tokens" in texts
    (box,) = ax.patches
    assert (box.get_x(), box.get_width()) == (50, 150)  # ISL 50-200
    ticks = colorbar.get_yticks()
    assert len(ticks) and all(float(t).is_integer() for t in ticks)


def test_sweep(chat_run) -> None:  # type: ignore[no-untyped-def]
    out, label, url = chat_run
    m = compute(out, SLOS)
    points = []
    for rate in (10, 20, "inf"):
        point = result_dict(ClientConfig(base_url=url, model=MODEL, endpoint=CHAT), out, m, False)
        points.append({**point, "request_rate": rate})
    fig = sweep_figure(points, label, "p99")
    assert_subtitle(fig, url)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [
        "TTFT vs request rate",
        "TPOT vs request rate",
        "E2EL vs request rate",
    ]
    for ax in panels:
        assert {"median", "p99", "achieved req/s"} <= set(legend_texts(ax))
    assert "SLO ttft 500 ms" in legend_texts(panels[0])


def test_plot_run_writes_the_three_pngs(chat_run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out, label, _ = chat_run
    paths = plot_run(out, tmp_path / "r", label)
    assert [p.name for p in paths] == ["r_latency_cdf.png", "r_timeline.png", "r_workload.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
