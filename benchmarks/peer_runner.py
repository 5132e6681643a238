"""One system's side of ``benchmarks/peer_vllm.py``'s offline comparison, run in that system's
own interpreter (vLLM's peer venv, or ours): load the model once, time each workload a few
times, print one JSON line.

Workloads (greedy, ``ignore_eos``, the same random token-id prompts on both sides):

- ``batch``: 64 prompts of 128 tokens -> 128 tokens each, all submitted at once;
- ``single``: one prompt of 128 tokens -> 128 tokens (single-stream decode);
- ``prefill512``, ``prefill2048``: one prompt of that many tokens -> 1 token (prompt tok/s).

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
VOCAB_RANGE = (100, 49_000)  # ordinary tokens of SmolLM2's 49,152: no special ones

Generate = Callable[[list[list[int]], int], list[list[int]]]  # prompts, max tokens -> outputs


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB_RANGE) for _ in range(length)] for _ in range(num)]


def load_vllm(model: str, dtype: str) -> Generate:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=2304, seed=0)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_pdserve(model: str, dtype: str) -> Generate:
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]

    return generate


def measure(generate: Generate, names: list[str], repeats: int, seed: int) -> dict[str, Any]:
    """Seconds of every repeat of each workload, and the batch workload's outputs."""
    generate(prompts(2, 16, seed + 99), 4)  # warm-up: first-call costs are not measured
    result: dict[str, Any] = {"seconds": {}, "outputs": {}}
    for name in names:
        num, length, max_tokens = WORKLOADS[name]
        batch = prompts(num, length, seed)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            outs = generate(batch, max_tokens)
            times.append(time.perf_counter() - start)
            if any(len(o) != max_tokens for o in outs):  # every token counted was generated
                raise RuntimeError(f"{name}: output lengths {sorted({len(o) for o in outs})}")
        result["seconds"][name] = times
        result["outputs"][name] = outs
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=["vllm", "pdserve"], required=True)
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    load = load_vllm if args.system == "vllm" else load_pdserve
    started = time.perf_counter()
    generate = load(args.model, args.dtype)
    load_s = time.perf_counter() - started
    result = measure(generate, args.workloads.split(","), args.repeats, args.seed)
    result.update(system=args.system, dtype=args.dtype, load_s=load_s)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import __main__
    sys.exit(main())
