"""The prefix-cache timing side channel, closed by ``cache_salt``: does tenant B's time to first
token tell whether tenant A just sent the same prompt?

One prefill and one decode worker (pinned to core 0 and core 1, ``--threads 1`` each, prefix
caching on, loopback tcp) behind the real router with its default policy (``--disaggregation
conditional``). Each trial makes a fresh random prompt P (``--prompt-tokens`` long) and another
one Q, and sends, one at a time, streamed:

1. A: P under salt "tenant-a" (untimed: it caches P for A, on both workers);
2. B: P under salt "tenant-b": the *probe*, a prompt another tenant just cached;
3. B: Q under salt "tenant-b": the *fresh* reference, a prompt nobody cached;
4. A: P again under "tenant-a": the *own hit*, the control that shows the channel exists (the
   signal an unsalted deployment gives everyone).

Steps 2 and 3 alternate their order per trial so neither always runs first. Figures: median
TTFT per condition, the ratio probe / fresh, and a two-sided permutation test of the difference
in medians (``--permutations`` shuffles of the pooled samples; scipy is not a dependency): p
above 0.05 means "equal within noise"; the same test on own hit vs fresh shows what a leak looks
like. Also the ``kv_source`` each condition got (the router's decision must not differ either).

    python benchmarks/cache_salt_ttft.py [--trials 30] [--prompt-tokens 512]

Prints the command, the machine and the figures; writes cache_salt_ttft.json to --out-dir
(default benchmarks/results/). About 3 minutes with the defaults on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from goodput import PROCESS_ENV, pinned_worker, wait_workers  # noqa: E402
from machine import machine_info  # noqa: E402

from loadtest.datasets import random_text  # noqa: E402
from services.redis_server import RedisServer  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORKER_FLAGS = ["--heartbeat-seconds", "0.5", "--ttl-seconds", "2", "--kv-transport", "tcp"]
WORKER_FLAGS += ["--num-blocks", "2048", "--threads", "1"]  # prefix caching on (the default)
CONDITIONS = ("probe", "fresh", "own_hit")


@dataclass
class Sample:
    ttft: float  # seconds, client side
    cached_tokens: int
    kv_source: str


def one_request(url: str, prompt: str, salt: str) -> Sample:
    """A streamed completion of two tokens; when its first token arrived, and its usage."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }
    ttft, usage = None, None
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    if ttft is None or usage is None:
        raise RuntimeError("no token or no usage in the stream")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Sample(ttft, cached, usage["pdserve_timings"][0]["kv_source"])


def start(redis_url: str) -> tuple[list[WorkerProcess], str]:
    prefix = f"salt{uuid.uuid4().hex[:6]}:"
    registry = ["--redis-url", redis_url, "--redis-prefix", prefix]
    processes = [
        pinned_worker("prefill", [*WORKER_FLAGS, *registry], {0}),
        pinned_worker("decode", [*WORKER_FLAGS, *registry], {1}),
    ]
    for p in processes:
        p.spawn()
    for p in processes:
        p.wait_ready()
    router = WorkerProcess("router", ["--port", "0", *registry], PROCESS_ENV)
    processes.append(router)
    router.start()
    url = str(router.info["url"])
    wait_workers(url, 2)
    return processes, url


def measure(args: argparse.Namespace, url: str) -> dict[str, list[Sample]]:
    rng = np.random.default_rng(args.seed)
    for _ in range(2):  # untimed: first-call costs of the router and the workers
        one_request(url, random_text(args.prompt_tokens, rng), "warmup")
    out: dict[str, list[Sample]] = {c: [] for c in CONDITIONS}
    for trial in tqdm(range(args.trials), unit="trial", file=sys.stderr):
        shared, fresh = (random_text(args.prompt_tokens, rng) for _ in range(2))
        one_request(url, shared, "tenant-a")
        order = [("probe", shared), ("fresh", fresh)]
        for condition, prompt in order if trial % 2 == 0 else reversed(order):
            out[condition].append(one_request(url, prompt, "tenant-b"))
        out["own_hit"].append(one_request(url, shared, "tenant-a"))
    return out


def permutation_p(x: list[float], y: list[float], rounds: int, seed: int) -> float:
    """Two-sided p-value of |median(x) - median(y)| under shuffles of the pooled samples."""
    rng = np.random.default_rng(seed)
    pooled = np.array(x + y)
    observed = abs(np.median(x) - np.median(y))
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if abs(np.median(pooled[: len(x)]) - np.median(pooled[len(x) :])) >= observed:
            hits += 1
    return (hits + 1) / (rounds + 1)


def summarize(args: argparse.Namespace, out: dict[str, list[Sample]]) -> dict[str, Any]:
    ttft = {c: [s.ttft for s in out[c]] for c in CONDITIONS}
    medians = {c: statistics.median(ttft[c]) for c in CONDITIONS}
    return {
        "median_ttft_ms": {c: round(1000 * m, 1) for c, m in medians.items()},
        "p25_p75_ttft_ms": {
            c: [round(1000 * float(np.percentile(ttft[c], q)), 1) for q in (25, 75)]
            for c in CONDITIONS
        },
        "ratio_probe_over_fresh": round(medians["probe"] / medians["fresh"], 3),
        "p_probe_vs_fresh": round(
            permutation_p(ttft["probe"], ttft["fresh"], args.permutations, args.seed), 4
        ),
        "ratio_own_hit_over_fresh": round(medians["own_hit"] / medians["fresh"], 3),
        "p_own_hit_vs_fresh": round(
            permutation_p(ttft["own_hit"], ttft["fresh"], args.permutations, args.seed), 4
        ),
        "cached_tokens_max": {c: max(s.cached_tokens for s in out[c]) for c in CONDITIONS},
        "kv_source": {c: dict(Counter(s.kv_source for s in out[c])) for c in CONDITIONS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--permutations", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    command = "python " + shlex.join(["benchmarks/cache_salt_ttft.py", *sys.argv[1:]])
    machine = machine_info(1, workers="prefill on core 0, decode on core 1, --threads 1 each")
    print(command)
    print(json.dumps(machine, indent=2))
    with RedisServer() as redis:
        processes, url = start(redis.url)
        try:
            out = measure(args, url)
        finally:
            for p in reversed(processes):
                p.terminate(timeout=15)
    summary = summarize(args, out)
    print(json.dumps(summary, indent=2))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    samples = {c: [vars(s) for s in out[c]] for c in CONDITIONS}
    record = {"command": command, "machine": machine, "summary": summary, "samples": samples}
    (args.out_dir / "cache_salt_ttft.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
