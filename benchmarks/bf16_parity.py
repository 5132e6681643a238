"""bfloat16 greedy parity: pdserve against transformers, and transformers against itself.

Two bfloat16 implementations of one model round at different points (GEMM accumulation order,
attention math, where the norms round), so their logits differ by bfloat16 rounding. Greedy
decoding follows the same tokens until the top two candidates are within that rounding of each
other; from there the two texts part and never meet again. How often that happens within a few
dozen tokens is a property of the model and the prompts, not of one implementation: the baseline
here is transformers' own two attention implementations (``sdpa``, its default, and ``eager``),
which differ only in the attention math.

What is measured, on --prompts prompts (``throughput.py``'s 18 and 46 more below)
with --tokens greedy tokens each:

* free-running: each side generates on its own; a pair is equal on a prompt if all tokens are.
  The share of prompts still equal after t tokens is plotted per pair.
* same context: for every position of side A's output, side B's greedy choice given A's own
  prefix (one forward pass of B over the prompt and A's tokens). This counts disagreements
  without the compounding: a parting early in free-running counts once, not for every token
  after it. Where they disagree, the float32 model's margin between the two tokens says how
  near a tie it was.

Sides: transformers float32 (``hf32``), transformers bfloat16 with ``sdpa`` (``hf16``) and with
``eager`` attention (``hf16eager``), pdserve ``LLM(dtype="bfloat16")`` with its defaults
(``pdserve16``, all prompts in one batch).

    python benchmarks/bf16_parity.py                     # 64 prompts x 32 tokens, ~4 minutes
    python benchmarks/bf16_parity.py --prompts 16 --tokens 16

Prints the command, the machine and two tables; writes bf16_parity.json and bf16_parity.png to
--out-dir (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from machine import machine_info  # benchmarks/machine.py (this folder is on sys.path)
from throughput import PROMPTS as THROUGHPUT_PROMPTS
from throughput import load_hf
from tqdm import tqdm

from services.engine.config import default_num_threads

MORE_PROMPTS = [
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef softmax(x):",
    "My favourite book is",
    "<|im_start|>user\nHow do I boil an egg?<|im_end|>\n<|im_start|>assistant\n",
    "The largest planet in the solar system is",
    "A haiku about the sea:\n",
    "To reverse a list in Python, you can",
    "The French Revolution began in",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "Dear hiring manager,\n",
    "The quick brown fox",
    "git commit -m",
    "The speed of light in a vacuum is",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius because",
    "fn main() {\n    let",
    "The best way to learn a new language is",
    "In machine learning, overfitting means",
    "Tomorrow's weather forecast:",
    "<|im_start|>user\nTell me a joke about cats.<|im_end|>\n<|im_start|>assistant\n",
    "The human heart has four chambers:",
    "Shakespeare wrote",
    "#include <stdio.h>\n\nint main(void) {",
    "The Great Wall of China",
    "Step 1: preheat the oven to",
    "<|im_start|>user\nExplain gravity to a child.<|im_end|>\n<|im_start|>assistant\n",
    "A prime number is",
    "The stock market fell today after",
    "Rain, rain, go away,",
    "Mount Everest is located",
    "<|im_start|>user\nWrite a sentence using the word 'river'.<|im_end|>\n<|im_start|>assistant\n",
    "The mitochondria is",
    "for i in range(10):",
    "Electric cars are becoming popular because",
    "The moon orbits the Earth every",
    "Good morning! Today we will talk about",
    "The recipe calls for two cups of flour and",
    "The capital of France is",
    "Once upon a time,",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "List three primary colors:",
    "The derivative of x^2 is",
    "class Stack:\n    def __init__(self):",
    "The Eiffel Tower is",
    "Paged attention stores the KV cache in fixed-size blocks so that",
]
PROMPTS = [*THROUGHPUT_PROMPTS, *MORE_PROMPTS]
NAMES = {
    "hf32": "transformers fp32",
    "hf16": "transformers bf16",
    "hf16eager": "transformers bf16 (eager attention)",
    "pdserve16": "pdserve bf16",
}
PAIRS = [("hf16", "hf16eager"), ("hf16", "pdserve16"), ("hf32", "hf16"), ("hf32", "pdserve16")]


def parse_args(
    argv: list[str] | None = None, description: str = __doc__.splitlines()[0]
) -> argparse.Namespace:
    """--prompts, --tokens, --threads, --out-dir (int8_quality.py takes the same)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=default_num_threads(), help="torch threads")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    if args.tokens < 1 or args.threads < 1:
        parser.error("--tokens and --threads must be >= 1")
    return args


def hf_side(model: Any, dtype: torch.dtype, attention: str) -> Any:
    """A copy of the float32 model in ``dtype`` with ``attention`` as its implementation."""
    side = copy.deepcopy(model).to(dtype)
    side.set_attn_implementation(attention)
    return side


