"""What structured outputs cost per decode step: JSON-schema-constrained decoding vs free text.

At each batch size (default 1 and 64) B requests of the same prompt are run through prefill,
then --steps pure decode steps (every sequence computes one token) are timed, three ways (two
rounds of the three in turn; the medians of the two rounds' medians are reported), float32
weights, no prefix cache:

- ``free``: no grammar (``ignore_eos``, so nothing ends early);
- ``json``: every sequence under the JSON schema below, its mask computed on the mask thread
  while the model runs (``Sampler.prepare``, the engine's default);
- ``json-serial``: the same with ``prepare`` disabled, so the masks are computed after the
  forward pass, on the critical path (what the overlap saves).

The schema asks for at least 40 strings, so no sequence completes its grammar within the timed
steps. Seeded draws at temperature 1. Besides the step's median, the mask work is timed on the
sampler instance (this script wraps its methods; the engine's code is unchanged): ``fill`` (the
matchers' sync + ``fill_next_token_bitmask`` for the batch, on the mask thread when overlapped)
and ``apply`` (on the critical path: waiting for the prepared masks, any row not prepared, and
``apply_token_bitmask_inplace``).

Run:

    python benchmarks/structured_cost.py                     # batch 1 and 64, 20 steps
    python benchmarks/structured_cost.py --batch-sizes 1,8 --steps 5

Prints the command line, the machine and a table; writes structured_cost.json to --out-dir
(default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from machine import machine_info  # benchmarks/machine.py (this folder is on sys.path)

from common.sampling_params import SamplingParams, StructuredOutput
from common.settings import from_fields
from services.engine.config import EngineConfig, default_num_threads
from services.engine.llm_engine import LLMEngine

PROMPT = "Write a JSON object that lists the notes of a long meeting about paged attention:"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 40},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "notes", "score"],
}
MODES = ("free", "json", "json-serial")


class Timer:
    """Accumulated seconds of the wrapped calls since the last ``take``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def params(mode: str, max_tokens: int, seed: int) -> SamplingParams:
    structured = None if mode == "free" else StructuredOutput("json_schema", json.dumps(SCHEMA))
    return SamplingParams(  # a grammar ends the output itself (it allows no EOS before then)
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=structured is None,
        structured=structured,
    )


def measure(engine: LLMEngine, mode: str, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    sampler = engine.sampler
    fill, apply = Timer(), Timer()
    original = sampler._fill_masks, sampler._apply_grammars, sampler.prepare
    sampler._fill_masks = fill.wrap(original[0])  # type: ignore[method-assign]
    sampler._apply_grammars = apply.wrap(original[1])  # type: ignore[method-assign]
    if mode == "json-serial":
        sampler.prepare = lambda seqs: None  # type: ignore[method-assign]
    try:
        ids = engine.tokenizer.encode(PROMPT)
        for i in range(batch):
            engine.add_request(f"{mode}-{batch}-{i}", ids, params(mode, steps + warmup + 2, i))
        step_ms: list[float] = []
        fill_ms: list[float] = []
        apply_ms: list[float] = []
        decoded = 0
        while engine.has_unfinished_requests() and len(step_ms) < steps:
            scheduled = engine.schedule()
            pure = len(scheduled.seqs) == batch and all(n == 1 for n in scheduled.num_tokens)
            fill.take(), apply.take()
            start = time.perf_counter()
            engine.run(scheduled)
            elapsed = time.perf_counter() - start
            decoded += pure
            if pure and decoded > warmup:
                step_ms.append(elapsed * 1e3)
                fill_ms.append(fill.take() * 1e3)
                apply_ms.append(apply.take() * 1e3)
        for i in range(batch):
            engine.abort_request(f"{mode}-{batch}-{i}")
    finally:
        sampler._fill_masks, sampler._apply_grammars, sampler.prepare = original  # type: ignore[method-assign]
    return {
        "mode": mode,
        "batch": batch,
        "steps": len(step_ms),
        "step_ms": statistics.median(step_ms),
        "fill_ms": statistics.median(fill_ms),
        "apply_ms": statistics.median(apply_ms),
    }


def new_engine(max_batch: int, args: argparse.Namespace) -> LLMEngine:
    """float32 (no bfloat16 emulation on AVX2), no prefix cache, room for the largest batch."""
    per_seq = -(-(64 + args.steps + args.warmup + 8) // 16)
    config = from_fields(
        EngineConfig,
        dtype="float32",
        block_size=16,
        num_blocks=max_batch * per_seq + 16,
        enable_prefix_caching=False,
        max_num_seqs=max_batch,
        num_threads=args.threads,
    )
    return LLMEngine(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=default_num_threads())
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    print("$ python benchmarks/structured_cost.py " + shlex.join(sys.argv[1:]))
    machine = machine_info(args.threads)
    print(json.dumps(machine))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine = new_engine(max(batches), args)
    results = []
    for batch in batches:
        # Rounds of the three modes in turn: a drift in the machine's load hits them alike.
        runs = [measure(engine, m, batch, args.steps, args.warmup) for _ in range(2) for m in MODES]
        base = None
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode]
            row = {
                k: statistics.median(r[k] for r in mine) for k in ("step_ms", "fill_ms", "apply_ms")
            }
            row |= {"mode": mode, "batch": batch, "steps": sum(r["steps"] for r in mine)}
            base = base or row["step_ms"]
            row["overhead_pct"] = 100 * (row["step_ms"] / base - 1)
            results.append(row)
            print(
                f"batch {batch:3d} {mode:12s} step {row['step_ms']:8.2f} ms "
                f"({row['overhead_pct']:+5.1f}%)  fill {row['fill_ms']:6.2f} ms  "
                f"apply {row['apply_ms']:6.2f} ms  ({row['steps']} steps)"
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = {"command": sys.argv, "machine": machine, "results": results}
    (args.out_dir / "structured_cost.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
