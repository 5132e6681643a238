"""How far ``--quantization int8`` (W8A8) moves the model's outputs, beside bfloat16's own distance.

Sides, all pdserve ``LLM`` on the default model: ``float32`` (the reference: it equals
transformers token for token, tests/test_engine_vs_hf.py), ``bfloat16``, and ``int8`` (int8
weights and activations, everything else in bfloat16: the fast pairing on CPUs with bfloat16 dot
products). What is measured:

* **free-running greedy**: each side generates ``--tokens`` greedy tokens from ``--prompts``
  prompts (``bf16_parity.py``'s set); a side agrees with float32 on a prompt if all its tokens
  are the same. Greedy texts part at the first near-tie and never meet again, so this compounds;
* **same context**: each side's greedy choice at every position of float32's own text (one
  forward pass over prompt + text, ``prompt_logprobs``): the share of positions where it picks
  float32's token, without the compounding;
* **log-likelihood** of reference texts (prose, code, a chat turn, written for this benchmark):
  the mean negative log-likelihood per token and its perplexity under each side.

    python benchmarks/int8_quality.py                 # 64 prompts x 32 tokens, ~2 minutes
    python benchmarks/int8_quality.py --prompts 16 --tokens 16

Prints the command, the machine and a table; writes int8_quality.json to --out-dir (default
benchmarks/results/).
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
from typing import Any

from bf16_parity import PROMPTS, tokens_before_parting
from bf16_parity import parse_args as parity_args
from machine import machine_info  # benchmarks/machine.py (this folder is on sys.path)
from tqdm import tqdm

# side -> (dtype, quantization)
SIDES = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
}
REFERENCE_TEXTS = [
    "The river rises in the hills to the north, where the snow lies late into spring. For most "
    "of the year it is a narrow stream that a child could wade across, but in April the melt "
    "turns it brown and fast, and the old stone bridge at the edge of the town disappears under "
    "the water for a week or two. The people who live along its banks have learned to move "
    "their boats and their animals to higher ground before the first warm rain.",
    "def merge_sorted(left, right):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    merged = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            merged.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            merged.append(right[j])\n"
    "            j += 1\n"
    "    merged.extend(left[i:])\n"
    "    merged.extend(right[j:])\n"
    "    return merged\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\nSunlight is made "
    "of many colours. When it passes through the air, the short blue wavelengths are scattered "
    "by the gas molecules much more strongly than the long red ones, so blue light reaches your "
    "eyes from every part of the sky.<|im_end|>\n",
]


def measure(
    llm: Any, prompts: list[list[int]], tokens: int, reference: list[list[int]] | None
) -> dict[str, Any]:
    """The side's greedy texts, its top choice at each position of ``reference``'s texts (None:
    this side is the reference), and its log-likelihood of the reference texts."""
    from pdserve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    texts = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    judged = reference or texts
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    agree = positions = 0
    for ids, text in zip(prompts, judged):
        logprobs = llm.generate([ids + text], scored)[0].prompt_logprobs or []
        for position, token in enumerate(text):
            candidates = logprobs[len(ids) + position] or {}
            agree += max(candidates, key=candidates.__getitem__) == token
            positions += 1
    tokenizer = llm.get_tokenizer()
    nll = count = 0.0
    for text in REFERENCE_TEXTS:
        ids = tokenizer.encode(text)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        for position, token in enumerate(ids[1:], start=1):
            nll -= out.prompt_logprobs[position][token]
            count += 1
    return {
        "texts": texts,
        "same_context_agree": agree,
        "same_context_positions": positions,
        "mean_nll": nll / count,
        "perplexity": math.exp(nll / count),
    }


def report(result: dict[str, Any]) -> None:
    n, tokens = result["prompts"], result["tokens"]
    print(f"\nagainst float32: {n} prompts x {tokens} greedy tokens; reference texts' likelihood")
    print(
        f"{'side':<9} {'equal prompts':>14} {'median tokens before parting':>29} "
        f"{'same-context agree':>19} {'NLL/token':>10} {'perplexity':>11}"
    )
    for side, row in result["sides"].items():
        equal = f"{row['equal_prompts']} ({100 * row['equal_prompts'] / n:.0f}%)"
        agree = 100 * row["same_context_agree"] / row["same_context_positions"]
        print(
            f"{side:<9} {equal:>14} {row['median_tokens_before_parting']:>29} "
            f"{agree:>18.1f}% {row['mean_nll']:>10.4f} {row['perplexity']:>11.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parity_args(argv, __doc__.splitlines()[0])
    command = "python " + shlex.join(sys.argv)
    machine = machine_info(args.threads)
    print(f"$ {command}")
    print(f"machine: {machine['cpu']}, torch {machine['torch']}, {args.threads} threads")
    from pdserve import LLM

    sides: dict[str, Any] = {}
    reference: list[list[int]] | None = None
    prompts: list[list[int]] = []
    for side, (dtype, quantization) in tqdm(
        SIDES.items(), desc="sides", unit="side", file=sys.stderr
    ):
        llm = LLM(dtype=dtype, quantization=quantization, num_threads=args.threads)
        prompts = prompts or [llm.get_tokenizer().encode(p) for p in PROMPTS[: args.prompts]]
        row = measure(llm, prompts, args.tokens, reference)
        reference = reference or row["texts"]
        parted = [tokens_before_parting(a, b) for a, b in zip(reference, row["texts"])]
        row["equal_prompts"] = sum(p == args.tokens for p in parted)
        row["median_tokens_before_parting"] = statistics.median(parted)
        sides[side] = row
    result = {
        "command": command,
        "machine": machine,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "sides": sides,
    }
    report(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "int8_quality.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out_dir / 'int8_quality.json'}")


if __name__ == "__main__":
    main()
