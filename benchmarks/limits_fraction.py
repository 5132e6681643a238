"""How close the engine comes to this machine's limits, both measured in one run (issue #33's
second bar: single stream >= 85% of the bandwidth limit, 64 sequences >= 70% of the M=64 GEMM
limit, prefill at 2,048 tokens >= 70% of the GEMM limit with attention's flops counted).

The limits are ``machine_limits.py``'s, measured here before and after the engine (the best of
the two runs: a VM's memory bandwidth drifts, and the higher limit is the stricter bar):

- single stream: the weights' read bandwidth / the bytes a token reads (the layers' and the LM
  head's weights in the model's dtype, once);
- 64 sequences: the best GEMM path's GFLOP/s at M=64 on the model's four layer shapes, over the
  flops of a token (2 x the parameters of the layers and the LM head);
- prefill: the best GEMM path at M=2048, against the prompt's flops: 2 x the layers'
  parameters per token, the LM head once (the engine computes the last token's logits only),
  and causal attention (QK^T and PV over the lower triangle: 2 x T^2 x heads x head_dim per
  layer).

The engine, the default model in ``--dtype`` (prefix caching off, greedy, ``ignore_eos``):
decoding alone, the median ``LLMEngine.step`` over ``--steps`` steps after every prompt (128
tokens) is computed, at 1 and 64 sequences; and the median over ``--repeats`` of one step that
computes a whole 2,048-token prompt.

    python benchmarks/limits_fraction.py [--dtype bfloat16] [--steps 30] [--repeats 3]

Prints the command, the machine and the table; writes limits_fraction.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from machine import (
    describe_read_scaling,
    machine_info,
    placement_changed,
    read_scaling,
)  # benchmarks/machine.py (on sys.path)
from machine_limits import (
    DTYPES,
    HEAD_PARAMS,
    KINDS,
    LAYER_PARAMS,
    LAYERS,
    SHAPES,
    gemm_gflops,
    kernel_read_gib_s,
    read_gib_s,
)
from tqdm import tqdm

from kernels import cpu_ops
from services.engine.config import DEFAULT_CACHE_DIR, default_num_threads
from services.engine.model.packed_linear import native_matmul

CONTEXT, PREFILL_TOKENS, BLOCK_SIZE = 128, 2048, 16
Q_SIZE = SHAPES[1][0]  # heads x head_dim (576)
BARS = {"single stream": 0.85, "64 sequences": 0.70, f"prefill {PREFILL_TOKENS}": 0.70}


def prefill_flops(tokens: int) -> float:
    attention = LAYERS * 2 * tokens * tokens * Q_SIZE  # causal: half of 4 T^2 d per layer
    return 2 * LAYER_PARAMS * tokens + 2 * HEAD_PARAMS + attention


def workload_ceiling(
    limits: dict[str, float], num: int, prompt_len: int, out_len: int, prompt_rate: bool
) -> float:
    """The most tokens a second any engine could give for ``num`` prompts of ``prompt_len``
    tokens -> ``out_len`` tokens on this machine (``measure_limits``'s): the prompts' flops at
    the best GEMM rate measured at 512 rows or more, then every later token's weights read at
    the read bandwidth (one sequence) or its flops at the M=64 GEMM rate (more). Nothing else is
    counted (no decode attention, sampling, or step overhead), so no run of the machine's GEMM
    paths can beat it. Prompt tokens per second with ``prompt_rate``, else output tokens."""
    prompt_gflops = max(rate for key, rate in limits.items() if _gemm_rows(key) >= 512)
    seconds = num * prefill_flops(prompt_len) / (prompt_gflops * 1e9)
    later = num * (out_len - 1)
    if num == 1:
        seconds += later * limits["weight_bytes"] / (limits["read_gib_s"] * 2**30)
    else:
        seconds += later * 2 * (LAYER_PARAMS + HEAD_PARAMS) / (limits["gemm_gflops_m64"] * 1e9)
    return num * (prompt_len if prompt_rate else out_len) / seconds


def _gemm_rows(key: str) -> int:
    return int(key.removeprefix("gemm_gflops_m")) if key.startswith("gemm_gflops_m") else 0


def measure_limits(
    dtype: torch.dtype, kernels: Any, repeats: int, rows: tuple[int, ...] = (64, PREFILL_TOKENS)
) -> dict[str, float]:
    """Read bandwidth over the weights' bytes, the best GEMM GFLOP/s at each of ``rows``."""
    weight_bytes = torch.empty(0, dtype=dtype).element_size() * (LAYER_PARAMS + HEAD_PARAMS)
    summed = read_gib_s(weight_bytes, repeats)
    limits = {"read_gib_s": max(summed, kernel_read_gib_s(weight_bytes, kernels, repeats) or 0.0)}
    for m in rows:
        rates = [
            gemm_gflops(m, DTYPES[kind_dtype], [path] * len(SHAPES), kernels, repeats)
            for kind_dtype, path in KINDS.values()
        ]
        limits[f"gemm_gflops_m{m}"] = max(r for r in rates if r is not None)
    limits["weight_bytes"] = weight_bytes
    return limits


def new_engine(dtype: str, max_num_seqs: int) -> Any:
    from pdserve import LLM

    llm = LLM(
        dtype=dtype,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=PREFILL_TOKENS,
        max_model_len=PREFILL_TOKENS + 64,
        num_threads=default_num_threads(),
    )
    return llm.engine


def decode_tok_s(engine: Any, batch: int, steps: int) -> float:
    """Tokens/s of decode steps of ``batch`` sequences (each prompt computed first)."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):  # distinct prompts: no sharing even with a prefix cache
        prompt = [(i * 7919 + t * 104729) % (vocab - 100) + 50 for t in range(CONTEXT)]
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"decode-{batch}-{i}")
    return batch / statistics.median(times)


def prefill_seconds(engine: Any, repeats: int) -> float:
    """Median time of the one step that computes a whole PREFILL_TOKENS-token prompt."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    vocab = engine.model_config.vocab_size
    times = []
    for r in range(repeats + 1):  # the first one warms up
        prompt = [(r * 31 + t * 7919) % (vocab - 100) + 50 for t in range(PREFILL_TOKENS)]
        engine.add_request(f"prefill-{r}", prompt, params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
    return statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills; limit repeats x2")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    threads = default_num_threads()
    torch.set_num_threads(threads)
    machine = machine_info(threads, True, avx512_bf16=native_matmul(torch.bfloat16))
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {threads} threads, bf16 dot products: {machine['avx512_bf16']}"
    )
    print(describe_read_scaling(machine["read_scaling"]))
    kernels = cpu_ops.load(DEFAULT_CACHE_DIR / "kernels")
    dtype = DTYPES[args.dtype]
    with tqdm(total=5, desc="measuring", file=sys.stderr) as bar:
        before = measure_limits(dtype, kernels, 2 * args.repeats)
        bar.update(1)
        engine = new_engine(args.dtype, 64)
        single = decode_tok_s(engine, 1, args.steps)
        bar.update(1)
        batch64 = decode_tok_s(engine, 64, args.steps)
        bar.update(1)
        prefill_s = prefill_seconds(engine, args.repeats)
        bar.update(1)
        after = measure_limits(dtype, kernels, 2 * args.repeats)
        bar.update(1)
    scaling_after = read_scaling()
    print(describe_read_scaling(scaling_after) + " (after the engine)")
    if placement_changed(machine["read_scaling"], scaling_after):
        print(
            "WARNING: the host moved this VM's cores during the run (what the other cores add "
            "changed by more than half): limits and engine figures may come from different "
            "placements (docs/benchmarks.md, 'The VM's two cores are sometimes one')"
        )
    best = {key: max(before[key], after[key]) for key in before}
    flops_per_token = 2 * (LAYER_PARAMS + HEAD_PARAMS)
    limits = {
        "single stream": best["read_gib_s"] * 2**30 / best["weight_bytes"],
        "64 sequences": best["gemm_gflops_m64"] * 1e9 / flops_per_token,
        f"prefill {PREFILL_TOKENS}": best[f"gemm_gflops_m{PREFILL_TOKENS}"],
    }
    engine_rates = {
        "single stream": single,
        "64 sequences": batch64,
        f"prefill {PREFILL_TOKENS}": prefill_flops(PREFILL_TOKENS) / prefill_s / 1e9,
    }
    units = {
        "single stream": "tok/s",
        "64 sequences": "tok/s",
        f"prefill {PREFILL_TOKENS}": "GFLOP/s",
    }
    print(
        f"\nlimits, before / after the engine: read {before['read_gib_s']:.1f} / "
        f"{after['read_gib_s']:.1f} GiB/s; GEMM M=64 {before['gemm_gflops_m64']:.0f} / "
        f"{after['gemm_gflops_m64']:.0f} GFLOP/s; M={PREFILL_TOKENS} "
        f"{before[f'gemm_gflops_m{PREFILL_TOKENS}']:.0f} / "
        f"{after[f'gemm_gflops_m{PREFILL_TOKENS}']:.0f} GFLOP/s (the higher is the limit)"
    )
    print(
        f"\n{'workload (' + args.dtype + ')':<26}{'engine':>12}{'limit':>12}"
        f"{'fraction':>10}{'bar':>6}"
    )
    rows = {}
    for name, limit in limits.items():
        fraction = engine_rates[name] / limit
        rows[name] = {
            "engine": engine_rates[name],
            "limit": limit,
            "unit": units[name],
            "fraction": fraction,
        }
        print(
            f"{name:<26}{engine_rates[name]:>12.1f}{limit:>12.1f}{fraction:>9.0%}{BARS[name]:>6.0%}"
            f"  {units[name]}"
        )
    print(
        f"(prefill: {prefill_s * 1e3:.0f} ms for {PREFILL_TOKENS} tokens, "
        "attention's flops counted)"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "limits_fraction.json"
    data = {"command": command, "machine": machine, "dtype": args.dtype, "limits_before": before}
    data |= {"limits_after": after, "rows": rows, "prefill_seconds": prefill_s}
    data["read_scaling_after"] = scaling_after
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
