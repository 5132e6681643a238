"""KV transfer throughput of each available transport vs a same-process memcpy, on loopback.

For the default model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, block
size 16, float32 = 720 KiB per block) and prompt lengths of 16..4096 tokens, a server in
another process serves scattered blocks of its KV pool, and a client in this process pulls
them; the reference is ``torch.index_select`` of the same blocks in this process (the gather a
sender must do anyway: the physical limit of a copy). Reports the median of ``--repeats``
pulls: milliseconds per transfer (compare with TTFT), GB/s, and the transport's time as a
multiple of the memcpy time. Also times the per-block checksum (crc32 vs adler32).

    python benchmarks/kv_transfer.py [--transports tcp torch ucx] [--tokens 16 64 256 1024 4096]

Results go to ``benchmarks/results/kv_transfer-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import median_seconds  # noqa: E402  (benchmarks/machine.py)

from kvtransfer import KVLayout, available_transports, make_client  # noqa: E402
from kvtransfer.base import tensor_bytes  # noqa: E402
from kvtransfer.server_process import ServerProcess, ServerSpec, make_kv_cache  # noqa: E402

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
RESULTS = Path(__file__).resolve().parent / "results"


def block_sets(tokens: list[int], num_blocks: int, seed: int) -> dict[int, list[int]]:
    """Scattered block ids (as a paged pool hands them out) for each prompt length."""
    rng = random.Random(seed)
    return {n: rng.sample(range(num_blocks), -(-n // LAYOUT.block_size)) for n in tokens}


def synchronized(fn: Callable[[], Any], device: torch.device) -> Callable[[], None]:
    """``fn`` that returns once the device has finished its work (a GPU runs asynchronously)."""

    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return call


def time_memcpy(
    kv: torch.Tensor, sets: dict[int, list[int]], args: argparse.Namespace
) -> dict[int, float]:
    out = {}
    for n, ids in sets.items():
        index = torch.tensor(ids, device=kv.device)
        gather = functools.partial(torch.index_select, kv, 0, index)
        if args.reuse_buffer:
            gather = functools.partial(gather, out=LAYOUT.empty_blocks(len(ids), kv.device))
        out[n] = median_seconds(synchronized(gather, kv.device), args.repeats, 2)
    return out


def time_transport(
    transport: str, sets: dict[int, list[int]], args: argparse.Namespace, bar: tqdm
) -> dict[int, float]:
    spec = ServerSpec(
        transport,
        LAYOUT,
        args.num_blocks,
        seed=args.seed,
        token="bench",
        pins={f"r{n}": ids for n, ids in sets.items()},
        num_threads=args.threads,
        device=args.device,
        options={"device": args.device} if transport == "torch" else {},
    )
    results: dict[int, float] = {}
    with ServerProcess(spec) as server:

        async def run() -> None:
            client = make_client(transport, token="bench", device=args.device)
            for n, ids in sets.items():
                times = []
                out = LAYOUT.empty_blocks(len(ids), args.device) if args.reuse_buffer else None
                for i in range(args.warmup + args.repeats):
                    start = time.perf_counter()
                    await client.pull(server.address, f"r{n}", ids, LAYOUT, 60.0, out=out)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - start)
                results[n] = statistics.median(times)
                bar.update(1)
            await client.close()

        asyncio.run(run())
    return results


def map_list(fn: Callable[[memoryview], int], rows: list[memoryview]) -> list[int]:
    return [fn(row) for row in rows]


def time_checksums(kv: torch.Tensor) -> dict[str, float]:
    """GB/s of crc32 and adler32 over 64 blocks (one per block, as block_checksums does)."""
    rows = [tensor_bytes(row) for row in kv[:64]]
    nbytes = sum(r.nbytes for r in rows)
    speeds = {}
    for name, fn in (("crc32", zlib.crc32), ("adler32", zlib.adler32)):
        seconds = median_seconds(functools.partial(map_list, fn, rows), 5, 1)
        speeds[name] = nbytes / seconds / 1e9
    return speeds


def print_table(rows: list[dict[str, Any]], transports: list[str]) -> None:
    head = f"{'tokens':>6} {'blocks':>6} {'MiB':>8} | {'memcpy ms':>9} {'GB/s':>6}"
    for t in transports:
        head += f" | {t + ' ms':>9} {'GB/s':>6} {'x memcpy':>8}"
    print(head)
    print("-" * len(head))
    for row in rows:
        line = (
            f"{row['tokens']:>6} {row['blocks']:>6} {row['bytes'] / 2**20:>8.1f} | "
            f"{row['memcpy_s'] * 1e3:>9.3f} {row['memcpy_gbps']:>6.2f}"
        )
        for t in transports:
            r = row["transports"][t]
            line += f" | {r['seconds'] * 1e3:>9.3f} {r['gbps']:>6.2f} {r['x_memcpy']:>8.2f}"
        print(line)


def time_prefill(tokens: list[int], threads: int) -> dict[int, float]:
    """Seconds the default model takes to prefill each prompt length (one request, cold cache):
    the compute part of TTFT that a transfer of the same prompt's KV adds to."""
    from common.sampling_params import SamplingParams
    from services.engine.llm import LLM

    llm = LLM(num_blocks=max(tokens) // 16 + 8, num_threads=threads, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([list(range(100, 116))], params)  # warm-up
    seconds = {}
    for n in tqdm(tokens, desc="prefill (TTFT)", unit="size"):
        prompt = [(7 * i) % 40000 + 100 for i in range(n)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        seconds[n] = time.perf_counter() - start
    return seconds


def print_ttft_share(rows: list[dict[str, Any]], prefill: dict[int, float]) -> None:
    print("\ntransfer as a share of TTFT (prefill on 1 worker + the fastest transfer):")
    print(f"{'tokens':>6} | {'prefill ms':>10} | {'best transport':>14} {'ms':>8} | {'share':>6}")
    for row in rows:
        n = row["tokens"]
        if n not in prefill:
            continue
        name, best = min(row["transports"].items(), key=lambda item: item[1]["seconds"])
        transfer = best["seconds"]
        share = transfer / (prefill[n] + transfer)
        print(
            f"{n:>6} | {prefill[n] * 1e3:>10.1f} | {name:>14} {transfer * 1e3:>8.2f} | "
            f"{share:>6.1%}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=list(available_transports()))
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=512, help="KV pool size (blocks)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="where both KV pools live (cuda: the GPU's memory)"
    )
    parser.add_argument(
        "--reuse-buffer",
        action="store_true",
        help="receive (and memcpy) into one preallocated tensor instead of a fresh one per pull",
    )
    parser.add_argument(
        "--ttft-max-tokens",
        type=int,
        default=1024,
        help="also time the model's prefill up to this prompt length (0: skip) for TTFT shares",
    )
    args = parser.parse_args()
    assert args.num_blocks * LAYOUT.block_size >= max(args.tokens), "pool too small"
    return args


def result_rows(
    sets: dict[int, list[int]], memcpy: dict[int, float], timings: dict[str, dict[int, float]]
) -> list[dict[str, Any]]:
    rows = []
    for n, ids in sets.items():
        nbytes = len(ids) * LAYOUT.bytes_per_block
        per_transport = {
            t: {"seconds": s[n], "gbps": nbytes / s[n] / 1e9, "x_memcpy": s[n] / memcpy[n]}
            for t, s in timings.items()
        }
        rows.append(
            {
                "tokens": n,
                "blocks": len(ids),
                "bytes": nbytes,
                "memcpy_s": memcpy[n],
                "memcpy_gbps": nbytes / memcpy[n] / 1e9,
                "transports": per_transport,
            }
        )
    return rows


def save(args: argparse.Namespace, rows: list[dict[str, Any]], checksums: dict[str, float]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"kv_transfer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {
        "layout": LAYOUT.__dict__,
        "bytes_per_block": LAYOUT.bytes_per_block,
        "repeats": args.repeats,
        "threads": args.threads,
        "reuse_buffer": args.reuse_buffer,
        "transports": args.transports,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows, "checksum_gbps": checksums}, indent=2))
    print(f"saved {path}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kv = make_kv_cache(LAYOUT, args.num_blocks, args.seed)
    sets = block_sets(args.tokens, args.num_blocks, args.seed)
    memcpy = time_memcpy(kv.to(args.device), sets, args)
    checksums = time_checksums(kv)
    # ucx last: once ucxx is initialized, its progress thread stays in this process.
    order = sorted(args.transports, key=lambda name: name == "ucx")
    timings = {}
    with tqdm(total=len(args.transports) * len(sets), desc="kv transfer", unit="size") as bar:
        for transport in order:
            bar.set_postfix_str(transport)
            try:
                timings[transport] = time_transport(transport, sets, args, bar)
            except Exception as error:  # one transport failing here says why, the rest still run
                print(f"\n{transport}: FAILED on {args.device}: {type(error).__name__}: {error}")
    args.transports = [t for t in args.transports if t in timings]
    timings = {t: timings[t] for t in args.transports}
    print(
        f"\nKV transfer on loopback, {args.device}, {LAYOUT} ({LAYOUT.bytes_per_block} B/block), "
        f"median of {args.repeats}, {args.threads} torch thread(s) per process, "
        f"{'reused' if args.reuse_buffer else 'fresh'} output buffers"
    )
    rows = result_rows(sets, memcpy, timings)
    print_table(rows, args.transports)
    print("checksum speed (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in checksums.items()))
    save(args, rows, checksums)
    ttft_tokens = [n for n in args.tokens if n <= args.ttft_max_tokens]
    if ttft_tokens:
        print_ttft_share(rows, time_prefill(ttft_tokens, args.threads))


if __name__ == "__main__":
    main()
