"""The CPU fast path, part by part: each piece against what it replaced, side by side in one run.

1. GEMMs: the default model's four per-layer linear layers (qkv 576->960, o 576->576, gate_up
   576->3072, down 1536->576), all 30 layers' worth, for M rows (the decode batch): ``F.linear``
   (MKL, what ``nn.Linear`` does) vs ``PackedLinear`` (oneDNN, weights reordered once).
1b. bfloat16 GEMMs, the same layers: oneDNN's bfloat16 GEMM (``PackedLinear`` on ``native``) vs
   ours over weights in pair order (``pairs-dot``, ``kernels/csrc/gemm_bf16_cpu.c``; CPUs with
   AVX-512 BF16), the two timed in turn, repeat by repeat, so a VM's drift hits both alike.
2. Decode attention over a whole step: every layer of a paged cache laid out as the engine's
   (``[blocks, layers, 2, kv_heads, block, head_dim]``, shuffled blocks, about 1 GiB so it lives
   in DRAM as in a server) for B sequences of context C: the PyTorch reference (gather +
   per-block matmuls) vs the compiled kernel (``kernels.cpu_ops``, blocks read in place).
3. The layer glue of one step, all 30 layers, for T tokens: the two residual adds with their
   RMSNorms, rotary with the KV write, SiLU-and-multiply; PyTorch's operators
   (``kernels.reference``) vs the fused compiled calls (``kernels/csrc/layer_ops_cpu.c``).
4. Prefill attention of one layer for a fresh prompt of P tokens, bfloat16 (the compiled kernel
   takes bfloat16 only, on CPUs with AVX-512 BF16): PyTorch's SDPA (``kernels.reference``) vs
   ``kernels/csrc/prefill_attention_cpu.c``, in GFLOP/s (causal: 2 x P (P + 1) x heads x
   head_dim flops), each one's largest difference from float32 attention on the same values.

Medians of --repeats timed runs after one warm-up, with --threads torch threads.

    python benchmarks/cpu_kernels.py
    python benchmarks/cpu_kernels.py --rows 1,64 --batches 64 --contexts 256 --repeats 3
    python benchmarks/cpu_kernels.py --no-gemm --dtype bfloat16   # the bfloat16 cache
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from machine import (  # benchmarks/machine.py (this folder is on sys.path)
    describe_read_scaling,
    machine_info,
    median_seconds,
)
from torch import nn
from tqdm import tqdm

from common.settings import add_settings, build, settings_of
from kernels import cpu_ops, reference
from services.engine.config import EngineConfig, default_num_threads
from services.engine.model.packed_linear import PackedLinear, onednn_supports

LAYERS, HIDDEN, INTERMEDIATE = 30, 576, 1536
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
LINEAR_SHAPES = [
    (HIDDEN, 960),
    (HIDDEN, HIDDEN),
    (HIDDEN, 2 * INTERMEDIATE),
    (INTERMEDIATE, HIDDEN),
]
CACHE_BYTES = 1 << 30


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return 1000 * median_seconds(fn, repeats)


def _forward(inputs: list[torch.Tensor], layers: list[Callable[..., torch.Tensor]]) -> None:
    for x, layer in zip(inputs, layers):
        layer(x)


def _step(op: Callable[..., torch.Tensor], caches: list, *args: object) -> list[torch.Tensor]:
    """``op`` over every layer's caches: one decode step's attention."""
    query, tables, lens, scale = args
    return [op(query, k, v, tables, lens, scale) for k, v in caches]


def alternated_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median ms of each of ``fns``, called in turn ``repeats`` times after one warm-up each."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [1000 * statistics.median(spent) for spent in times]


def bf16_gemm_rows(
    kernel: cpu_ops.CpuKernels, rows: list[int], repeats: int
) -> list[tuple[int, float, float]]:
    """(M, oneDNN bf16 ms, pairs-dot ms) for one forward's worth of bfloat16 linear layers."""
    layers = [
        nn.Linear(i, o, bias=False).to(torch.bfloat16)
        for _ in range(LAYERS)
        for i, o in LINEAR_SHAPES
    ]
    onednn = [PackedLinear(layer, "native") for layer in layers]
    ours = [PackedLinear(layer, "pairs-dot", kernel.linear_bf16) for layer in layers]
    results = []
    for m in tqdm(rows, desc="bf16 GEMM", unit="M", file=sys.stderr):
        inputs = [torch.randn(m, layer.in_features).to(torch.bfloat16) for layer in layers]
        native_ms, pairs_ms = alternated_ms(
            [partial(_forward, inputs, onednn), partial(_forward, inputs, ours)], repeats
        )
        results.append((m, native_ms, pairs_ms))
    return results


