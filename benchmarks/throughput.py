"""Offline throughput: pdserve (continuous batching) vs transformers ``generate`` (static batching).

What is measured: output tokens per second of the same model (default SmolLM2-135M-Instruct, the
same GGUF file loaded by each side, float32 unless --dtype, on the CPU unless --device) on the
same prompts with the same per-request output lengths, at several numbers of concurrent requests
N, in one process with the same torch thread count.

* Prompts: varied short prompts (about 10-60 tokens) from a fixed list, cycled; tokenized once
  and given to both sides as the same token ids.
* Output lengths: one list of per-request lengths, uniform in [--min-out, --max-out], drawn with
  --seed; a run with N requests uses its first N entries. Both sides generate exactly that many
  tokens per request (pdserve: ``ignore_eos=True``; transformers: EOS suppressed by
  ``min_new_tokens``).
* pdserve: all N requests are submitted at once to one ``LLM`` (max_num_seqs >= N), each with its
  own ``SamplingParams(temperature=0, max_tokens=L_i, ignore_eos=True)``; the whole ``generate``
  is timed; output tokens = sum(L_i). Prefix caching is off by default, so the cycled prompts
  and the repeats do not skip prefill (``--prefix-caching`` turns it on).
* transformers: the N requests are one static batch (left padding, attention mask, pad token),
  ``generate(max_new_tokens=max(L_i), min_new_tokens=max(L_i), do_sample=False)``: the batch runs
  until its longest request is done. Useful tokens = sum(L_i) (the headline number); the raw
  tokens it computed, N * max(L_i), are reported too.
* Both sides are warmed up with a tiny run (2 tokens per request) at every N; each measurement
  is repeated --repeats times (the two sides alternating) and the median time is reported.

Run (the full benchmark takes several minutes on a few cores):

    python benchmarks/throughput.py                        # N = 1, 8, 32, 64; 16..256 tokens
    python benchmarks/throughput.py --batch-sizes 1,4 --min-out 4 --max-out 12 --repeats 1
    python benchmarks/throughput.py --device cuda --dtype bfloat16   # on a GPU

Prints the command line, the machine and a table; writes throughput.json and throughput.png to
--out-dir (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from machine import describe_read_scaling  # benchmarks/machine.py (this folder is on sys.path)
from machine import machine_info as shared_machine_info
from tqdm import tqdm

from services.engine.config import default_num_threads

PROMPTS = [
    "Answer with a single word and nothing else. Question: the capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "List three primary colors and explain why they are called primary:",
    "The derivative of x^2 is 2x. The derivative of sin(x) is",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Paged attention stores the KV cache in fixed-size blocks so that memory is not wasted on "
    "padding, and sequences of very different lengths can share one pool. The main benefit is",
    "Write a short poem about the autumn rain falling on a quiet city street at night.",
    "Q: Why is the sky blue during the day but red and orange at sunset?\nA:",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nGive me "
    "three tips for writing clean Python code.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the Apollo 11 mission",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "The main differences between TCP and UDP are the following. First, TCP is connection "
    "oriented, which means that before any data is exchanged the two hosts must",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY",
    "Summarize the plot of Romeo and Juliet in two sentences:",
    "<|im_start|>user\nI am planning a three day trip to Kyoto in late November. I like old "
    "temples, quiet gardens and good vegetarian food, but I do not like crowds. Could you "
    "suggest a plan for each day?<|im_end|>\n<|im_start|>assistant\n",
    "Continuous batching lets a server add new requests to the running batch at every decoding "
    "step and remove finished ones right away, instead of waiting for the whole batch. In "
    "contrast, static batching",
]


@dataclass
class Point:
    """Results for one number of concurrent requests."""

    n: int
    output_lens: list[int]
    useful_tokens: int
    hf_raw_tokens: int
    pdserve_times: list[float] = field(default_factory=list)
    hf_times: list[float] = field(default_factory=list)

    @property
    def pdserve_tps(self) -> float:
        return self.useful_tokens / statistics.median(self.pdserve_times)

    @property
    def hf_tps(self) -> float:
        return self.useful_tokens / statistics.median(self.hf_times)

    @property
    def hf_raw_tps(self) -> float:
        return self.hf_raw_tokens / statistics.median(self.hf_times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--batch-sizes",
        default="1,8,32,64",
        help="numbers of concurrent requests N, comma-separated",
    )
    parser.add_argument("--min-out", type=int, default=16, help="shortest output (tokens)")
    parser.add_argument("--max-out", type=int, default=256, help="longest output (tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the output lengths")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_num_threads(),
        help="torch threads for both sides; all usable cores unless set",
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (None: SmolLM2-135M-Instruct GGUF)"
    )
    parser.add_argument("--device", default="cpu", help="torch device of both sides: cpu, cuda")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations of both sides",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="let pdserve reuse cached prompt blocks (off: fair to transformers)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results"),
        help="where throughput.json and throughput.png go",
    )
    args = parser.parse_args(argv)
    args.batch_sizes = sorted({int(n) for n in args.batch_sizes.split(",") if n.strip()})
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        parser.error("--batch-sizes must be positive integers")
    if not 1 <= args.min_out <= args.max_out:
        parser.error("need 1 <= --min-out <= --max-out")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    return args


def machine_info(threads: int, device: str) -> dict[str, Any]:
    import transformers

    extra: dict[str, Any] = {"transformers": transformers.__version__}
    if device.startswith("cuda"):
        extra["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return shared_machine_info(threads, probe_cores=True, **extra)


def print_header(args: argparse.Namespace, machine: dict[str, Any]) -> str:
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} "
        f"usable, load avg {machine['load_avg_1m_at_start']}), torch {machine['torch']} "
        f"({machine['torch_threads']} threads), "
        f"transformers {machine['transformers']}, python {machine['python']}"
        + (f", GPU {machine['gpu']}" if "gpu" in machine else "")
    )
    print(describe_read_scaling(machine["read_scaling"]))
    print(
        f"model: {args.model or 'SmolLM2-135M-Instruct (default GGUF)'}, {args.dtype} on "
        f"{args.device}, greedy; "
        f"output lengths uniform in [{args.min_out}, {args.max_out}] (seed {args.seed}); "
        f"median of {args.repeats}; pdserve prefix caching "
        f"{'on' if args.prefix_caching else 'off'}"
    )
    return command


def draw_output_lens(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def load_hf(model: str | None, device: str, dtype: str) -> tuple[Any, Any]:
    """transformers' tokenizer and model for the same weights pdserve loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine.model.source import default_model_path

    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file():  # a GGUF file: transformers dequantizes it itself
        where, kwargs = str(path.parent), {"gguf_file": path.name}
    else:
        where, kwargs = str(path), {}
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **kwargs)
    return tokenizer, hf_model.to(device).eval()


