"""KV memory waste: paged blocks vs contiguous max-length reservation, on the same request mix.

Contiguous allocation reserves ``max_seq_len`` token slots per request up front; the paged pool
(the engine's real ``BlockPool``) gives each request ``ceil(len / block_size)`` blocks. For a
request mix it reports slots allocated, slots used, the waste of each, and how many of these
requests fit at once in the same KV budget. Bytes use the default model's KV size per token.

    python benchmarks/kv_waste.py [--requests 10] [--max-seq-len 2048] [--budget-tokens 8192]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.sampling_params import SamplingParams  # noqa: E402
from services.engine.block_pool import BlockPool  # noqa: E402
from services.engine.sequence import Sequence  # noqa: E402

# SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x 64 dims x 4 bytes (float32).
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def request_lengths(count: int, seed: int, max_len: int) -> list[int]:
    """A chat-like mix: prompt 50-200 tokens plus 100-500 output tokens, capped at max_len."""
    rng = random.Random(seed)
    return [min(max_len, rng.randint(50, 200) + rng.randint(100, 500)) for _ in range(count)]


def paged_allocation(lengths: list[int], block_size: int) -> int:
    """Token slots the real BlockPool hands out for these sequences (all alive at once)."""
    num_blocks = sum(-(-n // block_size) for n in lengths)
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        seq = Sequence(i, f"r{i}", list(range(n)), SamplingParams())
        assert pool.can_allocate(seq, n, [])
        pool.allocate(seq, n, [])
    return pool.num_used_blocks * block_size


def max_concurrent_paged(lengths: list[int], budget_tokens: int, block_size: int) -> int:
    """Requests of the mix (cycled) admitted before a pool of ``budget_tokens`` is full."""
    pool = BlockPool(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    admitted = 0
    while True:
        n = lengths[admitted % len(lengths)]
        seq = Sequence(admitted, f"c{admitted}", list(range(n)), SamplingParams())
        if not pool.can_allocate(seq, n, []):
            return admitted
        pool.allocate(seq, n, [])
        admitted += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = request_lengths(args.requests, args.seed, args.max_seq_len)
    used = sum(lengths)
    contiguous = args.requests * args.max_seq_len
    paged = paged_allocation(lengths, args.block_size)
    fit_contiguous = args.budget_tokens // args.max_seq_len
    fit_paged = max_concurrent_paged(lengths, args.budget_tokens, args.block_size)

    print(
        f"$ python benchmarks/kv_waste.py --requests {args.requests} --max-seq-len "
        f"{args.max_seq_len} --block-size {args.block_size} --budget-tokens {args.budget_tokens}"
    )
    print(f"{args.requests} requests, {used} tokens in use (mean {used / args.requests:.0f})\n")
    print(f"{'':24}{'contiguous':>14}{'paged (block ' + str(args.block_size) + ')':>20}")
    print(f"{'slots allocated':24}{contiguous:>14,}{paged:>20,}")
    print(f"{'slots used':24}{used:>14,}{used:>20,}")
    waste_c, waste_p = contiguous - used, paged - used
    print(
        f"{'slots wasted':24}{f'{waste_c:,} ({waste_c / contiguous:.1%})':>14}"
        f"{f'{waste_p:,} ({waste_p / paged:.1%})':>20}"
    )
    mib = KV_BYTES_PER_TOKEN / 2**20
    print(f"{'KV MiB allocated':24}{contiguous * mib:>14.0f}{paged * mib:>20.0f}")
    print(
        f"{'max concurrent requests':24}{fit_contiguous:>14}{fit_paged:>20}"
        f"   (in {args.budget_tokens} token slots = {args.budget_tokens * mib:.0f} MiB)"
    )
    print(f"\npaged fits {fit_paged / max(fit_contiguous, 1):.1f}x the requests of contiguous")


if __name__ == "__main__":
    main()
