"""One system's side of ``benchmarks/peer_vllm.py``'s offline comparison, run in that system's
own interpreter (vLLM's peer venv, or ours): load the model once, time each workload a few
times, print one JSON line.

Workloads (greedy, ``ignore_eos``, the same random token-id prompts on both sides, new ones for
every repeat so that no prompt is ever served from a prefix cache):

- ``batch``: 64 prompts of 128 tokens -> 128 tokens each, all submitted at once;
- ``single``: one prompt of 128 tokens -> 128 tokens (single-stream decode);
- ``prefill512``, ``prefill2048``: one prompt of that many tokens -> 1 token (prompt tok/s).

With ``--profile DIR``, nothing is timed: each of ``PROFILES`` runs twice under PyTorch's
profiler, once to 1 output token (the prefill) and once to 1 + its decode steps, and the
difference of the two, divided by the steps, is where one decode step's time goes: self CPU time
by operator category, and the wall time outside any operator (Python, scheduling). vLLM's model
runs in its worker process, profiled by vLLM's own profiler (``profiler_config``), which writes
the same operator table; pdserve's compiled kernels are called through ctypes, so they are
wrapped in ``record_function`` here to be seen.

Only the standard library is imported at the top: the system's own package is imported by its
loader, so this file runs in either interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

# name -> (number of prompts, prompt tokens, output tokens)
WORKLOADS = {
    "batch": (64, 128, 128),
    "single": (1, 128, 128),
    "prefill512": (1, 512, 1),
    "prefill2048": (1, 2048, 1),
}
# name -> (number of prompts, prompt tokens, decode steps) for --profile
# (0 decode steps: the prompt's prefill itself, in ms per prompt)
PROFILES = {"single": (1, 128, 32), "batch": (64, 128, 16), "prefill2048": (1, 2048, 0)}
# operator category -> name fragments (lower case), first match wins
CATEGORIES = {
    "GEMMs (linear layers)": ("linear", "addmm", "matmul", "::mm", "gemm", "onednn", "mkldnn"),
    "attention + KV write": ("attention", "attn", "paged", "sdpa", "cache"),
    "norms, rotary, activation": ("norm", "rotary", "silu", "act_and_mul"),
}
VOCAB_RANGE = (100, 49_000)  # ordinary tokens of SmolLM2's 49,152: no special ones

Generate = Callable[[list[list[int]], int], list[list[int]]]  # prompts, max tokens -> outputs


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB_RANGE) for _ in range(length)] for _ in range(num)]


Profiled = Callable[[list[list[int]], int], tuple[float, str]]  # -> wall s, operator table


def load_vllm(model: str, dtype: str, profile_dir: str | None = None) -> Generate | Profiled:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    options: dict[str, Any] = {}
    if profile_dir:
        options["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": profile_dir,
            "torch_profiler_with_stack": False,
            "ignore_frontend": True,
        }
    llm = LLM(model=model, dtype=dtype, max_model_len=2304, seed=0, **options)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def profiled(batch: list[list[int]], max_tokens: int) -> tuple[float, str]:
        from pathlib import Path

        llm.start_profile()
        start = time.perf_counter()
        generate(batch, max_tokens)
        wall = time.perf_counter() - start
        llm.stop_profile()  # the worker writes its table: <dir>/<worker>.profiler_out.txt
        tables = sorted(Path(profile_dir).glob("*profiler_out*.txt"), key=os.path.getmtime)
        return wall, tables[-1].read_text()

    return profiled if profile_dir else generate


def load_pdserve(
    model: str, dtype: str, profile_dir: str | None = None, quantization: str = "none"
) -> Generate | Profiled:
    import torch

    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, quantization=quantization)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]

    def profiled(batch: list[list[int]], max_tokens: int) -> tuple[float, str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            generate(batch, max_tokens)
            wall = time.perf_counter() - start
        return wall, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)

    if profile_dir:
        show_compiled_kernels(llm)
    return profiled if profile_dir else generate


def show_compiled_kernels(llm: Any) -> None:
    """Wrap the ctypes kernels (invisible to the profiler) in ``record_function``. The
    small-batch linear is not wrapped: its GEMMs captured the kernel when the model was built
    (and the fused decode layers call it from C), so its time shows in its callers'."""
    import torch

    def named(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args)

        return wrapper

    backend = llm.engine.runner.attention
    if hasattr(backend, "linear_bf16"):
        for op in ("paged_attention_decode", "add_rms_norm", "rotary_write_kv", "silu_mul"):
            setattr(backend, op, named(f"pdserve::{op}", getattr(backend, op)))