def load_pdserve(args: argparse.Namespace, prompt_lens: list[int]) -> Any:
    """One LLM for every N: room for max(N) sequences of the longest prompt plus output."""
    from pdserve import LLM

    block = 16
    n_max = args.batch_sizes[-1]
    blocks_per_seq = -(-(max(prompt_lens) + args.max_out + 1) // block)
    return LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=block,
        num_blocks=n_max * blocks_per_seq + 16,
        enable_prefix_caching=args.prefix_caching,
        max_num_seqs=max(n_max, 1),
        num_threads=args.threads,
    )


def run_pdserve(llm: Any, prompts: list[list[int]], lens: list[int]) -> float:
    """Seconds for one ``generate`` of all requests at once; checks every output length."""
    from pdserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    gc.collect()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outputs]
    if got != lens:
        raise RuntimeError(f"pdserve generated {got} tokens, expected {lens}")
    return elapsed


def pad_left(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_hf(hf_model: Any, pad_id: int, prompts: list[list[int]], lens: list[int]) -> float:
    """Seconds for one static-batch ``generate`` that runs until the longest request is done."""
    ids, mask = (t.to(hf_model.device) for t in pad_left(prompts, pad_id))
    steps = max(lens)
    gc.collect()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad_id,
        ).cpu()  # waits for the device, as pdserve's outputs (token ids on the host) do
    elapsed = time.perf_counter() - start
    if out.shape != (len(prompts), ids.shape[1] + steps):
        raise RuntimeError(
            f"transformers returned shape {tuple(out.shape)}, expected "
            f"{(len(prompts), ids.shape[1] + steps)}"
        )
    return elapsed


def measure(
    points: list[Point],
    prompts: list[list[int]],
    runners: dict[str, Callable[[list[list[int]], list[int]], float]],
    repeats: int,
) -> None:
    """Fill each point's times; the two sides alternate so drifting load hits both alike."""
    total = len(points) * repeats * len(runners)
    with tqdm(total=total, desc="measuring", unit="run", file=sys.stderr) as bar:
        for point in points:
            batch = [prompts[i % len(prompts)] for i in range(point.n)]
            for rep in range(repeats):
                for name, run in runners.items():
                    bar.set_postfix_str(f"N={point.n} {name} {rep + 1}/{repeats}")
                    elapsed = run(batch, point.output_lens)
                    times = point.pdserve_times if name == "pdserve" else point.hf_times
                    times.append(elapsed)
                    bar.update(1)


