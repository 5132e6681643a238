"""Decode attention: Triton kernel vs the PyTorch reference, on one CUDA GPU.

Default model shape (9 query heads, 3 KV heads, head_dim 64, block 16), one layer of the strided
engine cache layout. Prints median times and the speedup for each (batch, context) pair.

    python benchmarks/kernels_bench.py [--dtype bfloat16|float16|float32]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES, CONTEXTS = (1, 16, 64), (512, 2048)


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
        f"{'batch':>5} {'context':>7} {'reference us':>12} {'triton us':>9} "
        f"{'speedup':>7} {'max err':>8}"
    )
    for batch in BATCHES:
        for context in CONTEXTS:
            inputs = (*decode_inputs(batch, context, dtype), scale, context)
            # Passing max_context_len keeps the reference free of a host sync, as in the engine.
            ref = partial(reference.paged_attention_decode, *inputs)
            tri = partial(triton_ops.paged_attention_decode, *inputs)
            err = (tri().float() - ref().float()).abs().max().item()
            t_ref = do_bench(ref, return_mode="median") * 1e3
            t_tri = do_bench(tri, return_mode="median") * 1e3
            print(
                f"{batch:>5} {context:>7} {t_ref:>12.1f} {t_tri:>9.1f} "
                f"{t_ref / t_tri:>6.2f}x {err:>8.1e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
