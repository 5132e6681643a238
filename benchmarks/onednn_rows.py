"""What oneDNN's kernel per row count costs a server, with and without the engine's row grid.

oneDNN builds a kernel for each new row count of a GEMM (``services.engine.model.packed_linear``,
``onednn_rows``). A prefill step's row count is its token count, so prompts of many lengths keep
building kernels. This runs the offline engine on ``--prompts`` prompts of random lengths in
[``--min-tokens``, ``--max-tokens``] (fresh random token ids: no prefix-cache hits), each alone
with one output token, as a server meets them. Each mode runs in its own process, so that none
inherits the other's kernels: ``grid`` (the engine as it is) and ``exact`` (the grid switched
off in that process, every GEMM at its own row count). Modes alternate for ``--rounds``, each
round on its own lengths; medians are printed, of the whole run and of its second half (by
then the grid has built most of its kernels; without it, every new length still builds five).

    python benchmarks/onednn_rows.py [--dtype bfloat16] [--prompts 96] [--rounds 2]

``--kernels`` measures the cause instead, on oneDNN's GEMM alone over the default model's four
layer shapes (weights packed in ``--dtype``): a row count's first call against its second, and
three passes over 60 and 200 random row counts of 64-1,024, each count of row counts in its own
process, exact and on the grid (oneDNN's kernel cache holds fewer kernels than 200 x 4).

About 5 minutes at the defaults, 2 with ``--kernels``. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ("grid", "exact")
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): q/k/v, o, gate/up, down
CYCLE_COUNTS = (60, 200)  # random row counts cycled over by --kernels


def packed_gemms(dtype: str) -> list[tuple[torch.Tensor, int]]:
    """oneDNN's packed weights of the four layer shapes, with their input width."""
    import torch

    weights = [torch.randn(out, inp).to(getattr(torch, dtype)) for out, inp in SHAPES]
    return [(torch.ops.mkldnn._reorder_linear_weight(w, None), w.shape[1]) for w in weights]


def run_gemms(gemms: list[tuple[torch.Tensor, int]], rows: int, dtype: str) -> float:
    """Seconds of one call of each shape at ``rows`` rows."""
    import torch

    start = time.perf_counter()
    for packed, width in gemms:
        x = torch.zeros(rows, width, dtype=getattr(torch, dtype))
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return time.perf_counter() - start


def run_cycle(args: argparse.Namespace) -> None:
    """In the child: three passes over ``--count`` random row counts; one JSON line."""
    from services.engine.model.packed_linear import onednn_rows

    gemms = packed_gemms(args.dtype)
    rng = random.Random(args.seed)
    counts = [rng.randint(64, 1024) for _ in range(args.count)]
    if args.child == "cycle-grid":
        counts = [onednn_rows(rows) for rows in counts]
    passes = [sum(run_gemms(gemms, rows, args.dtype) for rows in counts) for _ in range(3)]
    print(json.dumps({"distinct": len(set(counts)), "passes": passes}))


def kernels(args: argparse.Namespace) -> None:
    """``--kernels``: the first call at a new row count, and cycles with and without the grid."""
    gemms = packed_gemms(args.dtype)
    run_gemms(gemms, 300, args.dtype)
    print(f"\noneDNN {args.dtype} GEMM, the four layer shapes in turn, ms")
    print(f"{'rows':>6} {'first call':>11} {'second call':>12}")
    for rows in (512, 513, 700, 1001):
        first, second = (run_gemms(gemms, rows, args.dtype) * 1e3 for _ in range(2))
        print(f"{rows:6} {first:11.2f} {second:12.2f}")
    print("\nthree passes over random row counts of 64-1,024, s (each line its own process)")
    for count in CYCLE_COUNTS:
        for mode in ("cycle-exact", "cycle-grid"):
            command = [sys.executable, __file__, "--dtype", args.dtype, "--child", mode]
            command += ["--count", str(count), "--seed", str(args.seed)]
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            passes = ", ".join(f"{p:.2f}" for p in result["passes"])
            label = f"{count} counts, {mode[6:]} ({result['distinct']} distinct)"
            print(f"  {label:32} {passes}")


def run_mode(args: argparse.Namespace) -> None:
    """In the child: load the engine, run the prompts, print one JSON line."""
    import services.engine.model.packed_linear as packed_linear

    if args.child == "exact":
        packed_linear.onednn_rows = lambda rows: rows  # read at every call by the oneDNN GEMM
    from pdserve import LLM, SamplingParams

    llm = LLM(dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.prompts)]
    llm.generate([[rng.randrange(100, 40_000) for _ in range(8)]], params)  # load, warm up
    seconds = []
    for length in lengths:
        start = time.perf_counter()
        llm.generate([[rng.randrange(100, 40_000) for _ in range(length)]], params)
        seconds.append(time.perf_counter() - start)
    half = len(lengths) // 2
    whole = sum(lengths) / sum(seconds)
    second = sum(lengths[half:]) / sum(seconds[half:])
    print(json.dumps({"mode": args.child, "whole": whole, "second": second}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", action="store_true", help="oneDNN's GEMM alone (docstring)")
    parser.add_argument("--count", type=int, default=60, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child", choices=(*MODES, "cycle-exact", "cycle-grid"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child in MODES:
        run_mode(args)
        return 0
    if args.child:
        run_cycle(args)
        return 0
    from machine import machine_info  # benchmarks/machine.py
    from tqdm import tqdm

    from services.engine.config import default_num_threads

    print("$ python benchmarks/onednn_rows.py " + shlex.join(sys.argv[1:]))
    info = machine_info(default_num_threads())
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    if args.kernels:
        kernels(args)
        return 0
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    runs = [(r, MODES[(r + i) % 2]) for r in range(args.rounds) for i in range(2)]
    for round_index, mode in tqdm(runs, desc="processes", unit="run"):
        command = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        command += ["--seed", str(args.seed + round_index)]
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=1800)
        results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n{args.prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens, one at a time,")
    print(f"{args.dtype}, prompt tokens/s (medians of {args.rounds} processes per mode)")
    print(f"{'mode':8} {'whole run':>10} {'second half':>12}   (each process)")
    medians = {}
    for mode in MODES:
        whole = statistics.median(r["whole"] for r in results[mode])
        medians[mode] = second = statistics.median(r["second"] for r in results[mode])
        each = ", ".join(f"{r['whole']:.0f}/{r['second']:.0f}" for r in results[mode])
        print(f"{mode:8} {whole:10.0f} {second:12.0f}   ({each})")
    print(f"grid / exact, second half: {medians['grid'] / medians['exact']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
