"""Long prompts, disaggregated: KV streamed while the prompt computes vs pulled once it is done.

One prefill and one decode worker (pinned to core 0 and core 1, ``--threads 1`` each, prefix
cache off, loopback tcp; the prefill worker computes ``--chunk`` tokens a step) serve two
routers over the same registry: ``streamed`` (the default, ``--disaggregation always``) and
``whole`` (the same with ``--no-stream-kv``). Requests of each prompt length go to the two
routers in turn, one at a time, each streamed back with ``ignore_eos`` and the router's
per-phase timings (``usage.pdserve_timings``).

The router answers the first token from the prefill worker as soon as it is sampled, in both
flows: the KV transfer never delays the first token. It delays the *second*: the decode worker
must hold the prompt's KV before its first step. So the figures per flow and length are the
medians of: TTFT, time to the second token (TT2T), the whole KV transfer, its exposed part (the
part after the prefill was done, which the second token waits for), and that exposed part's
share of TT2T. Streamed, the exposed part should be about one chunk's transfer; whole, the
whole prompt's.

    python benchmarks/kv_streaming.py [--lengths 512,1024,2048] [--repeats 5] [--chunk 256]

Prints the command, the machine and a table; writes kv_streaming.json and kv_streaming.png
(phases of the time to the second token, stacked, per flow and length) to --out-dir (default
benchmarks/results/). About 3 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from goodput import PROCESS_ENV, WORKER_FLAGS, pinned_worker, wait_workers  # noqa: E402
from machine import machine_info  # noqa: E402

from loadtest.datasets import random_text  # noqa: E402
from services.redis_server import RedisServer  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
FLOWS = {"streamed": [], "whole": ["--no-stream-kv"]}
PHASES = ("prefill_queue", "prefill_compute", "kv_transfer_exposed", "decode_queue")


@dataclass
class Sample:
    """One request: client-side times (s) and the router's phases (ms)."""

    ttft: float
    tt2t: float
    phases: dict[str, float] = field(default_factory=dict)


def one_request(url: str, prompt: str, max_tokens: int) -> Sample:
    """A streamed completion; the arrival times of its first two tokens and its phases."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times: list[float] = []
    phases: dict[str, float] = {}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter() - start)
            if event.get("usage"):
                phases = event["usage"]["pdserve_timings"][0]
    if len(times) < 2:
        raise RuntimeError(f"expected at least two token events, got {len(times)}")
    return Sample(times[0], times[1], phases)


def start(args: argparse.Namespace, redis_url: str) -> tuple[list[WorkerProcess], dict[str, str]]:
    """The pair and one router per flow; returns the processes and each flow's URL."""
    prefix = f"kvstream{uuid.uuid4().hex[:6]}:"
    registry = ["--redis-url", redis_url, "--redis-prefix", prefix]
    chunk = ["--max-num-batched-tokens", str(args.chunk)]
    processes = [
        pinned_worker("prefill", [*WORKER_FLAGS, *chunk, "--threads", "1", *registry], {0}),
        pinned_worker("decode", [*WORKER_FLAGS, "--threads", "1", *registry], {1}),
    ]
    for p in processes:
        p.spawn()
    for p in processes:
        p.wait_ready()
    urls = {}
    for flow, flags in FLOWS.items():
        router_args = ["--port", "0", "--disaggregation", "always", *flags, *registry]
        router = WorkerProcess("router", router_args, PROCESS_ENV)
        processes.append(router)
        router.start()
        urls[flow] = str(router.info["url"])
        wait_workers(urls[flow], 2)
    return processes, urls


