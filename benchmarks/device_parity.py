"""Greedy parity of pdserve against transformers on one torch device, token for token.

The suite checks float32 parity on the CPU; this script is the same check on any device (a GPU,
where the Triton kernels run instead of the CPU ones). Each prompt of ``throughput.py`` is
generated greedily for --tokens tokens by both sides in --dtype on --device: pdserve with all
prompts in one batch, transformers one prompt at a time (no padding). After the run every KV
block must be back in pdserve's pool.

--random-weights DIR builds a randomly initialized copy of the model (its config and tokenizer,
weights drawn by transformers with --seed) in DIR and runs on that: for a machine the weights
cannot travel to. Random weights spread the logits less than trained ones, so near-ties are more
common; in float32 both sides still agree token for token.

    python benchmarks/device_parity.py --device cuda                  # the default model
    python benchmarks/device_parity.py --device cuda --random-weights /tmp/random-smollm2

Exits 1 when a float32 prompt differs or a block leaked.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from throughput import PROMPTS  # benchmarks/throughput.py (this folder is on sys.path)

from services.engine.config import EngineConfig
from services.engine.model.source import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, help="torch device of both sides")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (None: default)")
    parser.add_argument("--random-weights", type=Path, default=None, metavar="DIR")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument(
        "--repeat-prompts",
        type=int,
        default=1,
        metavar="R",
        help="each prompt's tokens R times over: long contexts (a GPU splits their attention)",
    )
    return parser.parse_args(argv)


def make_random_model(source: Path, target: Path, seed: int) -> Path:
    """``source``'s config and tokenizer with weights drawn by transformers (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    return target


def hf_generate(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> list:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=args.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def pdserve_generate(
    model_dir: Path,
    prompts: list[list[int]],
    args: argparse.Namespace,
    device: str,
    **sampling: Any,
) -> list:
    """Token ids of each prompt, all in one batch; greedy unless ``sampling`` says otherwise."""
    from pdserve import LLM, SamplingParams

    blocks = len(prompts) * -(-(max(map(len, prompts)) + args.tokens) // 16) + 16
    llm = LLM(model=str(model_dir), device=device, dtype=args.dtype, num_blocks=blocks)
    params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=args.tokens)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    pool = llm.engine.pool
    pool.check_invariants()
    if pool.num_free_blocks != pool.num_blocks:
        raise SystemExit(f"FAIL: {pool.num_used_blocks} KV blocks leaked")
    return outputs


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model_dir(args.model, EngineConfig().cache_path)
    if args.random_weights is not None:
        model_dir = make_random_model(model_dir, args.random_weights, args.seed)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids * args.repeat_prompts for p in PROMPTS]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    weights = f"random weights, seed {args.seed}" if args.random_weights else "its own weights"
    lengths = f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    print(f"{model_dir.name} ({weights}), {args.dtype} on {where}, {len(prompts)} x {lengths}")
    ours = pdserve_generate(model_dir, prompts, args, args.device, ignore_eos=True)
    theirs = hf_generate(model_dir, prompts, args)
    parted = [first_difference(a, b) for a, b in zip(ours, theirs)]
    equal = sum(p is None for p in parted)
    print(f"greedy: prompts equal to transformers over {args.tokens} tokens: {equal}/{len(ours)}")
    for i, where_parted in enumerate(parted):
        if where_parted is not None:
            print(f"  prompt {i}: parts at token {where_parted}")
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7, "logprobs": 2, "ignore_eos": True}
    first = pdserve_generate(model_dir, prompts, args, args.device, **sampled)
    again = pdserve_generate(model_dir, prompts, args, args.device, **sampled)
    on_cpu = pdserve_generate(model_dir, prompts, args, "cpu", **sampled)
    repeated = first == again
    same_as_cpu = sum(a == b for a, b in zip(first, on_cpu))
    print(
        f"seeded sampling (temperature 0.8, top_p 0.95, logprobs 2): the same twice on "
        f"{args.device}: {repeated}; prompts equal to the CPU engine's: {same_as_cpu}/{len(ours)}"
    )
    print("KV blocks: all back in the pool after every run")
    return 1 if not repeated or (args.dtype == "float32" and equal < len(prompts)) else 0


if __name__ == "__main__":
    sys.exit(main())