def gemm_rows(rows: list[int], repeats: int) -> list[tuple[int, float, float]]:
    """(M, F.linear ms, PackedLinear ms) for one forward's worth of linear layers."""
    layers = [nn.Linear(i, o, bias=False) for _ in range(LAYERS) for i, o in LINEAR_SHAPES]
    packed = [PackedLinear(layer) for layer in layers]
    results = []
    for m in tqdm(rows, desc="GEMM", unit="M", file=sys.stderr):
        inputs = [torch.randn(m, layer.in_features) for layer in layers]
        plain = partial(_forward, inputs, [partial(F.linear, weight=x.weight) for x in layers])
        onednn = partial(_forward, inputs, packed)
        results.append((m, median_ms(plain, repeats), median_ms(onednn, repeats)))
    return results


def attention_rows(
    kernel: cpu_ops.CpuKernels,
    batches: list[int],
    contexts: list[int],
    repeats: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[int, int, float, float, float]]:
    """(B, C, reference ms, kernel ms, max abs difference) for one step (all layers), with the
    cache and the query in ``dtype`` as the engine keeps them."""
    block_bytes = LAYERS * 2 * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * dtype.itemsize
    num_blocks = CACHE_BYTES // block_bytes
    kv = torch.randn(num_blocks, LAYERS, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dtype)
    caches = [(kv[:, i, 0].transpose(1, 2), kv[:, i, 1].transpose(1, 2)) for i in range(LAYERS)]
    scale = HEAD_DIM**-0.5
    pairs = [(b, c) for b in batches for c in contexts]
    results = []
    for batch, context in tqdm(pairs, desc="attention", unit="shape", file=sys.stderr):
        per_seq = -(-context // BLOCK_SIZE)
        if batch * per_seq > num_blocks:
            tqdm.write(
                f"B={batch} C={context}: skipped, needs more than the {num_blocks}-block cache"
            )
            continue
        tables = torch.randperm(num_blocks)[: batch * per_seq].view(batch, per_seq).int()
        lens = torch.full((batch,), context, dtype=torch.int32)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype)

        ref = partial(_step, reference.paged_attention_decode, caches, query, tables, lens, scale)
        compiled = partial(_step, kernel.paged_attention_decode, caches, query, tables, lens, scale)
        diff = max(float((a - b).abs().max()) for a, b in zip(ref(), compiled()))
        ref_ms, kernel_ms = median_ms(ref, repeats), median_ms(compiled, repeats)
        results.append((batch, context, ref_ms, kernel_ms, diff))
    return results


def _glue_step(ops: Any, x, delta, weight, qkv, rotary, caches, slots, gate_up) -> None:  # type: ignore[no-untyped-def]
    """One step's layer glue through ``ops`` (``kernels.reference`` or the compiled kernels)."""
    for _ in range(LAYERS):
        ops.add_rms_norm(x, delta, weight, 1e-5)
        ops.rotary_write_kv(qkv, rotary, *caches, slots, NUM_HEADS, NUM_KV_HEADS)
        ops.add_rms_norm(x, delta, weight, 1e-5)
        ops.silu_mul(gate_up)