def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, dict[int, list[Sample]]]:
    rng = np.random.default_rng(args.seed)
    out: dict[str, dict[int, list[Sample]]] = {flow: {} for flow in FLOWS}
    bar = tqdm(total=len(args.lengths) * args.repeats * len(FLOWS), unit="req", file=sys.stderr)
    for flow in FLOWS:  # one untimed request each: the routers' and workers' first-call costs
        one_request(urls[flow], random_text(64, rng), 2)
    for length in args.lengths:
        for flow in FLOWS:
            out[flow][length] = []
        for _ in range(args.repeats):
            prompt = random_text(length, rng)  # a new prompt each time: nothing is cached
            for flow in FLOWS:
                bar.set_description(f"{length} tokens, {flow}")
                out[flow][length].append(one_request(urls[flow], prompt, args.max_tokens))
                bar.update(1)
    bar.close()
    return out


def summarize(out: dict[str, dict[int, list[Sample]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Medians per flow and length (ms)."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for flow, by_length in out.items():
        summary[flow] = {}
        for length, samples in by_length.items():
            row = {
                "ttft_ms": statistics.median(s.ttft * 1000 for s in samples),
                "tt2t_ms": statistics.median(s.tt2t * 1000 for s in samples),
            }
            for key in ("kv_transfer", *PHASES, "decode_first_step"):
                row[f"{key}_ms"] = statistics.median(
                    s.phases.get(f"{key}_ms", 0.0) for s in samples
                )
            row["exposed_share_of_tt2t"] = statistics.median(
                s.phases.get("kv_transfer_exposed_ms", 0.0) / (s.tt2t * 1000) for s in samples
            )
            summary[flow][str(length)] = row
    return summary


def print_table(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    head = f"{'prompt':>7} {'flow':<9}{'TTFT':>8}{'TT2T':>8}{'prefill':>9}{'transfer':>9}"
    print(head + f"{'exposed':>9}{'share':>7}   (ms, medians; share: exposed / TT2T)")
    lengths = next(iter(summary.values())).keys()
    for length in lengths:
        for flow, rows in summary.items():
            r = rows[length]
            print(
                f"{length:>7} {flow:<9}{r['ttft_ms']:>8.0f}{r['tt2t_ms']:>8.0f}"
                f"{r['prefill_compute_ms']:>9.0f}{r['kv_transfer_ms']:>9.1f}"
                f"{r['kv_transfer_exposed_ms']:>9.1f}{r['exposed_share_of_tt2t']:>7.1%}"
            )


def save_plot(path: Path, summary: dict[str, dict[str, dict[str, float]]], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(next(iter(summary.values())).keys())
    colors = ("#bbb", "#4c72b0", "#dd8452", "#999", "#55a868")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    positions, labels = [], []
    for i, length in enumerate(lengths):
        for j, flow in enumerate(summary):
            x = i * (len(summary) + 0.5) + j
            bottom = 0.0
            for phase, color in zip((*PHASES, "decode_first_step"), colors):
                value = summary[flow][length][f"{phase}_ms"]
                label = phase if (i, j) == (0, 0) else None
                ax.bar(x, value, bottom=bottom, color=color, label=label)
                bottom += value
            positions.append(x)
            labels.append(f"{length}\n{flow}")
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("ms to the second token (phases, medians)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,1024,2048", help="prompt tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="requests per flow and length")
    p.add_argument("--chunk", type=int, default=256, help="prefill worker's tokens per step")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(1)
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    load = machine["load_avg_1m_at_start"]
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, load avg {load}")
    with RedisServer() as redis:
        processes, urls = start(args, redis.url)
        try:
            out = measure(args, urls)
        finally:
            for process in reversed(processes):
                process.terminate(timeout=15)
    summary = summarize(out)
    print_table(summary)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"command": command, "machine": machine, "chunk": args.chunk}
    path = args.out_dir / "kv_streaming.json"
    path.write_text(json.dumps({**data, "results": summary}, indent=2) + "\n")
    plot = args.out_dir / "kv_streaming.png"
    title = f"time to the second token, 1P+1D on 2 cores, prefill chunk {args.chunk} tokens"
    saved = [path] + ([plot] if save_plot(plot, summary, title) else [])
    print("saved " + " and ".join(str(p) for p in saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