def print_table(points: list[Point]) -> None:
    base = points[0]
    print()
    print(
        f"{'N':>4} {'out tok':>8} {'pdserve tok/s':>14} {'HF tok/s':>9} {'ratio':>6} "
        f"{'HF raw tok/s':>13} {f'pdserve vs N={base.n}':>17}"
    )
    for p in points:
        print(
            f"{p.n:>4} {p.useful_tokens:>8} {p.pdserve_tps:>14.1f} {p.hf_tps:>9.1f} "
            f"{p.pdserve_tps / p.hf_tps:>5.2f}x {p.hf_raw_tps:>13.1f} "
            f"{p.pdserve_tps / base.pdserve_tps:>16.2f}x"
        )
    print(
        "HF tok/s counts useful tokens sum(L_i); HF raw counts N * max(L_i) "
        "(including steps spent on already-finished requests). ratio = pdserve / HF."
    )


def point_json(p: Point, base: Point) -> dict[str, Any]:
    return {
        **asdict(p),
        "pdserve_median_s": statistics.median(p.pdserve_times),
        "hf_median_s": statistics.median(p.hf_times),
        "pdserve_tok_s": p.pdserve_tps,
        "hf_tok_s": p.hf_tps,
        "hf_raw_tok_s": p.hf_raw_tps,
        "ratio": p.pdserve_tps / p.hf_tps,
        "pdserve_scaling": p.pdserve_tps / base.pdserve_tps,
        "hf_scaling": p.hf_tps / base.hf_tps,
    }


def save_json(
    path: Path, args: argparse.Namespace, header: dict[str, Any], points: list[Point]
) -> None:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {**header, "config": config, "points": [point_json(p, points[0]) for p in points]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def save_plot(path: Path, points: list[Point], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [p.n for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [p.pdserve_tps for p in points], "o-", label="pdserve (continuous batching)")
    ax.plot(ns, [p.hf_tps for p in points], "s-", label="transformers (static), useful tokens")
    ax.plot(
        ns,
        [p.hf_raw_tps for p in points],
        "s--",
        alpha=0.5,
        label="transformers (static), raw tokens N*max(L)",
    )
    if len(ns) > 1 and ns[-1] / ns[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def warm_up(
    runners: dict[str, Callable[[list[list[int]], list[int]], float]],
    prompts: list[list[int]],
    batch_sizes: list[int],
) -> None:
    """A tiny run (2 tokens each) per side and N: first calls at a new shape are slow."""
    for n in tqdm(batch_sizes, desc="warming up", unit="N", file=sys.stderr):
        batch = [prompts[i % len(prompts)] for i in range(n)]
        for run in runners.values():
            run(batch, [2] * n)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.threads, args.device)
    command = print_header(args, machine)

    print("loading models ...", flush=True)
    tokenizer, hf_model = load_hf(args.model, args.device, args.dtype)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    llm = load_pdserve(args, [len(p) for p in prompts])
    torch.set_num_threads(args.threads)  # the same for both sides, whatever loading did
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id)
    )
    runners = {
        "pdserve": lambda ps, ls: run_pdserve(llm, ps, ls),
        "transformers": lambda ps, ls: run_hf(hf_model, pad_id, ps, ls),
    }
    warm_up(runners, prompts, args.batch_sizes)

    lens = draw_output_lens(args.batch_sizes[-1], args.min_out, args.max_out, args.seed)
    points = [Point(n, lens[:n], sum(lens[:n]), n * max(lens[:n])) for n in args.batch_sizes]
    measure(points, prompts, runners, args.repeats)
    print_table(points)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = {"command": command, "machine": machine, "prompt_lens": [len(p) for p in prompts]}
    save_json(args.out_dir / "throughput.json", args, header, points)
    where = machine.get("gpu", f"{machine['torch_threads']} threads")
    title = (
        f"SmolLM2-135M {args.dtype}, {where}, out len U[{args.min_out},{args.max_out}]"
        if args.model is None
        else f"{Path(args.model).name}, {args.dtype}, {where}"
    )
    save_plot(args.out_dir / "throughput.png", points, title)
    print(f"saved {args.out_dir / 'throughput.json'} and {args.out_dir / 'throughput.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