def glue_rows(
    kernel: cpu_ops.CpuKernels, token_counts: list[int], repeats: int, dtype: torch.dtype
) -> list[tuple[int, float, float]]:
    """(T, reference ms, compiled ms) for one step's layer glue (all layers), T tokens."""
    results = []
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    for tokens in tqdm(token_counts, desc="glue", unit="T", file=sys.stderr):
        blocks = -(-tokens // BLOCK_SIZE)
        kv = torch.zeros(blocks, 2, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=dtype)
        caches = (kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2))
        slots = torch.arange(tokens)
        angles = torch.rand(tokens, 1, HEAD_DIM)
        rotary = (angles.cos().to(dtype), angles.sin().to(dtype))
        x, delta = (
            torch.randn(tokens, HIDDEN, dtype=dtype),
            torch.randn(tokens, HIDDEN, dtype=dtype),
        )
        weight = torch.ones(HIDDEN, dtype=dtype)
        qkv = torch.randn(tokens, width, dtype=dtype)
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype)

        args = (x, delta, weight, qkv, rotary, caches, slots, gate_up)
        ref = median_ms(partial(_glue_step, reference, *args), repeats)
        results.append((tokens, ref, median_ms(partial(_glue_step, kernel, *args), repeats)))
    return results


def prefill_rows(
    kernel: cpu_ops.CpuKernels, prompts: list[int], repeats: int
) -> list[tuple[int, dict[str, tuple[float, float]]]]:
    """(P, {SDPA or compiled path: (ms, max |diff| from float32)}) for one layer's prefill
    attention over a P-token prompt in shuffled blocks of a bfloat16 cache."""
    results = []
    for tokens in tqdm(prompts, desc="prefill attention", unit="P", file=sys.stderr):
        blocks = -(-tokens // BLOCK_SIZE)
        shape = (2 * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        key, value = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
        tables = torch.randperm(2 * blocks)[:blocks].view(1, blocks).int()
        query = torch.randn(tokens, NUM_HEADS, HEAD_DIM).bfloat16()
        args = (tables, torch.tensor([0, tokens]), torch.tensor([tokens]), HEAD_DIM**-0.5)
        exact = reference.paged_attention_prefill(query.float(), key.float(), value.float(), *args)
        calls: dict[str, Callable[[], torch.Tensor | None]] = {
            "SDPA": partial(reference.paged_attention_prefill, query, key, value, *args)
        }
        for path in kernel.prefill.paths:
            calls[path] = partial(kernel.prefill, query, key, value, *args, path=path)
        row = {}
        for name, call in calls.items():
            diff = float((call().float() - exact).abs().max())  # type: ignore[union-attr]
            row[name] = (median_ms(call, repeats), diff)
        results.append((tokens, row))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,8,16,32,64", help="GEMM row counts M")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes B")
    parser.add_argument("--contexts", default="64,256,1024", help="context lengths C (tokens)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=default_num_threads())
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="attention's cache"
    )
    parser.add_argument("--no-gemm", action="store_true", help="no GEMMs")
    parser.add_argument("--glue-tokens", default="1,64,512", help="layer glue token counts T")
    parser.add_argument("--prefill-tokens", default="512,2048", help="prompt lengths P")
    # The engine's own settings that place and build the kernel: --cache-dir, --cpu-kernels-cc.
    others = [name for name, *_ in settings_of(EngineConfig, nested=False)]
    skip = tuple(name for name in others if name not in ("cache_dir", "cpu_kernels_cc"))
    add_settings(parser, EngineConfig, os.environ, skip=skip, nested=False)
    args = parser.parse_args()
    config = build(EngineConfig, args)
    torch.set_num_threads(args.threads)
    info = machine_info(args.threads, probe_cores=True)
    print(f"$ python {shlex.join(sys.argv)}")
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({args.threads} threads), load avg {info['load_avg_1m_at_start']}"
    )
    print(describe_read_scaling(info["read_scaling"]))
    kernel = cpu_ops.load(config.cache_path / "kernels", config.cpu_kernels_cc)
    if kernel is None:
        print("the compiled kernel is unavailable here (no C compiler?): nothing to compare")
        return 1
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731

    if not args.no_gemm:
        print(f"\nGEMM: {LAYERS} layers x 4 linear layers of the default model, M rows, float32")
        print(f"{'M':>4} {'F.linear ms':>12} {'oneDNN ms':>10} {'speedup':>8}")
        with torch.inference_mode():
            for m, plain, onednn in gemm_rows(ints(args.rows), args.repeats):
                print(f"{m:>4} {plain:>12.1f} {onednn:>10.1f} {plain / onednn:>7.2f}x")

    if not args.no_gemm and kernel.bf16_dot and onednn_supports(torch.bfloat16):
        print("\nbfloat16 GEMM: the same layers; oneDNN bf16 vs ours in pair order, alternated")
        columns = ("oneDNN ms", 10), ("GFLOP/s", 8), ("ours ms", 8), ("GFLOP/s", 8), ("speedup", 8)
        print(f"{'M':>4} " + " ".join(f"{name:>{width}}" for name, width in columns))
        flops = 2 * LAYERS * sum(i * o for i, o in LINEAR_SHAPES) / 1e9
        with torch.inference_mode():
            for m, native_ms, pairs_ms in bf16_gemm_rows(kernel, ints(args.rows), args.repeats):
                print(
                    f"{m:>4} {native_ms:>10.2f} {m * flops / native_ms * 1e3:>8.1f} "
                    f"{pairs_ms:>8.2f} {m * flops / pairs_ms * 1e3:>8.1f} "
                    f"{native_ms / pairs_ms:>7.2f}x"
                )

    print(
        f"\ndecode attention: one step = {LAYERS} layers, {NUM_HEADS}/{NUM_KV_HEADS} heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}, shuffled blocks of a 1 GiB cache, {args.dtype}"
    )
    header = ("B", 4), ("C", 6), ("reference ms", 13), ("kernel ms", 10), ("speedup", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'max |diff|':>11}")
    with torch.inference_mode():
        dtype = getattr(torch, args.dtype)
        rows = attention_rows(kernel, ints(args.batches), ints(args.contexts), args.repeats, dtype)
    for b, c, ref_ms, kernel_ms, diff in rows:
        speedup = ref_ms / kernel_ms
        print(f"{b:>4} {c:>6} {ref_ms:>13.1f} {kernel_ms:>10.1f} {speedup:>7.2f}x {diff:>11.1e}")

    print(
        f"\nlayer glue: one step = {LAYERS} layers x (2 residual adds + RMSNorms, rotary + KV "
        f"write, SiLU-mul), T tokens, {args.dtype}"
    )
    print(f"{'T':>4} {'PyTorch ops ms':>15} {'compiled ms':>12} {'speedup':>8}")
    with torch.inference_mode():
        for t, ref_ms, kernel_ms in glue_rows(kernel, ints(args.glue_tokens), args.repeats, dtype):
            print(f"{t:>4} {ref_ms:>15.2f} {kernel_ms:>12.2f} {ref_ms / kernel_ms:>7.2f}x")

    if not kernel.prefill.available:
        print("\nprefill attention: not compiled on this CPU (no AVX-512 BF16): SDPA only")
        return 0
    print(
        f"\nprefill attention: one layer, a fresh prompt of P tokens, {NUM_HEADS}/{NUM_KV_HEADS} "
        f"heads, head_dim {HEAD_DIM}, bfloat16; max |diff| from float32 attention"
    )
    names = ["SDPA", *kernel.prefill.paths]
    print(f"{'P':>5}" + "".join(f" {n + ' ms':>15} {'GFLOP/s':>8} {'max diff':>9}" for n in names))
    with torch.inference_mode():
        for p, row in prefill_rows(kernel, ints(args.prefill_tokens), args.repeats):
            gflop = 2 * p * (p + 1) * NUM_HEADS * HEAD_DIM / 1e9
            cells = "".join(
                f" {row[n][0]:>15.2f} {gflop / row[n][0] * 1e3:>8.0f} {row[n][1]:>9.1e}"
                for n in names
            )
            print(f"{p:>5}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
