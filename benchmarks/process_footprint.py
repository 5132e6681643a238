"""The start time and memory of pdserve's processes: the router and a worker, with the torch
import as a yardstick.

Starts ``pdserve router`` (a real Redis registry, no workers) ``--repeats`` times and measures
each start: from spawn to its ready line (it listens, its tokenizer is loaded), and its RSS
once it has answered ``/v1/models``. Beside it, a bare ``python -c "import torch"``: what the
router would pay on top if it imported the engine (it never does; tests/router/test_torch_free.py
checks that). Then ``pdserve decode`` (the default model, float32, one thread, 128 blocks, no
registry) as often: spawn to ready line, with the converted model, the compiled kernels and the
GEMM table already in the cache (one start first fills it). A worker start is what a restart, a
scale-out and most integration tests wait for. Each process is then stopped with SIGTERM (an
idle drain) and timed to its exit. Last, the pause of one full cycle collection in a process
that built ``LLM()``: with the startup heap walked, and frozen as the servers freeze it
(``common.heap``).

    python benchmarks/process_footprint.py [--repeats 5]

Prints medians; writes process_footprint.json to --out-dir (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine_info  # noqa: E402

from services.redis_server import RedisServer  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402


def process_start(
    role: str, args: list[str], then_get: str | None = None
) -> tuple[float, float, float]:
    """(seconds from spawn to ready, RSS in MiB, seconds from SIGTERM to exit) of one run of
    ``pdserve ROLE ARGS``; the RSS after a GET of ``then_get`` (a path on its HTTP address)
    where given, else once ready."""
    process = WorkerProcess(role, args)
    start = time.perf_counter()
    process.start()
    ready = time.perf_counter() - start
    try:
        if then_get is not None:
            httpx.get(str(process.info["url"]) + then_get, timeout=10).raise_for_status()
        assert process.proc is not None
        rss = psutil.Process(process.proc.pid).memory_info().rss / 2**20
    finally:
        stop = time.perf_counter()
        process.terminate(timeout=10)
    return ready, rss, time.perf_counter() - stop


def router_start(redis_url: str) -> tuple[float, float, float]:
    """One router start, its RSS after one request."""
    args = ["--port", "0", "--redis-url", redis_url, "--insecure"]
    return process_start("router", args, then_get="/v1/models")


def worker_start() -> tuple[float, float, float]:
    """One decode worker start (no --redis-url: no registry), its RSS once ready."""
    return process_start("decode", ["--num-blocks", "128", "--threads", "1", "--insecure"])


def torch_import() -> tuple[float, float]:
    """(seconds, RSS in MiB) of a bare interpreter importing torch."""
    code = (
        "import time, resource; t = time.perf_counter(); import torch; "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, max_rss_kib = out.stdout.split()
    return float(seconds), float(max_rss_kib) / 1024


def collection_pauses() -> tuple[float, float]:
    """(seconds of one full collection with the startup heap, then with it frozen), in a fresh
    interpreter that built ``LLM()`` as a worker does (collection off meanwhile)."""
    code = (
        "import gc, time; gc.disable(); from pdserve import LLM; "
        "llm = LLM(num_blocks=128, num_threads=1); gc.collect(); gc.enable(); "
        "t = time.perf_counter(); gc.collect(); walked = time.perf_counter() - t; gc.freeze(); "
        "t = time.perf_counter(); gc.collect(); print(walked, time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    walked, frozen = out.stdout.split()[-2:]
    return float(walked), float(frozen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    machine = machine_info(1)
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores")
    with RedisServer() as redis:
        starts = [router_start(redis.url) for _ in range(args.repeats)]
    imports = [torch_import() for _ in range(args.repeats)]
    worker_start()  # fills the cache where it is empty (model conversion, kernels, GEMM table)
    workers = [worker_start() for _ in range(args.repeats)]
    pauses = [collection_pauses() for _ in range(args.repeats)]
    result = {
        "router_ready_s": statistics.median(s for s, _, _ in starts),
        "router_rss_mib": statistics.median(r for _, r, _ in starts),
        "router_stop_s": statistics.median(t for _, _, t in starts),
        "torch_import_s": statistics.median(s for s, _ in imports),
        "torch_import_rss_mib": statistics.median(r for _, r in imports),
        "worker_ready_s": statistics.median(s for s, _, _ in workers),
        "worker_rss_mib": statistics.median(r for _, r, _ in workers),
        "worker_stop_s": statistics.median(t for _, _, t in workers),
        "full_collection_s": statistics.median(w for w, _ in pauses),
        "full_collection_frozen_s": statistics.median(f for _, f in pauses),
    }
    print(
        f"router: ready in {result['router_ready_s']:.2f} s, RSS {result['router_rss_mib']:.0f} MiB"
        f" after a request, SIGTERM to exit {result['router_stop_s']:.2f} s"
        f" (medians of {args.repeats})\n"
        f"for scale, `import torch` alone: {result['torch_import_s']:.2f} s, "
        f"{result['torch_import_rss_mib']:.0f} MiB max RSS\n"
        f"decode worker (float32, 1 thread, cache warm): ready in {result['worker_ready_s']:.2f} s,"
        f" RSS {result['worker_rss_mib']:.0f} MiB, SIGTERM to exit {result['worker_stop_s']:.2f} s"
        f" (medians of {args.repeats})\n"
        f"one full collection after LLM(): {1e3 * result['full_collection_s']:.0f} ms with the"
        f" startup heap, {1e3 * result['full_collection_frozen_s']:.1f} ms with it frozen"
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "process_footprint.json"
    path.write_text(json.dumps({"command": command, "machine": machine, **result}, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