def hf_generate(model: Any, prompts: list[list[int]], tokens: int, name: str) -> list[list[int]]:
    out = []
    for ids in tqdm(prompts, desc=f"generate {name}", unit="prompt", file=sys.stderr):
        x = torch.tensor([ids])
        with torch.inference_mode():
            generated = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=tokens,
                do_sample=False,
                min_new_tokens=tokens,
                pad_token_id=0,
            )
        out.append(generated[0, len(ids) :].tolist())
    return out


def pdserve_generate(prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    from pdserve import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", num_threads=threads, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs]


def greedy_on(model: Any, ids: list[int], continuation: list[int]) -> tuple[list[int], Any]:
    """``model``'s greedy choice at each position of ``continuation`` given the prompt ``ids``
    and the continuation before it, and the logits there."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids + continuation])).logits[0, len(ids) - 1 : -1].float()
    return logits.argmax(-1).tolist(), logits


def tokens_before_parting(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def free_running(outs: dict[str, list[list[int]]], tokens: int) -> dict[str, Any]:
    rows = {}
    for a, b in PAIRS:
        parted = [tokens_before_parting(x, y) for x, y in zip(outs[a], outs[b])]
        rows[f"{a}~{b}"] = {
            "equal_prompts": sum(p == tokens for p in parted),
            "median_tokens_before_parting": statistics.median(parted),
            "still_equal_after": [sum(p >= t for p in parted) for t in range(tokens + 1)],
        }
    return rows


def same_context(
    prompts: list[list[int]], outs: dict[str, list[list[int]]], models: dict[str, Any]
) -> dict[str, Any]:
    """Side B's greedy choices on side A's free-running text, per pair (A generated, B judges);
    disagreements with the float32 model's margin between the two tokens."""
    rows: dict[str, Any] = {}
    judged = [("pdserve16", "hf16"), ("hf16eager", "hf16"), ("hf16", "hf16")]
    for a, b in tqdm(judged, desc="same context", unit="pair", file=sys.stderr):
        margins = []
        positions = 0
        for ids, text in zip(prompts, outs[a]):
            choice, _ = greedy_on(models[b], ids, text)
            positions += len(text)
            for i, (mine, theirs) in enumerate(zip(text, choice)):
                if mine != theirs:
                    _, f32 = greedy_on(models["hf32"], ids, text[: i + 1])
                    margins.append(abs(float(f32[i, mine] - f32[i, theirs])))
        rows[f"{b} on {a}'s text"] = {
            "positions": positions,
            "disagreements": len(margins),
            "max_float32_margin": max(margins, default=0.0),
            "median_float32_margin": statistics.median(margins) if margins else 0.0,
        }
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    n = result["prompts"]
    for pair, row in result["free_running"].items():
        share = [100 * k / n for k in row["still_equal_after"]]
        a, b = pair.split("~")
        ax.step(range(len(share)), share, where="post", label=f"{NAMES[a]} vs {NAMES[b]}")
    ax.set_xlabel("greedy tokens generated")
    ax.set_ylabel("prompts still equal (%)")
    ax.set_ylim(0, 102)
    ax.set_title(f"bfloat16 greedy parity, {n} prompts")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(result: dict[str, Any]) -> None:
    n, tokens = result["prompts"], result["tokens"]
    print(f"\nfree-running, {n} prompts x {tokens} tokens")
    print(f"{'pair':<24} {'equal prompts':>14} {'median tokens before parting':>30}")
    for pair, row in result["free_running"].items():
        equal = f"{row['equal_prompts']} ({100 * row['equal_prompts'] / n:.0f}%)"
        print(
            f"{pair.replace('~', ' vs '):<24} {equal:>14} {row['median_tokens_before_parting']:>30}"
        )
    print("\nsame context (B's greedy choice on A's text), float32 margins where they disagree")
    print(f"{'B on A':<28} {'positions':>9} {'disagree':>9} {'median margin':>14} {'max':>6}")
    for name, row in result["same_context"].items():
        print(
            f"{name:<28} {row['positions']:>9} {row['disagreements']:>9} "
            f"{row['median_float32_margin']:>14.3f} {row['max_float32_margin']:>6.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python " + shlex.join(sys.argv)
    machine = machine_info(args.threads)
    print(
        f"$ {command}\nmachine: {machine['cpu']}, torch {machine['torch']}, {args.threads} threads"
    )
    tokenizer, hf32 = load_hf(None)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[: args.prompts]]
    models = {
        "hf32": hf32,
        "hf16": hf_side(hf32, torch.bfloat16, "sdpa"),
        "hf16eager": hf_side(hf32, torch.bfloat16, "eager"),
    }
    outs = {name: hf_generate(m, prompts, args.tokens, name) for name, m in models.items()}
    outs["pdserve16"] = pdserve_generate(prompts, args.tokens, args.threads)
    result = {
        "command": command,
        "machine": machine,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "free_running": free_running(outs, args.tokens),
        "same_context": same_context(prompts, outs, models),
    }
    report(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bf16_parity.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out_dir / "bf16_parity.png")
    print(f"\nwrote {args.out_dir / 'bf16_parity.json'} and {args.out_dir / 'bf16_parity.png'}")


if __name__ == "__main__":
    main()
