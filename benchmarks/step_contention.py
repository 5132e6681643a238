"""How much a worker's own event loop slows its engine steps: the same kinds of steps timed in
three arrangements, each in its own process (libgomp's teams live as long as their threads):

- the engine built on the event loop's thread and stepped on ``AsyncEngine``'s step thread
  (the worker service until 2026-11-26);
- the engine built on its step thread and the loop's thread made serial (``AsyncEngine.build``
  and ``kernels.openmp.serial_thread``, as ``run_worker`` does now);
- the bare ``LLMEngine``, built and stepped on one thread, no loop.

Load: 4 streams of 40-token prompts decode 150 tokens each; 48-token prompts (4 tokens each)
arrive every 0.6 s. Timed: ``engine.run`` of every step (wrapped from this script, the engine
unchanged); reported: the median of decode-only steps (4 or more sequences) and of mixed steps
(a prompt with 3 or more decodes). On the Zen 4 VM, 2 threads, quiet: decode-only 46.2 / 30.2 /
31.7 ms and mixed 124.5 / 110.9 / 97.0 ms: a second OpenMP team (the loop thread's, from the
build) cost the decode steps 1.5x; what is left under the loop is the mixed steps' +14 ms.

    python benchmarks/step_contention.py [--threads 2] [--probes 8]

About a minute. Other load on the machine shows as noise: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 80
Step = tuple[float, int, int]  # seconds, prompt chunks, decodes


def timed_steps(engine: Any) -> list[Step]:
    """Wrap ``engine.run`` so each step's time and contents are recorded."""
    steps: list[Step] = []
    run = engine.run

    def timed(batch: Any) -> Any:
        started = time.perf_counter()
        out = run(batch)
        prompts = sum(1 for n in batch.num_tokens if n != 1)
        steps.append((time.perf_counter() - started, prompts, len(batch.num_tokens) - prompts))
        return out

    engine.run = timed
    return steps


async def under_the_loop(async_engine: Any, tokens: list[int], probes: int) -> None:
    from pdserve import SamplingParams

    async_engine.start()

    async def request(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        stream, _ = await async_engine.add_request(request_id, prompt, params)
        async for _ in async_engine.outputs(request_id, stream):
            pass

    background = [asyncio.create_task(request(f"d{i}", tokens[i : i + 40], 150)) for i in range(4)]
    await asyncio.sleep(1.0)
    arrivals = []
    for k in range(probes):
        arrivals.append(asyncio.create_task(request(f"p{k}", tokens[50 + k : 98 + k], 4)))
        await asyncio.sleep(0.6)
    await asyncio.gather(*arrivals, *background)
    await async_engine.stop()


def bare(engine: Any, tokens: list[int], probes: int) -> None:
    from pdserve import SamplingParams

    for i in range(4):
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        engine.add_request(f"x{i}", tokens[i : i + 40], params)
    for _ in range(5):
        engine.step()
    for k in range(probes):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request(f"y{k}", tokens[60 + k : 108 + k], params)
        for _ in range(6):
            engine.step()


def medians(steps: list[Step]) -> tuple[float, float]:
    decode = [t for t, prompts, decodes in steps if not prompts and decodes >= 4]
    mixed = [t for t, prompts, decodes in steps if prompts and decodes >= 3]
    return statistics.median(decode), statistics.median(mixed)


ARRANGEMENTS = {
    "loop, engine built on the loop's thread": "built-on-loop",
    "loop, engine built on its step thread": "built-on-step",
    "bare LLMEngine": "bare",
}


def one(arrangement: str, threads: int, probes: int) -> tuple[float, float]:
    """One arrangement in this process (libgomp's teams live as long as their threads)."""
    from pdserve import LLM
    from services.engine.llm_engine import LLMEngine
    from services.worker.async_engine import AsyncEngine

    def make() -> LLMEngine:
        return LLM(
            num_threads=threads, enable_prefix_caching=False, max_num_batched_tokens=256
        ).engine

    if arrangement == "bare":
        engine = make()
        steps = timed_steps(engine)
        bare(engine, engine.tokenizer.encode(TEXT), probes)
        return medians(steps)
    if arrangement == "built-on-loop":
        async_engine = AsyncEngine(make())
    else:
        from kernels.openmp import serial_thread

        serial_thread()  # as run_worker does for the event loop's thread
        async_engine = AsyncEngine.build(make)
    steps = timed_steps(async_engine.engine)
    tokens = async_engine.engine.tokenizer.encode(TEXT)
    asyncio.run(under_the_loop(async_engine, tokens, probes))
    return medians(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probes", type=int, default=8, help="prompts arriving, each path")
    parser.add_argument("--one", choices=sorted(ARRANGEMENTS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.threads, args.probes)))
        return 0
    print(f"threads {args.threads}: median step, ms                    decode-only   mixed")
    for label, arrangement in ARRANGEMENTS.items():
        command = [sys.executable, __file__, "--one", arrangement, "--threads", str(args.threads)]
        out = subprocess.run(
            command + ["--probes", str(args.probes)], capture_output=True, text=True
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        decode, mixed = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {label:<44} {decode * 1e3:8.1f} {mixed * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
