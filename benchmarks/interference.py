"""Prefill/decode interference, made visible: the inter-token latency of streams that are
already decoding, before and while long prompts arrive.

A few streaming requests with short prompts decode steadily; meanwhile long prompts (one output
token each) arrive one after another. Every gap between two tokens of a background stream is
"loaded" when it overlaps the time a long prompt was in flight (sent, not yet answered), else
"quiet". On a colocated worker a long prompt's prefill shares the decode steps' core, so the
loaded gaps stretch (head-of-line blocking, softened by chunked prefill); on a disaggregated
pair the prefill runs on the other worker, and the decode worker only pays for the KV pull.

Used by ``benchmarks/goodput.py`` on each deployment it starts; the measurement itself is
:func:`measure`, against any router URL.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtest.datasets import random_text


@dataclass(frozen=True)
class InterferenceConfig:
    """The experiment's shape (defaults: ~10 s per deployment on this CPU)."""

    model: str = "SmolLM2-135M-Instruct"
    num_streams: int = 4  # background streams decoding throughout
    stream_prompt_tokens: int = 32
    num_long: int = 3  # long prompts, sent one after another
    long_prompt_tokens: int = 1024
    warmup_s: float = 2.0  # quiet decoding before the first long prompt
    gap_s: float = 1.5  # between one long prompt's answer and the next one's arrival
    seed: int = 0


@dataclass
class InterferenceResult:
    """Token arrival times of the background streams and the long prompts' windows, in seconds
    from the start of the experiment."""

    token_times: list[list[float]] = field(default_factory=list)
    long_windows: list[tuple[float, float]] = field(default_factory=list)

    def gaps(self) -> tuple[list[float], list[float]]:
        """(quiet, loaded) inter-token gaps in ms; the first token's wait is not a gap."""
        quiet: list[float] = []
        loaded: list[float] = []
        for times in self.token_times:
            for before, after in zip(times, times[1:]):
                overlaps = any(before < end and after > start for start, end in self.long_windows)
                (loaded if overlaps else quiet).append((after - before) * 1000)
        return quiet, loaded

    def summary(self) -> dict[str, Any]:
        quiet, loaded = self.gaps()

        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        return {
            "itl_quiet_p50_ms": pct(quiet, 50),
            "itl_quiet_p99_ms": pct(quiet, 99),
            "itl_loaded_p50_ms": pct(loaded, 50),
            "itl_loaded_p99_ms": pct(loaded, 99),
            "itl_loaded_max_ms": max(loaded) if loaded else None,
            "long_prompt_ttft_ms": [round((e - s) * 1000, 1) for s, e in self.long_windows],
            "num_gaps": {"quiet": len(quiet), "loaded": len(loaded)},
        }


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], t0: float, out: list[float]):  # type: ignore[no-untyped-def]
    """Stream one completion, appending each content chunk's arrival time to ``out``."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    out.append(time.perf_counter() - t0)


async def _long_prompts(
    client: httpx.AsyncClient, cfg: InterferenceConfig, t0: float, result: InterferenceResult
) -> None:
    rng = np.random.default_rng(cfg.seed + 1)
    await asyncio.sleep(cfg.warmup_s)
    for _ in range(cfg.num_long):
        body = {
            "model": cfg.model,
            "prompt": random_text(cfg.long_prompt_tokens, rng),
            "max_tokens": 1,
            "temperature": 0,
        }
        start = time.perf_counter() - t0
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        result.long_windows.append((start, time.perf_counter() - t0))
        await asyncio.sleep(cfg.gap_s)


async def measure(url: str, cfg: InterferenceConfig = InterferenceConfig()) -> InterferenceResult:
    """Run the experiment against the router at ``url``; background streams are cancelled (the
    router then aborts them and frees their blocks) once the last long prompt is answered."""
    rng = np.random.default_rng(cfg.seed)
    result = InterferenceResult(token_times=[[] for _ in range(cfg.num_streams)])
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        t0 = time.perf_counter()
        streams = [
            asyncio.create_task(
                _stream(
                    client,
                    {
                        "model": cfg.model,
                        "prompt": random_text(cfg.stream_prompt_tokens, rng),
                        "max_tokens": 4096,
                        "ignore_eos": True,
                        "temperature": 0,
                        "stream": True,
                    },
                    t0,
                    times,
                )
            )
            for times in result.token_times
        ]
        try:
            await _long_prompts(client, cfg, t0, result)
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    return result


def save_plot(path: Path, results: dict[str, InterferenceResult], title: str) -> bool:
    """Per deployment: each background stream's inter-token gaps over time, with the long
    prompts' in-flight windows shaded."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items()):
        for start, end in result.long_windows:
            ax.axvspan(start, end, color="tab:red", alpha=0.15, linewidth=0)
        for times in result.token_times:
            gaps = np.diff(times) * 1000  # each gap drawn across the time it lasted
            ax.step(times[1:], gaps, where="pre", linewidth=0.8)
        summary = result.summary()
        ax.set_title(
            f"{name}: ITL p99 quiet {summary['itl_quiet_p99_ms'] or 0:.0f} ms, "
            f"while long prompts arrive {summary['itl_loaded_p99_ms'] or 0:.0f} ms",
            fontsize=9,
        )
        ax.set_ylabel("inter-token gap, ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (shaded: a long prompt in flight)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def to_json(results: dict[str, InterferenceResult], cfg: InterferenceConfig) -> dict[str, Any]:
    return {
        "config": asdict(cfg),
        "deployments": {name: r.summary() for name, r in results.items()},
    }
