"""This machine's limits for decoding the default model, and the tokens/s they allow.

Measured, with all usable cores (torch threads):

- memory read bandwidth: a sum over a 1 GiB float32 tensor (larger than any L3 here), and over
  the bfloat16 weights' size (what a single-stream decode step reads) both by that sum and by
  the in-place bfloat16 kernel, which prefetches (the higher is the limit: on the Zen 4 VM the
  engine's single stream read faster than torch.sum);
- GEMM peak: the model's four per-layer linear layers (qkv 576->960, o, gate_up 576->3072, down)
  at M rows, on every GEMM path this machine offers, whether the engine would choose it or not
  (``services.engine.model.packed_linear``): oneDNN with weights packed once in float32 and in
  bfloat16 (native AVX512-BF16/AMX where the CPU has them, emulated where not), bfloat16
  weights widened to float32 for oneDNN and for MKL, plain ``torch.nn.functional.linear``
  (MKL's sgemm) in float32, and for up to 4 rows the compiled kernel that reads bfloat16
  weights in place (``kernels/csrc/linear_bf16_cpu.c``; for 2-16 rows its variant with bfloat16
  dot products, where the CPU has them), and, where the CPU has bfloat16 dot products, our GEMM
  over weights in pair order (``kernels/csrc/gemm_bf16_cpu.c``, any M). The limits are the
  best of them: the
  machine's, not the engine's. Apart from them, the int8 GEMM (``torch._int_mm``: oneDNN, VNNI
  where the CPU has it) on int8 inputs alone, and ``--quantization int8``'s whole layer (quantize
  the rows, the GEMM, scales and bias: ``services.engine.model.int8_linear``), with their own
  limits: int8 is a different model, whose outputs differ (``int8_quality.py``).
- beside them, the engine's own choice (``--cpu-matmul auto``: the path per layer shape and row
  count it measured at start, read from its cache in ~/.cache/pdserve/kernels or measured now)
  and the GFLOP/s of that choice.

Then the limits: single stream, one decode step reads every weight once, so tokens/s <= bandwidth
/ weight bytes; at 64 sequences a step is GEMM-bound, so tokens/s <= GEMM peak / flops per token
(2 x parameters in the linear layers and the LM head; attention is left out, which flatters the
limit a little). With int8 layers the weights are the layers' int8 bytes plus the head's bfloat16
ones, and a token's time is its layers' flops at the int8 rate plus the head's at the best float
rate.

    python benchmarks/machine_limits.py [--repeats 5]

Prints the command, the machine and a table; writes machine_limits.json to --out-dir.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import (
    describe_read_scaling,
    machine_info,
    median_seconds,
)  # benchmarks/machine.py (on sys.path)
from torch import nn
from tqdm import tqdm

from kernels import cpu_ops, reference
from services.engine.config import DEFAULT_CACHE_DIR, default_num_threads
from services.engine.model.gemm_choice import GemmTable
from services.engine.model.int8_linear import Int8Linear
from services.engine.model.loader import load_model
from services.engine.model.packed_linear import (
    NUM_BUCKETS,
    SMALL_BATCH_PATHS,
    PackedLinear,
    bucket_bounds,
    bucket_of,
    can_run,
    native_matmul,
    serves,
)
from services.engine.model.source import resolve_model_dir

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 30, 576, 1536, 49_152
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]
LAYER_PARAMS = LAYERS * sum(i * o for i, o in SHAPES)
HEAD_PARAMS = HIDDEN * VOCAB  # the LM head (tied to the embedding)
FLOPS_PER_TOKEN = 2 * (LAYER_PARAMS + HEAD_PARAMS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INT8_GEMM = "int8 GEMM alone (oneDNN _int_mm)"
# label -> (weight dtype, path)
KINDS = {
    "float32, oneDNN packed": ("float32", "native"),
    "float32, MKL (F.linear)": ("float32", "mkl"),
    "bfloat16, oneDNN bf16": ("bfloat16", "native"),
    "bfloat16 widened, oneDNN": ("bfloat16", "float32"),
    "bfloat16 widened, MKL (F.linear)": ("bfloat16", "mkl"),
    "bfloat16 in place (ours, M<=4)": ("bfloat16", "small-batch"),
    "bfloat16 in place, 4-row tiles (ours, M<=4)": ("bfloat16", "small-batch-4"),
    "bfloat16 in place, dot products (ours, 2<=M<=16)": ("bfloat16", "small-batch-dot"),
    "bfloat16 pair order, dot products (ours)": ("bfloat16", "pairs-dot"),
}


def read_gib_s(num_bytes: int, repeats: int) -> float:
    data = torch.ones(num_bytes // 4)
    return num_bytes / 2**30 / median_seconds(data.sum, repeats)


def kernel_read_gib_s(
    num_bytes: int, kernels: cpu_ops.CpuKernels | None, repeats: int
) -> float | None:
    """The same bytes read by a reader that prefetches: the in-place bfloat16 kernel (one row
    of x, no bias) over one ``[rows, 576]`` weight of ``num_bytes``, far beyond any L3. On the
    Zen 4 VM the single-stream engine, which reads its weights this way, beat torch.sum's rate
    (137.7 tok/s = 34.5 GiB/s against 31.7): torch's reductions, which do not prefetch, are no
    upper bound there. None without the compiled kernels."""
    if kernels is None:
        return None
    in_features = 576
    rows = num_bytes // (2 * in_features)
    weight = cpu_ops.TiledWeight.of(torch.ones(rows, in_features, dtype=torch.bfloat16), 8)
    x = torch.ones(1, in_features, dtype=torch.bfloat16)
    seconds = median_seconds(lambda: kernels.linear_bf16(x, weight, None), repeats)
    return rows * in_features * 2 / 2**30 / seconds


def gemm_gflops(
    rows: int,
    dtype: torch.dtype,
    paths: list[str],
    kernels: cpu_ops.CpuKernels | None,
    repeats: int,
) -> float | None:
    """GFLOP/s of the four layer shapes at ``rows`` rows (four layers' worth), shape i on
    ``paths[i]``; None where a path cannot run here (or the kernel is not built)."""
    assert len(paths) == len(SHAPES), "one path per shape"  # zip would drop layers silently
    small_batch = kernels.linear_bf16 if kernels is not None else None
    linears = [nn.Linear(i, o, bias=False).to(dtype) for i, o in SHAPES * 4]
    small = any(p in SMALL_BATCH_PATHS for p in paths)
    if small and (small_batch is None or not all(serves(p, rows) for p in paths)):
        return None
    dots = {"small-batch-dot", "pairs-dot"} & set(paths)
    if dots and not (kernels is not None and kernels.bf16_dot):
        return None  # a build without the dot products: its layers would time the fallback
    if not all(can_run(p, x.weight, True) for p, x in zip(paths * 4, linears)):
        return None
    layers = [PackedLinear(x, every_row(p), small_batch) for p, x in zip(paths * 4, linears)]
    inputs = [torch.randn(rows, layer.in_features).to(dtype) for layer in layers]

    def forward() -> None:
        for x, layer in zip(inputs, layers):
            layer(x)

    with torch.inference_mode():
        seconds = median_seconds(forward, repeats)
    return 4 * 2 * rows * sum(i * o for i, o in SHAPES) / seconds / 1e9


def int8_gflops(rows: int, whole_layer: bool, kernels: Any, repeats: int) -> float:
    """GFLOP/s of the four layer shapes at ``rows`` rows in int8: the GEMM alone on int8 inputs
    (``whole_layer`` False), or ``Int8Linear`` on bfloat16 inputs (quantize, GEMM, dequantize)."""
    linears = [nn.Linear(i, o, bias=False).to(torch.bfloat16) for i, o in SHAPES * 4]
    calls: list[Callable[[], object]] = []
    for linear in linears:
        x = torch.randn(rows, linear.in_features).to(torch.bfloat16)
        if whole_layer:
            calls.append(functools.partial(Int8Linear(linear, kernels or reference), x))
        else:
            weight = torch.randint(-127, 128, linear.weight.shape, dtype=torch.int8)
            xq = torch.randint(-127, 128, x.shape, dtype=torch.int8)
            calls.append(functools.partial(torch._int_mm, xq, weight.t()))

    def forward() -> None:
        for call in calls:
            call()

    with torch.inference_mode():
        seconds = median_seconds(forward, repeats)
    return 4 * 2 * rows * sum(i * o for i, o in SHAPES) / seconds / 1e9


def every_row(path: str) -> tuple[str, ...]:
    """``path`` for each row bucket (a small-batch kernel only for the rows it takes)."""
    if path not in SMALL_BATCH_PATHS:
        return (path,) * NUM_BUCKETS
    bounds = [bucket_bounds(b) for b in range(NUM_BUCKETS)]
    return tuple(
        path if high and serves(path, low) and serves(path, high) else "mkl" for low, high in bounds
    )


def engine_tables(kernels: cpu_ops.CpuKernels | None) -> dict[str, GemmTable | None]:
    """The engine's path table for the default model in each dtype (its cache, or measured)."""
    model_dir = resolve_model_dir(None, DEFAULT_CACHE_DIR)
    small_batch = kernels.linear_bf16 if kernels is not None else None
    tables = {}
    for name, dtype in DTYPES.items():
        model = load_model(
            model_dir, dtype, "cpu", "auto", small_batch, DEFAULT_CACHE_DIR / "kernels"
        )
        tables[name] = model.gemm_table
    return tables


def chosen_paths(table: GemmTable | None, rows: int) -> list[str]:
    """The engine's path for each of ``SHAPES`` at ``rows`` (native where it has no table)."""
    if table is None:
        return ["native"] * len(SHAPES)
    return [table.paths[(o, i)][bucket_of(rows)] for i, o in SHAPES]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="1,8,64,512", help="GEMM rows M, comma-separated")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    threads = default_num_threads()
    torch.set_num_threads(threads)
    machine = machine_info(threads, True, avx512_bf16=native_matmul(torch.bfloat16))
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {threads} threads, native bf16 dot products: "
        f"{machine['avx512_bf16']}"
    )
    print(describe_read_scaling(machine["read_scaling"]))
    kernels = cpu_ops.load(DEFAULT_CACHE_DIR / "kernels")
    tables = engine_tables(kernels)  # before timing: a first measurement must not overlap it
    weight_bytes = 2 * (LAYER_PARAMS + HEAD_PARAMS)
    rows = [int(r) for r in args.rows.split(",")]
    engine_kinds = [f"engine's choice, {name}" for name in DTYPES]
    int8_kinds = {INT8_GEMM: False, "int8 W8A8 layer (--quantization)": True}
    total = 2 + len(rows) * (len(KINDS) + 2 + len(int8_kinds))
    with tqdm(total=total, desc="measuring", file=sys.stderr) as bar:
        dram = read_gib_s(1 << 30, args.repeats)
        bar.update(1)
        summed = read_gib_s(weight_bytes, args.repeats)
        streamed = kernel_read_gib_s(weight_bytes, kernels, args.repeats)
        weights_read = max(summed, streamed or 0.0)
        bar.update(1)
        gemm: dict[str, dict[int, float | None]] = {k: {} for k in [*KINDS, *engine_kinds]}
        for kind, (dtype, path) in KINDS.items():
            for m in rows:
                paths = [path] * len(SHAPES)
                gemm[kind][m] = gemm_gflops(m, DTYPES[dtype], paths, kernels, args.repeats)
                bar.update(1)
        for kind, (name, table) in zip(engine_kinds, tables.items()):
            for m in rows:
                paths = chosen_paths(table, m)
                gemm[kind][m] = gemm_gflops(m, DTYPES[name], paths, kernels, args.repeats)
                bar.update(1)
        for kind, whole_layer in int8_kinds.items():
            gemm[kind] = {}
            for m in rows:
                gemm[kind][m] = int8_gflops(m, whole_layer, kernels, args.repeats)
                bar.update(1)

    kernel_rate = "n/a" if streamed is None else f"{streamed:.1f}"
    print(
        f"\nread bandwidth: {dram:.1f} GiB/s over 1 GiB (torch.sum); over "
        f"{weight_bytes / 2**20:.0f} MiB (the bf16 weights) {summed:.1f} by torch.sum, "
        f"{kernel_rate} by the prefetching bf16 kernel: the limit is the higher"
    )
    width = max(len(kind) for kind in gemm) + 2
    title = "GEMM GFLOP/s (4 layer shapes)"
    print(f"\n{title:<{width}}" + "".join(f"{'M=' + str(m):>10}" for m in rows))
    for kind in gemm:
        cells = "".join(f"{'n/a' if v is None else f'{v:.1f}':>10}" for v in gemm[kind].values())
        print(f"{kind:<{width}}{cells}")
    print("\nthe engine's paths (--cpu-matmul auto) per layer shape and row count:")
    for name, table in tables.items():
        source = "none" if table is None else table.source
        print(f"  {name} weights ({source}):")
        for line in table.lines() if table else []:
            print(f"    {line}")
    single = weights_read * 2**30 / weight_bytes
    machine_kinds = list(KINDS)
    best64 = (
        max((v for k in machine_kinds if (v := gemm[k].get(64)) is not None), default=None)
        if 64 in rows
        else None
    )
    print(f"\nsingle stream, bf16 weights read once per token: <= {single:.0f} tok/s")
    if best64:
        print(
            f"64 sequences, GEMM-bound at {best64:.0f} GFLOP/s (the best path): "
            f"<= {best64 * 1e9 / FLOPS_PER_TOKEN:.0f} tok/s "
            f"({FLOPS_PER_TOKEN / 1e9:.2f} GFLOP per token)"
        )
    int8_bytes = LAYER_PARAMS + 2 * HEAD_PARAMS  # int8 layers, bfloat16 head
    single_int8 = weights_read * 2**30 / int8_bytes
    int8_64 = gemm[INT8_GEMM].get(64)
    batch64_int8 = None
    if best64 and int8_64:
        per_token_s = 2 * LAYER_PARAMS / (int8_64 * 1e9) + 2 * HEAD_PARAMS / (best64 * 1e9)
        batch64_int8 = 1 / per_token_s
    mib = int8_bytes / 2**20
    print(f"int8 layers, single stream ({mib:.0f} MiB a token): <= {single_int8:.0f} tok/s")
    if batch64_int8:
        print(
            f"int8 layers, 64 sequences (int8 GEMM {int8_64:.0f} GFLOP/s, head at the best "
            f"float path): <= {batch64_int8:.0f} tok/s"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "machine_limits.json"
    data = {
        "command": command,
        "machine": machine,
        "read_gib_s": {
            "1GiB": dram,
            "bf16_weights": weights_read,
            "bf16_weights_sum": summed,
            "bf16_weights_kernel": streamed,
        },
        "gemm_gflops": {k: {str(m): v for m, v in by.items()} for k, by in gemm.items()},
        "engine_paths": {n: t.to_json() if t else None for n, t in tables.items()},
        "limits_tok_s": {
            "single_stream": single,
            "batch64": None if not best64 else best64 * 1e9 / FLOPS_PER_TOKEN,
            "single_stream_int8": single_int8,
            "batch64_int8": batch64_int8,
        },
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
