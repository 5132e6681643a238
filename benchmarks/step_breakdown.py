"""Where a pdserve decode step goes: the model forward vs everything else in ``LLMEngine.step``.

What is measured: pure decode steps (every running sequence computes one token) at a few decode
batch sizes (default 1 and 64) with a context of about --context tokens (default 128: prompts of
exactly that many tokens; the context grows by one token per step). B requests are added, stepped
through prefill and --warmup decode steps, then --steps decode steps are timed (greedy,
``ignore_eos``, prefix caching off).

How: the engine's own methods are wrapped with timers on the instance, from this script only
(the engine's code is unchanged): ``runner.execute`` (input prep + model forward + logits; its
``model.forward`` and ``model.compute_logits`` are timed inside it), ``scheduler.schedule``,
``scheduler.on_step_done``, ``sampler``, ``outputs.process_token`` (detokenize + stop checks, per
sequence) and ``outputs.output`` (building the outputs, per request). "rest" is the ``step()`` total
minus ``runner.execute``; "other" is what of the rest no wrapper covers (loops, forks,
bookkeeping). Reported per part: the median over steps in ms, and its share of the summed step
time over all timed steps (so shares add up to 100%).

Run:

    python benchmarks/step_breakdown.py                   # batch 1 and 64, 30 steps, context 128
    python benchmarks/step_breakdown.py --steps 5 --batch-sizes 1,8
    python benchmarks/step_breakdown.py --dtype bfloat16 --batch-sizes 1,4 --fused-ab

Prints the command line, the machine and a table; writes step_breakdown.json to --out-dir
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

import torch
from machine import (
    describe_read_scaling,
    machine_info,
)  # benchmarks/machine.py (this folder is on sys.path)
from tqdm import tqdm

from services.engine.config import default_num_threads

TEXT = (
    "Paged attention stores the key and value cache of every sequence in fixed-size blocks, "
    "so memory is allocated on demand and shared between sequences with a common prefix. "
    "A continuous-batching scheduler decides at every step which sequences run, admitting new "
    "requests as soon as others finish. On a CPU the decode step of a small model is short, so "
    "the time spent outside the model forward can be a visible part of the total. "
)
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 2048  # the engine's default step budget (prefill is chunked by it)

# (key, label, indent) in table order; keys are the timers plus the derived parts.
ROWS = [
    ("step", "step total (LLMEngine.step)", 0),
    ("execute", "model (runner.execute)", 1),
    ("prep", "input prep + metadata", 2),
    ("forward", "model.forward", 2),
    ("logits", "model.compute_logits", 2),
    ("rest", "rest (step - execute)", 1),
    ("schedule", "scheduler.schedule", 2),
    ("on_step_done", "scheduler.on_step_done", 2),
    ("sampler", "sampler", 2),
    ("process_token", "detokenize + stop checks", 2),
    ("output", "build outputs", 2),
    ("other", "other (loops, bookkeeping)", 2),
]


class StepTimers:
    """Per-step accumulated seconds of wrapped callables (inactive while ``current`` is None)."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.last: dict[str, Any] = {}

    def wrap(self, owner: object, attr: str, name: str) -> None:
        """Replace ``owner.attr`` on the instance by a timed wrapper (the class is untouched;
        ``__call__``, which Python looks up on the class, is wrapped in a per-instance
        subclass)."""
        fn: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.current is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.current[name] = self.current.get(name, 0.0) + spent
            self.last[name] = result
            return result

        if attr == "__call__":
            owner.__class__ = type(
                type(owner).__name__, (type(owner),), {"__call__": staticmethod(timed)}
            )
        else:
            setattr(owner, attr, timed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch-sizes", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="prompt length (tokens)")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_num_threads(),
        help="torch threads; all usable cores unless set",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine's dtype"
    )
    parser.add_argument(
        "--fused-ab",
        action="store_true",
        help="alternate steps with and without the fused decode layers (bfloat16, B <= 4): the "
        "table is the fused steps', and each batch size's ratio is printed",
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (None: SmolLM2-135M-Instruct GGUF)"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results"),
        help="where step_breakdown.json goes",
    )
    args = parser.parse_args(argv)
    args.batch_sizes = sorted({int(n) for n in args.batch_sizes.split(",") if n.strip()})
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        parser.error("--batch-sizes must be positive integers")
    if args.context < 1 or args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("need --context, --steps, --threads >= 1 and --warmup >= 0")
    return args


