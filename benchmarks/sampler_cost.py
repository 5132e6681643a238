"""What sampling costs per decode step: the engine's ``Sampler`` (with the compiled kernels,
where they build) on a batch of logits, greedy, at temperature 1, and with top_p 0.9 or top_k
50 besides; and beside them what they replaced: the exponential race (argmax of p / Exp(1)) with
its noise from ``exponential_`` per row, then from ``torch.rand`` (-log U) per row, and the top-p
filter over a full sort of each row (``reference.filter_floors``). The race now hashes its noise
in one compiled pass and the filters find each row's floor without a sort
(``kernels/csrc/sampling_cpu.c``). "T=1 reference" is the sampler on the PyTorch reference of
those kernels (where no C compiler builds them). The last two columns are the ratios of the
torch.rand race to the T=1 draw and of the sorted top-p filter to the whole top_p 0.9 draw.

    python benchmarks/sampler_cost.py [--rows 1,16,96] [--vocab 49152] [--repeats 7]

Prints the median ms per step of each, on the default model's own next-token logits (bfloat16,
SmolLM2's 49,152 tokens) after prefixes of this repository's README: random logits are far
flatter than a model's, and the filters' cost depends on how many tokens a nucleus holds. At
torch's thread count; about a minute.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_name, median_seconds  # noqa: E402  (benchmarks/, on sys.path)

from common.sampling_params import SamplingParams  # noqa: E402
from kernels import cpu_ops, reference  # noqa: E402
from services.engine.config import DEFAULT_CACHE_DIR  # noqa: E402
from services.engine.sampler import Sampler  # noqa: E402
from services.engine.sequence import Sequence  # noqa: E402


def exponential_race(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The draw before: softmax, an Exp(1) per entry from ``exponential_``, row by row, then the
    argmax of p / noise."""
    probs = torch.softmax(logits.float(), dim=-1)
    noise = torch.empty_like(probs)
    for i in range(probs.shape[0]):
        noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def rand_race(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The draw before the compiled race: softmax, -log U from ``torch.rand`` per row, then the
    argmax of p / noise."""
    probs = torch.softmax(logits.float(), dim=-1)
    noise = torch.empty_like(probs)
    for i in range(probs.shape[0]):
        torch.rand(noise.shape[1], generator=generator, out=noise[i])
    return (probs / noise.log_().neg_()).argmax(dim=-1)


def model_logits(rows: int) -> torch.Tensor:
    """The default model's bfloat16 logits of the next token after ``rows`` prefixes (8-64
    tokens) of the README, through transformers."""
    from peer_vllm import model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    ids = tokenizer((ROOT / "README.md").read_text())["input_ids"]
    out = []
    for i in range(rows):
        prefix = ids[i * 7 : i * 7 + 8 + i % 57]
        out.append(model(torch.tensor([prefix])).logits[0, -1])
    return torch.stack(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,96", help="sequences in the decode step")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("$ python benchmarks/sampler_cost.py " + " ".join(sys.argv[1:]))
    print(f"machine: {cpu_name()}")
    print(f"torch threads {torch.get_num_threads()}, the default model's bfloat16 logits")
    columns = ("greedy", "T=1", "T=1 top_p 0.9", "T=1 top_k 50")
    columns += ("exponential_", "torch.rand race", "sorted top_p", "T=1 reference")
    print(
        f"{'rows':>5}"
        + "".join(f" {c + ' ms':>16}" for c in columns)
        + "  rand race / T=1  sorted / top_p"
    )
    kernels = cpu_ops.load(DEFAULT_CACHE_DIR / "kernels")
    if kernels is None:
        print("the compiled kernels did not build: the sampler's PyTorch reference")
        sampler = Sampler()
    else:
        sampler = Sampler(
            argmax=kernels.argmax_rows, race=kernels.race_rows, floors=kernels.filter_floors
        )
    generator = torch.Generator().manual_seed(0)
    row_counts = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        all_logits = model_logits(max(row_counts))
        for rows in row_counts:
            logits = all_logits[:rows].contiguous()
            batches = [
                [Sequence(i, "r", [1, 2], SamplingParams(**kw)) for i in range(rows)]
                for kw in (
                    {"temperature": 0},
                    {"temperature": 1},
                    {"temperature": 1, "top_p": 0.9},
                    {"temperature": 1, "top_k": 50},
                )
            ]
            wide = logits.float()
            sorted_top_p = (torch.ones(rows), torch.zeros(rows), torch.full((rows,), 0.9))
            sorted_top_p += (torch.zeros(rows),)
            calls = [partial(sampler, logits, batch) for batch in batches] + [
                partial(exponential_race, logits, generator),
                partial(rand_race, logits, generator),
                partial(reference.filter_floors, wide, *sorted_top_p),
                partial(Sampler(), logits, batches[1]),  # the fallback without the kernels
            ]
            cells = [median_seconds(call, args.repeats) * 1e3 for call in calls]
            ratios = f"  {cells[5] / cells[1]:>15.1f}x  {cells[6] / cells[2]:>13.1f}x"
            print(f"{rows:>5}" + "".join(f" {c:>16.2f}" for c in cells) + ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