def parse_table(table: str) -> tuple[dict[str, float], float]:
    """A profiler operator table -> (self CPU seconds by operator, self CPU seconds in all)."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

    def seconds(text: str) -> float:
        number = text.rstrip("mus")
        return float(number) * units[text[len(number) :]]

    ops: dict[str, float] = {}
    total = 0.0
    for line in table.splitlines():
        if line.startswith("Self CPU time total:"):
            total = seconds(line.split(":")[1].strip())
        cells = [c for c in line.strip().split("  ") if c.strip()]
        if len(cells) >= 7 and cells[-1].strip().isdigit():
            try:
                ops[cells[0].strip()] = ops.get(cells[0].strip(), 0.0) + seconds(cells[2].strip())
            except (ValueError, KeyError):
                continue
    return ops, total


def categorize(ops: dict[str, float], total: float, wall: float) -> dict[str, float]:
    """Seconds by category; ops beyond the table's top 50 count as "other torch ops"."""
    parts = dict.fromkeys(CATEGORIES, 0.0)
    for name, spent in ops.items():
        lower = name.lower()
        for category, fragments in CATEGORIES.items():
            if any(f in lower for f in fragments):
                parts[category] += spent
                break
    parts["other torch ops"] = total - sum(parts.values())
    parts["outside torch ops (Python, scheduling)"] = wall - total
    parts["step total"] = wall
    return parts


def profile(run: Profiled, seed: int) -> dict[str, dict[str, float]]:
    """Milliseconds per decode step (per prompt for a prefill) by category, for each of
    ``PROFILES``."""
    result = {}
    for name, (num, length, steps) in PROFILES.items():
        # Other prompts each run: a repeated prompt would be a prefix-cache hit, not a prefill.
        run(prompts(num, length, seed + 2), 1 + steps)  # warm-up: first costs of these shapes
        wall, table = run(prompts(num, length, seed), 1)
        prefill = categorize(*parse_table(table), wall)
        if steps == 0:
            result[name] = {k: 1e3 * v for k, v in prefill.items()}
            continue
        wall, table = run(prompts(num, length, seed + 1), 1 + steps)
        both = categorize(*parse_table(table), wall)
        result[name] = {k: 1e3 * (both[k] - prefill[k]) / steps for k in both}
    return result


def measure(generate: Generate, names: list[str], repeats: int, seed: int) -> dict[str, Any]:
    """Seconds of every repeat of each workload, and the batch workload's outputs (of its first
    repeat). Each repeat of each workload sends prompts of its own: repeating one would time
    prefix-cache hits (both systems cache prompts by default), not prefills. (With one seed for
    every workload, the 512-token prompt was the batch's first four prompts end to end, and
    the 2,048-token one began with it: a quarter of each was a cache hit.)"""
    result: dict[str, Any] = {"seconds": {}, "outputs": {}}
    for name in names:
        num, length, max_tokens = WORKLOADS[name]
        generate(prompts(1, length, seed + 99), 2)  # warm-up: first-call costs of this shape
        times = []
        stream = seed + 100_000 * (1 + list(WORKLOADS).index(name))  # no prefix in common
        for repeat in range(repeats):
            batch = prompts(num, length, stream + 1000 * repeat)
            start = time.perf_counter()
            outs = generate(batch, max_tokens)
            times.append(time.perf_counter() - start)
            if any(len(o) != max_tokens for o in outs):  # every token counted was generated
                raise RuntimeError(f"{name}: output lengths {sorted({len(o) for o in outs})}")
            result["outputs"].setdefault(name, outs)
        result["seconds"][name] = times
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["vllm", "pdserve"], required=True)
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", help="profile decode steps instead (see above)")
    p.add_argument("--quantization", default="none", help="pdserve's --quantization (none, int8)")
    args = p.parse_args()
    started = time.perf_counter()
    if args.system == "vllm":
        generate = load_vllm(args.model, args.dtype, args.profile)
    else:
        generate = load_pdserve(args.model, args.dtype, args.profile, args.quantization)
    load_s = time.perf_counter() - started
    if args.profile:
        generate(prompts(2, 16, args.seed + 99), 4)  # warm-up
        result = {"profile_ms_per_step": profile(generate, args.seed)}
    else:
        result = measure(generate, args.workloads.split(","), args.repeats, args.seed)
    result.update(system=args.system, dtype=args.dtype, load_s=load_s)
    result.update(quantization=args.quantization)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import __main__
    sys.exit(main())