def print_header(args: argparse.Namespace, machine: dict[str, Any]) -> str:
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} "
        f"usable, load avg {machine['load_avg_1m_at_start']}), torch {machine['torch']} "
        f"({machine['torch_threads']} threads), "
        f"python {machine['python']}"
    )
    print(
        f"model: {args.model or 'SmolLM2-135M-Instruct (default GGUF)'}, {args.dtype}, greedy; "
        f"context {args.context} tokens (+1 per step); {args.warmup} warm-up + "
        f"{args.steps} timed decode steps per batch size"
    )
    return command


def max_output_tokens(args: argparse.Namespace, batch: int) -> int:
    """Enough that no request finishes: while a large batch is still being prefilled (chunked
    over several steps), the requests prefilled first already decode."""
    prefill_steps = -(-batch * args.context // MAX_BATCHED_TOKENS) + 1
    timed = args.steps * (2 if args.fused_ab else 1)  # --fused-ab: each step twice
    return prefill_steps + args.warmup + timed + 2


def load_engine(args: argparse.Namespace) -> Any:
    """An engine with room for the largest batch over its whole run."""
    from pdserve import LLM

    batch = args.batch_sizes[-1]
    per_seq = -(-(args.context + max_output_tokens(args, batch)) // BLOCK_SIZE)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=BLOCK_SIZE,
        num_blocks=batch * per_seq + 16,
        enable_prefix_caching=False,
        max_num_seqs=batch,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        num_threads=args.threads,
    )
    return llm.engine


def install_timers(engine: Any) -> StepTimers:
    timers = StepTimers()
    timers.wrap(engine.runner, "execute", "execute")
    timers.wrap(engine.runner.model, "forward", "forward")
    timers.wrap(engine.runner.model, "compute_logits", "logits")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.scheduler, "on_step_done", "on_step_done")
    timers.wrap(engine.sampler, "__call__", "sampler")
    timers.wrap(engine.outputs, "process_token", "process_token")
    timers.wrap(engine.outputs, "output", "output")
    return timers


def make_prompts(engine: Any, batch: int, context: int) -> list[list[int]]:
    """``batch`` different prompts of exactly ``context`` tokens (shifted windows of TEXT)."""
    piece = engine.tokenizer.encode(TEXT)
    stream = piece * (-(-(context + 7 * batch) // len(piece)) + 1)
    return [stream[7 * i : 7 * i + context] for i in range(batch)]


def start_decoding(engine: Any, args: argparse.Namespace, batch: int) -> list[str]:
    """Add ``batch`` requests and step until every one is prefilled and warmed up."""
    from pdserve import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=max_output_tokens(args, batch), ignore_eos=True
    )
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, make_prompts(engine, batch, args.context)):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked over several steps for large batches)
        started.update(o.request_id for o in engine.step())
    for _ in range(args.warmup):
        engine.step()
    return ids


def timed_step(engine: Any, timers: StepTimers, batch: int) -> dict[str, float]:
    """One decode step; its parts in seconds (derived parts included)."""
    timers.current = {}
    start = time.perf_counter()
    outputs = engine.step()
    total = time.perf_counter() - start
    parts, timers.current = timers.current, None
    scheduled = timers.last["schedule"]
    if len(scheduled.seqs) != batch or any(n != 1 for n in scheduled.num_tokens):
        raise RuntimeError(f"step was not a pure decode of {batch} sequences")
    if len(outputs) != batch or any(o.finished for o in outputs):
        raise RuntimeError("a request finished or stalled during the timed steps")
    parts["step"] = total
    parts["rest"] = total - parts["execute"]
    parts["prep"] = parts["execute"] - parts["forward"] - parts["logits"]
    named = ("schedule", "on_step_done", "sampler", "process_token", "output")
    parts["other"] = parts["rest"] - sum(parts.get(k, 0.0) for k in named)
    return parts


