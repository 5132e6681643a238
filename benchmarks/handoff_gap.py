"""The hand-off gap: how long a disaggregated request's second token takes after its first.

The first token comes from the prefill worker; the second from the decode worker's first step
for the request, after it admitted the request, pulled the prompt's KV and committed it. Under
load that worker is mid-step when the request arrives, so the hand-off costs some of its steps;
this measures how many, against the steady gaps between the later tokens (its step time).

``pdserve up --disaggregation always`` (1 prefill + 1 decode worker) runs as a user starts it.
--background streams keep the decode worker busy (40-word prompts, 300 tokens each, again and
again); meanwhile --probes requests of --prompt-words words (about as many tokens) go one at a
time, each streamed back with 6 tokens (``ignore_eos``). Per probe, at the client: the TTFT, the
gap from the first token to the second, and the later gaps.

    python benchmarks/handoff_gap.py [--background 8] [--probes 20] [--prompt-words 400]

Prints the command, the machine and a table; writes handoff_gap.json to --out-dir (default
benchmarks/results/). About 2 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from machine import (
    describe_read_scaling,
    machine_info,
)  # benchmarks/machine.py (this folder is on sys.path)
from openai import OpenAI
from tqdm import tqdm

from loadtest.datasets import WORDS
from services.engine.config import default_num_threads

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--background", type=int, default=8, help="streams keeping decode busy")
    parser.add_argument("--probes", type=int, default=20, help="measured requests")
    parser.add_argument("--prompt-words", type=int, default=400, help="words per probe prompt")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.background < 0 or args.probes < 1 or args.prompt_words < 1:
        parser.error("--background >= 0, --probes and --prompt-words >= 1")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_system(port: int) -> subprocess.Popen[str]:
    """``pdserve up`` on ``port``, returned once the router is ready (its workers registered)."""
    command = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port)]
    up = subprocess.Popen(
        [*command, "--disaggregation", "always"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"pdserve up exited:\n{up.stderr.read() if up.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return up
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    up.terminate()
    raise SystemExit("pdserve up was not ready in 300 s")


PHASES = ("kv_transfer_exposed", "decode_queue", "decode_first_step")  # the router's, in ms


def token_times(
    client: OpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[list[float], dict[str, float]]:
    """When each streamed token arrived (perf_counter), from the moment the request was sent
    (the first entry), and the router's phase timings of the request (``pdserve_timings``)."""
    times = [time.perf_counter()]
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    phases: dict[str, float] = {}
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            phases = ((chunk.usage.model_extra or {}).get("pdserve_timings") or [{}])[0]
    return times, phases


def keep_busy(client: OpenAI, model: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = " ".join(rng.choice(WORDS) for _ in range(40))
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in stream:
            if stop.is_set():
                stream.close()
                break


def measure(args: argparse.Namespace, client: OpenAI, model: str) -> dict[str, list[float]]:
    stop = threading.Event()
    busy = [
        threading.Thread(target=keep_busy, args=(client, model, stop, i), daemon=True)
        for i in range(args.background)
    ]
    for thread in busy:
        thread.start()
    time.sleep(5)  # the background batch fills up
    rng = random.Random(0)
    samples: dict[str, list[float]] = {"ttft": [], "handoff": [], "later": []}
    samples |= {phase: [] for phase in (*PHASES, "unlocated")}
    try:
        for _ in tqdm(range(args.probes), desc="probes", unit="req", file=sys.stderr):
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            (sent, first, second, *later), phases = token_times(client, model, prompt, 6)
            samples["ttft"].append(first - sent)
            samples["handoff"].append(second - first)
            samples["later"] += [b - a for a, b in zip([second, *later], later)]
            located = [phases.get(f"{phase}_ms", 0.0) / 1e3 for phase in PHASES]
            for phase, seconds in zip(PHASES, located):
                samples[phase].append(seconds)
            # what no phase holds: the wait for the running step to end before the pulled KV
            # is committed (between two steps), and the relay of the token to the client
            samples["unlocated"].append(second - first - sum(located))
    finally:
        stop.set()
        for thread in busy:
            thread.join(timeout=30)
    return samples


def summary(samples: dict[str, list[float]]) -> dict[str, float]:
    def ms(values: list[float], q: float) -> float:
        return 1e3 * statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    out = {f"{name}_p50_ms": 1e3 * statistics.median(v) for name, v in samples.items()}
    out |= {f"{name}_p90_ms": ms(v, 90) for name, v in samples.items()}
    out["handoff_in_steps"] = out["handoff_p50_ms"] / out["later_p50_ms"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python " + shlex.join(sys.argv)
    machine = machine_info(default_num_threads(), probe_cores=True)
    print(f"$ {command}\nmachine: {machine['cpu']}, {machine['cores']} cores")
    print(describe_read_scaling(machine["read_scaling"]))
    port = free_port()
    up = start_system(port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        samples = measure(args, client, model)
    finally:
        up.terminate()
        up.wait(60)
    result: dict[str, Any] = {"command": command, "machine": machine, **vars(args)}
    result["out_dir"] = str(args.out_dir)
    result |= summary(samples)
    print(
        f"\n1P+1D, {args.background} background streams, {args.probes} probes of "
        f"{args.prompt_words} words -> 6 tokens\n"
        f"{'':<32}{'p50 ms':>8}{'p90 ms':>8}\n"
        f"{'TTFT':<32}{result['ttft_p50_ms']:>8.0f}{result['ttft_p90_ms']:>8.0f}\n"
        f"{'first -> second token (hand-off)':<32}"
        f"{result['handoff_p50_ms']:>8.0f}{result['handoff_p90_ms']:>8.0f}\n"
        f"{'later gaps (decode steps)':<32}{result['later_p50_ms']:>8.0f}"
        f"{result['later_p90_ms']:>8.0f}\n"
        f"hand-off = {result['handoff_in_steps']:.2f} decode steps (p50 / p50)\n"
        "the hand-off's phases (the router's pdserve_timings; 'unlocated': the rest, i.e. the\n"
        "wait for the running step to end before the KV is committed, and the relay):\n"
        + "".join(
            f"  {name:<30}{result[f'{name}_p50_ms']:>8.0f}{result[f'{name}_p90_ms']:>8.0f}\n"
            for name in (*PHASES, "unlocated")
        )
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "handoff_gap.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out_dir / 'handoff_gap.json'}")


if __name__ == "__main__":
    main()
