"""This machine's limits for decoding the default model, and the tokens/s they allow.

Measured, with all usable cores (torch threads):

- memory read bandwidth: a sum over a 1 GiB float32 tensor (larger than any L3 here), and over
  the bfloat16 weights' size (what a single-stream decode step reads);
- GEMM peak: the model's four per-layer linear layers (qkv 576->960, o, gate_up 576->3072, down)
  at M rows, through oneDNN with weights packed once (what the engine runs), in float32 and in
  bfloat16 (native AVX512-BF16/AMX where the CPU has them, emulated where not), the bfloat16
  weights widened to float32 (``--cpu-matmul float32``), and for up to 4 rows the compiled kernel
  that reads the bfloat16 weights in place (``kernels/csrc/linear_bf16_cpu.c``).

Then the limits: single stream, one decode step reads every weight once, so tokens/s <= bandwidth
/ weight bytes; at 64 sequences a step is GEMM-bound, so tokens/s <= GEMM peak / flops per token
(2 x parameters in the linear layers and the LM head; attention is left out, which flatters the
limit a little).

    python benchmarks/machine_limits.py [--repeats 5]

Prints the command, the machine and a table; writes machine_limits.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from machine import machine_info, median_seconds  # benchmarks/machine.py (on sys.path)
from torch import nn
from tqdm import tqdm

from kernels import cpu_ops
from services.engine.config import default_num_threads
from services.engine.model.packed_linear import PackedLinear, native_matmul, onednn_supports

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49_152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
LAYER_PARAMS = LAYERS * sum(i * o for i, o in SHAPES)
HEAD_PARAMS = HIDDEN * VOCAB  # the LM head (tied to the embedding)
FLOPS_PER_TOKEN = 2 * (LAYER_PARAMS + HEAD_PARAMS)
# label -> (weight dtype, compute dtype)
KINDS = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "bfloat16 widened": (torch.bfloat16, torch.float32),
    "bfloat16 in place (compiled, M<=4)": (torch.bfloat16, torch.float32),
}


def read_gib_s(num_bytes: int, repeats: int) -> float:
    data = torch.ones(num_bytes // 4)
    return num_bytes / 2**30 / median_seconds(data.sum, repeats)


def gemm_gflops(rows: int, kind: str, repeats: int) -> float | None:
    """GFLOP/s of the four layer shapes at ``rows`` rows (four layers' worth); None where
    oneDNN cannot run ``kind`` here."""
    dtype, compute = KINDS[kind]
    small_batch = None
    if "compiled" in kind:
        kernels = cpu_ops.load(Path(tempfile.mkdtemp()))
        if kernels is None or rows > cpu_ops.LINEAR_MAX_ROWS:
            return None
        small_batch = kernels.linear_bf16
    if not onednn_supports(compute):
        return None
    layers = [
        PackedLinear(nn.Linear(i, o, bias=False).to(dtype), compute, small_batch)
        for i, o in SHAPES * 4
    ]
    inputs = [torch.randn(rows, layer.in_features).to(dtype) for layer in layers]

    def forward() -> None:
        for x, layer in zip(inputs, layers):
            layer(x)

    with torch.inference_mode():
        seconds = median_seconds(forward, repeats)
    return 4 * 2 * rows * sum(i * o for i, o in SHAPES) / seconds / 1e9


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="1,64,512", help="GEMM rows M, comma-separated")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    threads = default_num_threads()
    torch.set_num_threads(threads)
    machine = machine_info(threads, avx512_bf16=native_matmul(torch.bfloat16))
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {threads} threads, native bf16 dot products: "
        f"{machine['avx512_bf16']}"
    )
    weight_bytes = 2 * (LAYER_PARAMS + HEAD_PARAMS)
    rows = [int(r) for r in args.rows.split(",")]
    kinds = list(KINDS)
    with tqdm(total=2 + len(rows) * len(kinds), desc="measuring", file=sys.stderr) as bar:
        dram = read_gib_s(1 << 30, args.repeats)
        bar.update(1)
        weights_read = read_gib_s(weight_bytes, args.repeats)
        bar.update(1)
        gemm: dict[str, dict[int, float | None]] = {k: {} for k in kinds}
        for kind in kinds:
            for m in rows:
                gemm[kind][m] = gemm_gflops(m, kind, args.repeats)
                bar.update(1)

    print(
        f"\nread bandwidth: {dram:.1f} GiB/s over 1 GiB, {weights_read:.1f} GiB/s over "
        f"{weight_bytes / 2**20:.0f} MiB (the bf16 weights)"
    )
    print(
        f"\n{'GEMM GFLOP/s (oneDNN, packed)':<34}" + "".join(f"{'M=' + str(m):>10}" for m in rows)
    )
    for kind in kinds:
        cells = "".join(f"{'n/a' if v is None else f'{v:.1f}':>10}" for v in gemm[kind].values())
        print(f"{kind:<36}{cells}")
    single = weights_read * 2**30 / weight_bytes
    best64 = max(v for k in kinds if (v := gemm[k].get(64)) is not None) if 64 in rows else None
    print(f"\nsingle stream, bf16 weights read once per token: <= {single:.0f} tok/s")
    if best64:
        print(
            f"64 sequences, GEMM-bound at {best64:.0f} GFLOP/s: "
            f"<= {best64 * 1e9 / FLOPS_PER_TOKEN:.0f} tok/s "
            f"({FLOPS_PER_TOKEN / 1e9:.2f} GFLOP per token)"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "machine_limits.json"
    data = {
        "command": command,
        "machine": machine,
        "read_gib_s": {"1GiB": dram, "bf16_weights": weights_read},
        "gemm_gflops": {k: {str(m): v for m, v in by.items()} for k, by in gemm.items()},
        "limits_tok_s": {
            "single_stream": single,
            "batch64": None if not best64 else best64 * 1e9 / FLOPS_PER_TOKEN,
        },
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