def measure(
    engine: Any, timers: StepTimers, args: argparse.Namespace, batch: int, bar: tqdm
) -> list[dict[str, float]]:
    ids = start_decoding(engine, args, batch)
    steps = []
    for _ in range(args.steps):
        steps.append(timed_step(engine, timers, batch))
        bar.update(1)
    for request_id in ids:
        engine.abort_request(request_id)
    return steps


def measure_fused_ab(
    engine: Any, timers: StepTimers, args: argparse.Namespace, batch: int, bar: tqdm
) -> tuple[list[dict[str, float]], list[float]]:
    """Steps with the fused decode layers (services/engine/model/fused_decode.py) and the step
    times without them, alternating step by step on the same sequences: the two see the same
    machine at the same minutes."""
    model = engine.runner.model
    fused = model.fused_decode
    if fused is None or batch not in fused.by_rows:
        raise RuntimeError(f"no fused decode call at B={batch} (bfloat16, compiled kernels, 1-4)")
    ids = start_decoding(engine, args, batch)
    with_fused, without = [], []
    try:
        for _ in range(args.steps):
            with_fused.append(timed_step(engine, timers, batch))
            model.fused_decode = None
            without.append(timed_step(engine, timers, batch)["step"])
            model.fused_decode = fused
            bar.update(1)
    finally:
        model.fused_decode = fused
    for request_id in ids:
        engine.abort_request(request_id)
    return with_fused, without


def summarize(steps: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    total = sum(s["step"] for s in steps)
    summary = {}
    for key, _, _ in ROWS:
        values_ms = [s.get(key, 0.0) * 1e3 for s in steps]
        summary[key] = {
            "median_ms": statistics.median(values_ms),
            "mean_ms": statistics.fmean(values_ms),
            "share": sum(values_ms) / 1e3 / total,
            "per_step_ms": [round(v, 4) for v in values_ms],
        }
    return summary


def print_table(results: dict[int, dict[str, dict[str, Any]]]) -> None:
    batches = list(results)
    head = "".join(f"{f'B={b} ms':>12}{'share':>8}" for b in batches)
    print()
    print(f"{'part':<34}{head}")
    for key, label, indent in ROWS:
        cells = "".join(
            f"{results[b][key]['median_ms']:>12.3f}{results[b][key]['share'] * 100:>7.1f}%"
            for b in batches
        )
        print(f"{'  ' * indent + label:<34}{cells}")
    print("ms: median over the timed steps; share: of the summed step time over those steps.")
    for b in batches:
        per_token = results[b]["step"]["median_ms"] / b
        print(f"B={b}: {per_token:.3f} ms per token, {1e3 / per_token:.1f} tokens/s in decode")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads, probe_cores=True)
    command = print_header(args, machine)
    print(describe_read_scaling(machine["read_scaling"]))
    print("loading model ...", flush=True)
    engine = load_engine(args)
    timers = install_timers(engine)

    results: dict[int, dict[str, dict[str, Any]]] = {}
    unfused_ms: dict[int, list[float]] = {}
    total = len(args.batch_sizes) * args.steps
    with tqdm(total=total, desc="decode steps", unit="step", file=sys.stderr) as bar:
        for batch in args.batch_sizes:
            bar.set_postfix_str(f"B={batch}")
            if args.fused_ab:
                steps, without = measure_fused_ab(engine, timers, args, batch, bar)
                unfused_ms[batch] = [t * 1e3 for t in without]
            else:
                steps = measure(engine, timers, args, batch, bar)
            results[batch] = summarize(steps)
    print_table(results)
    for batch, times in unfused_ms.items():
        on, off = results[batch]["step"]["median_ms"], statistics.median(times)
        print(
            f"B={batch}, fused decode layers on / off (alternating steps): {on:.3f} / "
            f"{off:.3f} ms a step, {off / on:.2f}x"
        )

    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "step_breakdown.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {
        "command": command,
        "machine": machine,
        "config": config,
        "results": {str(b): r for b, r in results.items()},
        "unfused_step_ms": {str(b): t for b, t in unfused_ms.items()},
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
