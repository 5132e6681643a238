"""Decode attention: Triton kernel vs the PyTorch reference, on one CUDA GPU.

Default model shape (9 query heads, 3 KV heads, head_dim 64, block 16), one layer of the strided
engine cache layout. Prints median times for each (batch, context) pair: the reference, the
Triton kernel with the whole context in one program per (sequence, KV head), and with the
context split into the partitions it picks to fill the GPU (flash-decoding), and the speedup of
the split kernel over the reference.

    python benchmarks/kernels_bench.py [--dtype bfloat16|float16|float32]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES, CONTEXTS = (1, 16, 64), (512, 2048, 8192)


def decode_inputs(batch: int, context: int, dtype: torch.dtype) -> tuple:
    """Random query, strided K/V caches (shuffled blocks), block tables and context lengths."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda")
    kv = kv.to(dtype)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda").to(dtype)
    return query, kv[:, 1, 0], kv[:, 1, 1], tables, lens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench: needs a CUDA GPU (the Triton kernels do not run natively on CPU)")
        return 0
    from triton.testing import do_bench

    from kernels import reference, triton_ops

    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    print(
        f"decode, {torch.cuda.get_device_name()}, {args.dtype}, "
        f"{NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}"
    )
    print(
        f"{'batch':>5} {'context':>7} {'reference us':>12} {'one part us':>11} "
        f"{'split us':>8} {'parts':>5} {'speedup':>7} {'max err':>8}"
    )
    for batch in BATCHES:
        for context in CONTEXTS:
            inputs = (*decode_inputs(batch, context, dtype), scale, context)
            # Passing max_context_len keeps the reference free of a host sync, as in the engine.
            ref = partial(reference.paged_attention_decode, *inputs)
            one = partial(triton_ops.paged_attention_decode, *inputs, partitions=1)
            tri = partial(triton_ops.paged_attention_decode, *inputs)
            parts = triton_ops._decode_partitions(batch, NUM_KV_HEADS, context, inputs[0].device)
            err = max((f().float() - ref().float()).abs().max().item() for f in (one, tri))
            t_ref, t_one, t_tri = (do_bench(f, return_mode="median") * 1e3 for f in (ref, one, tri))
            print(
                f"{batch:>5} {context:>7} {t_ref:>12.1f} {t_one:>11.1f} {t_tri:>8.1f} "
                f"{parts:>5} {t_ref / t_tri:>6.2f}x {err:>8.1e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
