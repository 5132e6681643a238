"""How much a worker's own event loop slows its engine steps: the same kinds of steps timed
under the worker's ``AsyncEngine`` (the step on an executor thread, the event loop beside it
taking requests in and streaming outputs, as ``services/worker/async_engine.py`` runs them) and
on the bare ``LLMEngine`` (steps called one after another, no loop).

Load: 4 streams of 40-token prompts decode 150 tokens each; 48-token prompts (4 tokens each)
arrive every 0.6 s. Timed: ``engine.run`` of every step (wrapped from this script, the engine
unchanged); reported: the median of decode-only steps (4 or more sequences) and of mixed steps
(a prompt with 3 or more decodes), on each path. For the simulator's accuracy (docs/simulator.md,
``1xcoloc``): on the shared Zen 4 VM, 2 threads gave decode-only +20..+57% and mixed +9..+36 ms
under the loop, 1 thread (pinned) nothing.

    python benchmarks/step_contention.py [--threads 2] [--probes 8]

About 20 s. Other load on the machine shows as noise: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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


async def under_the_loop(engine: Any, tokens: list[int], probes: int) -> None:
    from pdserve import SamplingParams
    from services.worker.async_engine import AsyncEngine

    async_engine = AsyncEngine(engine)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probes", type=int, default=8, help="prompts arriving, each path")
    args = parser.parse_args(argv)
    from pdserve import LLM

    engine = LLM(
        num_threads=args.threads, enable_prefix_caching=False, max_num_batched_tokens=256
    ).engine
    tokens = engine.tokenizer.encode(TEXT)
    steps = timed_steps(engine)
    asyncio.run(under_the_loop(engine, tokens, args.probes))
    loop_decode, loop_mixed = medians(steps)
    steps.clear()
    bare(engine, tokens, args.probes)
    bare_decode, bare_mixed = medians(steps)
    print(f"threads {args.threads}: median step, ms        decode-only   mixed")
    print(f"  under the worker's event loop      {loop_decode * 1e3:8.1f} {loop_mixed * 1e3:8.1f}")
    print(f"  bare LLMEngine                     {bare_decode * 1e3:8.1f} {bare_mixed * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
