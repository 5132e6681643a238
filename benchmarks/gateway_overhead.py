"""What the router (gateway) adds to a request: latency per request and requests/s sustained.

The workers here are fakes that answer instantly, in a process of their own: a prefill service
whose ``Prefill`` returns a first token and a small KVHandle at once, and a decode service whose
``Generate`` streams the remaining ``max_tokens - 1`` tokens, one chunk each, without waiting.
Fakes are right here and nowhere else: the point is to measure the router alone, and a real
model would bury its overhead under a hundred milliseconds of compute per token. They register
in a real Redis (started here) with the fingerprint the real router expects (model
SmolLM2-135M-Instruct and its tokenizer hash), and the real router runs as its own process
(``pdserve router``, uvicorn + FastAPI + grpc.aio), exactly as deployed.

Measured, side by side in one run (the modes take turns request by request, so a change in the
machine's load hits them alike), with sequential requests from one client:

- direct: the client does what the router does, on the same fake workers: grpc.aio ``Prefill``,
  then ``Generate`` streaming every chunk (the floor: no HTTP, no JSON, no routing);
- router: ``POST /v1/completions`` (``max_tokens`` 16, a 40-token prompt), non-streaming, on one
  keep-alive connection of a bare HTTP/1.1 client (`RawHTTP`): httpx spends about a millisecond
  of its own per request, which would otherwise be billed to the router;
- router stream: the same with ``stream: true``, to the last byte (and to the first event);
- router, httpx: the non-streaming request from a keep-alive ``httpx.AsyncClient``, i.e. what a
  Python client sees, its own cost included;
- router /health: ``GET /health``, the HTTP floor (uvicorn + FastAPI, no work).

Added latency = p50(router) - p50(direct); the issue's target is < 2 ms at p50. Then
throughput: ``--total`` requests at concurrency ``--concurrency`` through the router
(non-streaming, one connection per concurrent loop) and directly on the workers, in requests/s,
with the CPU time each process spent per request (from /proc), so that on a small machine one
sees which process saturates a core first. ``--profile PATH`` runs the router under cProfile for
the measured part (not its start-up) and prints its CPU time per area (asyncio, grpc, HTTP
stack, Redis, tokenizer, ...) and its top functions; the latencies of such a run are inflated.

    python benchmarks/gateway_overhead.py [--requests 500] [--concurrency 32] [--total 2000]
    python benchmarks/gateway_overhead.py --router-arg=--prefill-policy --router-arg=least_loaded
    python benchmarks/gateway_overhead.py --requests 300 --profile /tmp/router.prof

Prints the command, the machine and the tables; writes gateway_overhead.json and a latency CDF
(gateway_overhead.png, when matplotlib is installed) to --out-dir (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import shlex
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine_info  # noqa: E402  (benchmarks/machine.py)

from protos import pdserve_pb2 as pb  # noqa: E402
from protos import pdserve_pb2_grpc as pb_grpc  # noqa: E402
from services.worker.launcher import WorkerProcess  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# Three sentences, ~40 tokens: two full 16-token blocks, so the prefix-aware policy does its
# Redis lookup as it would for a real prompt.
PROMPT = (
    "The router speaks the OpenAI API in front of the workers. It picks a prefill worker and a "
    "decode worker for every request. Then it relays the tokens back to the client as they come."
)
TOKEN_ID, TOKEN_TEXT = 1000, " word"
LAYOUT = pb.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]  # what the router uses
TIMEOUT = 30.0
MODES = {
    "direct": "direct gRPC (Prefill + Generate)",
    "router": "router POST /v1/completions",
    "router_stream": "router stream=true (last byte)",
    "router_httpx": "router, httpx client",
    "health": "router GET /health (HTTP floor)",
}

# -- the fake workers (their own process and event loop) ----------------------------------------


class FakePrefill(pb_grpc.PrefillServiceServicer):
    """Answers Prefill at once: a first token and a KVHandle that points back at itself."""

    def __init__(self, worker_id: str, fingerprint_key: str):
        self.worker_id, self.fingerprint_key = worker_id, fingerprint_key
        self.address = ""  # its own gRPC address, set once it listens

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        blocks = max(1, -(-len(request.token_ids) // LAYOUT.block_size))
        kv = pb.KVHandle(
            request_id=request.request_id,
            prefill_worker_id=self.worker_id,
            transport="tcp",
            address="127.0.0.1:1",
            block_ids=list(range(blocks)),
            num_tokens=len(request.token_ids),
            layout=LAYOUT,
            checksums=[12345] * blocks,
            lease_expires_unix_ms=int(time.time() * 1000) + 30_000,
            fingerprint=self.fingerprint_key,
            release_address=self.address,
        )
        done = "length" if request.sampling.max_tokens <= 1 else ""
        return pb.PrefillResponse(
            first_token=TOKEN_ID, kv=kv, first_text=TOKEN_TEXT, finish_reason=done
        )

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=True)

    async def RenewLease(self, request: Any, context: Any) -> pb.RenewLeaseResponse:
        return pb.RenewLeaseResponse(renewed=True)


class FakeDecode(pb_grpc.DecodeServiceServicer):
    """Streams the tokens after the first one, one chunk each, with no delay."""

    async def Generate(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateChunk]:
        remaining = max(0, (request.sampling.max_tokens or 16) - 1)
        for i in range(remaining):
            yield pb.GenerateChunk(
                token_ids=[TOKEN_ID],
                text=TOKEN_TEXT,
                finish_reason="length" if i == remaining - 1 else "",
                num_prompt_tokens=len(request.prompt_token_ids),
                kv_source="pulled" if i == 0 else "",
            )


async def start_grpc(add: Callable[[grpc.aio.Server], None]) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def serve_fakes(
    fingerprint: dict[str, Any], redis_url: str, prefix: str, token: str, conn: Any
) -> None:
    from services.registry import (
        Fingerprint,
        RegistryConfig,
        Role,
        WorkerRecord,
        WorkerRegistration,
    )

    fp = Fingerprint.from_dict(fingerprint)
    fake_prefill = FakePrefill(f"prefill-fake-{uuid.uuid4().hex[:6]}", fp.key())
    prefill, prefill_address = await start_grpc(
        lambda s: pb_grpc.add_PrefillServiceServicer_to_server(fake_prefill, s)
    )
    fake_prefill.address = prefill_address
    decode, decode_address = await start_grpc(
        lambda s: pb_grpc.add_DecodeServiceServicer_to_server(FakeDecode(), s)
    )
    # signed with the router's cluster token: the router lists only records that prove it
    registry = RegistryConfig(redis_url=redis_url, prefix=prefix, cluster_token=token)
    fakes: list[tuple[str, Role, str]] = [
        (fake_prefill.worker_id, "prefill", prefill_address),
        (f"decode-fake-{uuid.uuid4().hex[:6]}", "decode", decode_address),
    ]
    registrations = [
        WorkerRegistration(
            registry,
            WorkerRecord(i, role, a, "127.0.0.1:1", "tcp", MODEL, fp, kv_blocks_total=4096),
        )
        for i, role, a in fakes
    ]
    for registration in registrations:
        await registration.register()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    conn.send({"prefill": prefill_address, "decode": decode_address})
    await stop.wait()
    for registration in registrations:
        await registration.deregister()
    await asyncio.gather(prefill.stop(0.5), decode.stop(0.5))


def fakes_main(
    fingerprint: dict[str, Any], redis_url: str, prefix: str, token: str, conn: Any
) -> None:
    """Entry point of the fake workers' process."""
    asyncio.run(serve_fakes(fingerprint, redis_url, prefix, token, conn))


# -- the clients --------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request: seconds to the last byte, and to the first token where it applies."""

    total: float
    ttft: float | None = None


class Direct:
    """The router's work done by the client itself: Prefill, then Generate, over grpc.aio."""

    def __init__(self, addresses: dict[str, str], prompt_ids: list[int], max_tokens: int):
        from common.sampling_params import SamplingParams
        from common.wire import params_to_proto

        self.channels = [
            grpc.aio.insecure_channel(addresses[role], options=GRPC_OPTIONS)
            for role in ("prefill", "decode")
        ]
        self.prefill = pb_grpc.PrefillServiceStub(self.channels[0])
        self.decode = pb_grpc.DecodeServiceStub(self.channels[1])
        self.prompt_ids = prompt_ids
        self.sampling = params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens))
        self.max_tokens = max_tokens
        self.count = itertools.count()

    async def request(self) -> Sample:
        rid = f"direct-{next(self.count)}"
        start = time.perf_counter()
        answer = await self.prefill.Prefill(
            pb.PrefillRequest(request_id=rid, token_ids=self.prompt_ids, sampling=self.sampling),
            timeout=TIMEOUT,
        )
        ttft = time.perf_counter() - start
        text, tokens = answer.first_text, 1
        generate = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=self.prompt_ids,
            sampling=self.sampling,
            first_token=answer.first_token,
            first_logprobs=answer.logprobs,
            kv=answer.kv,
        )
        async for chunk in self.decode.Generate(generate, timeout=TIMEOUT):
            text += chunk.text
            tokens += len(chunk.token_ids)
        total = time.perf_counter() - start
        assert tokens == self.max_tokens, f"direct: {tokens} tokens"
        return Sample(total, ttft)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def http_request(method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
    """The bytes of one HTTP/1.1 request (JSON body)."""
    data = json.dumps(body).encode() if body is not None else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class RawHTTP:
    """A bare HTTP/1.1 keep-alive connection, one request at a time (Content-Length or chunked
    responses). Python HTTP clients cost about as much CPU per request as the router itself
    (httpx: over 1 ms here); this one costs a few tens of microseconds, so the router is timed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, url: str) -> RawHTTP:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def exchange(self, request: bytes) -> tuple[int, bytes, float, float]:
        """Send ``request``: (status, body, seconds to the first body chunk, to the last byte)."""
        start = time.perf_counter()
        self.writer.write(request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" in head:
            body, first = await self._chunked(start)
        else:
            length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            body = await self.reader.readexactly(length)
            first = time.perf_counter() - start
        return int(head[9:12]), body, first, time.perf_counter() - start

    async def _chunked(self, start: float) -> tuple[bytes, float]:
        parts, first = [], 0.0
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            parts.append((await self.reader.readexactly(size + 2))[:-2])
            first = first or time.perf_counter() - start
        await self.reader.readexactly(2)  # the CRLF after the last (empty) chunk
        return b"".join(parts), first

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


class ViaRouter:
    """OpenAI requests to the router: over a `RawHTTP` connection, or over httpx."""

    def __init__(self, conn: RawHTTP, http: httpx.AsyncClient, model: str, max_tokens: int):
        self.conn, self.http = conn, http
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        self.max_tokens = max_tokens
        self.plain = http_request("POST", "/v1/completions", self.body)
        self.streamed = http_request("POST", "/v1/completions", {**self.body, "stream": True})

    async def request(self) -> Sample:
        status, body, _, total = await self.conn.exchange(self.plain)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == self.max_tokens, body
        return Sample(total)

    async def stream(self) -> Sample:
        status, body, first, total = await self.conn.exchange(self.streamed)
        assert status == 200 and body.count(b"data: {") == self.max_tokens, body
        return Sample(total, first)

    async def health(self) -> Sample:
        status, body, _, total = await self.conn.exchange(http_request("GET", "/health"))
        assert status == 200, body
        return Sample(total)

    async def httpx_request(self) -> Sample:
        start = time.perf_counter()
        response = await self.http.post("/v1/completions", json=self.body)
        data = response.json()
        total = time.perf_counter() - start
        assert data["usage"]["completion_tokens"] == self.max_tokens, data
        return Sample(total)


# -- the set-up ---------------------------------------------------------------------------------


@dataclass
class Setup:
    """Redis, the fake workers' process and the router process, all started."""

    router_url: str
    addresses: dict[str, str]
    model: Any  # router.gateway.ModelInfo
    pids: dict[str, int] = field(default_factory=dict)
    start_profiling: Callable[[], None] = lambda: None  # once warmed up (with --profile)


# Runs `pdserve router` with cProfile off until SIGUSR1 (start-up, imports and model loading
# are not the gateway's per-request cost) and writes the stats when the router exits.
PROFILED_ROUTER = """
import cProfile, signal, sys
from pdserve.cli import main
profiler = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
try:
    main(sys.argv[2:])
finally:
    profiler.disable()
    profiler.dump_stats(sys.argv[1])
"""


class ProfiledRouter(WorkerProcess):
    """``pdserve router`` under cProfile once ``start_profiling``; stopped with SIGINT so that
    the stats get written (uvicorn re-raises SIGTERM after shutdown, killing it before that)."""

    def __init__(self, args: list[str], env: dict[str, str], path: Path):
        super().__init__("router", args, env, python_args=["-c", PROFILED_ROUTER, str(path)])
        self.path = path

    def start_profiling(self) -> None:
        self.signal(signal.SIGUSR1)

    def terminate(self, timeout: float = 30.0) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout)
        return super().terminate(timeout)


def start_fakes(fp: Any, redis_url: str, prefix: str, token: str) -> tuple[Any, dict[str, str]]:
    """The fake workers' process (spawned: a fresh interpreter, its own event loop)."""
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=fakes_main, args=(asdict(fp), redis_url, prefix, token, child), daemon=True
    )
    process.start()
    if not parent.poll(60):
        raise RuntimeError("the fake workers did not start")
    return process, parent.recv()


@asynccontextmanager
async def running_setup(args: argparse.Namespace) -> AsyncIterator[Setup]:
    from router.config import RouterConfig
    from router.gateway import ModelInfo
    from services.redis_server import RedisServer
    from services.registry import Fingerprint

    model = ModelInfo.load(RouterConfig())
    fp = Fingerprint(model.model_id, "fake", model.tokenizer_hash, 16, "float32", 30, 3, 64)
    prefix = f"bench{uuid.uuid4().hex[:6]}:"
    with RedisServer() as redis:
        token = uuid.uuid4().hex
        fakes, addresses = await asyncio.to_thread(start_fakes, fp, redis.url, prefix, token)
        flags = ["--port", "0", "--redis-url", redis.url, "--redis-prefix", prefix]
        # The flow the fakes implement and "direct" repeats: Prefill, then Generate with the
        # first token (not a local prefill on the decode worker, nor a streamed KV handle).
        flags += ["--disaggregation", "always", "--no-stream-kv"]
        flags += args.router_arg
        # A cluster token as in production (the router sends it on every call; the fakes
        # do not check it): the router refuses to start without one.
        env = {"PYTHONPATH": str(ROOT), "PDSERVE_CLUSTER_TOKEN": token}
        router = (
            ProfiledRouter(flags, env, args.profile)
            if args.profile
            else WorkerProcess("router", flags, env)
        )
        try:
            router.spawn()  # from this thread: the child dies with the thread that spawned it
            await asyncio.to_thread(router.wait_ready, 120.0)
            url = str(router.info["url"])
            await wait_ready(url)
            pids = {"router": router.pid, "fake workers": fakes.pid, "redis": redis.pid or 0}
            setup = Setup(url, addresses, model, {"client": os.getpid(), **pids})
            if isinstance(router, ProfiledRouter):
                setup.start_profiling = router.start_profiling
            yield setup
        finally:
            router.terminate(timeout=30)
            fakes.terminate()
            fakes.join(5)


async def wait_ready(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() < deadline:
            if (await client.get("/ready")).status_code == 200:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"the router at {url} did not become ready in {timeout}s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- measuring ----------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 and mean of ``values`` (seconds) in milliseconds."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(values) * 1e3}


async def latency(
    modes: Mapping[str, Callable[[], Awaitable[Sample]]], requests: int, warmup: int
) -> dict[str, list[Sample]]:
    """Sequential requests, the modes taking turns; the first ``warmup`` rounds are dropped."""
    samples: dict[str, list[Sample]] = {name: [] for name in modes}
    desc = "latency" if requests else "warm-up"
    for i in tqdm(range(warmup + requests), desc=desc, unit="round", file=sys.stderr):
        for name, fn in modes.items():
            sample = await fn()
            if i >= warmup:
                samples[name].append(sample)
    return samples


async def throughput(
    fns: Sequence[Callable[[], Awaitable[Sample]]], total: int, pids: dict[str, int], desc: str
) -> dict[str, Any]:
    """``total`` requests from ``len(fns)`` concurrent loops: req/s, latency, CPU per request."""
    counter = itertools.count()
    samples: list[float] = []
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)

    async def loop(fn: Callable[[], Awaitable[Sample]]) -> None:
        while next(counter) < total:
            samples.append((await fn()).total)
            bar.update(1)

    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    await asyncio.gather(*(loop(fn) for fn in fns))
    elapsed = time.perf_counter() - start
    bar.close()
    cpu_ms = {
        name: (cpu_seconds(pid) - cpu_before[name]) * 1e3 / total for name, pid in pids.items()
    }
    return {
        "requests": total,
        "concurrency": len(fns),
        "seconds": elapsed,
        "req_per_s": total / elapsed,
        "latency_ms": percentiles(samples),
        "cpu_ms_per_request": cpu_ms,
    }


async def measure_throughput(
    args: argparse.Namespace, setup: Setup, direct: Direct, http: httpx.AsyncClient
) -> dict[str, Any]:
    """Direct and via the router (one `RawHTTP` connection per concurrent loop)."""
    conns = [await RawHTTP.connect(setup.router_url) for _ in range(args.concurrency)]
    vias = [ViaRouter(c, http, setup.model.name, args.max_tokens) for c in conns]
    paths = {
        "direct": [direct.request] * args.concurrency,
        "router": [via.request for via in vias],
    }
    runs = {}
    for name, fns in paths.items():
        await throughput(fns, 4 * args.concurrency, {}, f"{name} warm-up")
        runs[name] = await throughput(fns, args.total, setup.pids, f"{name} throughput")
    for conn in conns:
        await conn.close()
    return runs


async def measure(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    prompt_ids = setup.model.tokenizer.encode(PROMPT)
    direct = Direct(setup.addresses, prompt_ids, args.max_tokens)
    conn = await RawHTTP.connect(setup.router_url)
    async with httpx.AsyncClient(base_url=setup.router_url, timeout=TIMEOUT) as http:
        via = ViaRouter(conn, http, setup.model.name, args.max_tokens)
        modes = {"direct": direct.request, "router": via.request, "router_stream": via.stream}
        modes |= {"router_httpx": via.httpx_request, "health": via.health}
        await latency(modes, 0, args.warmup)
        setup.start_profiling()
        samples = await latency(modes, args.requests, 0)
        runs = await measure_throughput(args, setup, direct, http)
    await conn.close()
    await direct.close()
    return {"prompt_tokens": len(prompt_ids), "samples": samples, "throughput": runs}


# -- reporting ----------------------------------------------------------------------------------


def summarize(samples: dict[str, list[Sample]]) -> dict[str, Any]:
    out = {}
    for name, rows in samples.items():
        ttfts = [s.ttft for s in rows if s.ttft is not None]
        out[name] = {
            "total_ms": percentiles([s.total for s in rows]),
            "ttft_ms": percentiles(ttfts) if ttfts else None,
        }
    return out


def print_latency(summary: dict[str, Any], args: argparse.Namespace, prompt_tokens: int) -> None:
    print(
        f"\nlatency, {args.requests} sequential requests per mode (after {args.warmup} warm-up), "
        f"prompt {prompt_tokens} tokens, max_tokens {args.max_tokens}:"
    )
    print(f"{'mode':<34}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'TTFT p50':>10}")
    for name, label in MODES.items():
        total, ttft = summary[name]["total_ms"], summary[name]["ttft_ms"]
        cells = "".join(f"{total[k]:>9.3f}" for k in ("p50", "p90", "p99", "mean"))
        print(f"{label:<34}{cells}{ttft['p50'] if ttft else float('nan'):>10.3f}")
    direct = summary["direct"]
    added = summary["router"]["total_ms"]["p50"] - direct["total_ms"]["p50"]
    verdict = "met" if added < 2.0 else "NOT met"
    print(f"router adds {added:.3f} ms at p50, non-streaming (target < 2 ms: {verdict})")
    stream = summary["router_stream"]
    print(
        f"router adds {stream['total_ms']['p50'] - direct['total_ms']['p50']:.3f} ms at p50 "
        f"streaming to the last byte, "
        f"{stream['ttft_ms']['p50'] - direct['ttft_ms']['p50']:.3f} ms to the first token"
    )
    httpx_ms = summary["router_httpx"]["total_ms"]["p50"] - direct["total_ms"]["p50"]
    print(
        f"with an httpx client (its own cost included) the router path is {httpx_ms:.3f} ms slower"
    )


def print_throughput(runs: dict[str, Any]) -> None:
    first = runs["direct"]
    print(
        f"\nthroughput, {first['requests']} non-streaming requests at concurrency "
        f"{first['concurrency']}:"
    )
    names = list(first["cpu_ms_per_request"])
    cpu_head = "".join(f"{n:>15}" for n in names)
    print(f"{'path':<10}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}   CPU ms/request:{cpu_head}")
    for path, run in runs.items():
        lat, cpu = run["latency_ms"], run["cpu_ms_per_request"]
        cells = "".join(f"{cpu[n]:>15.3f}" for n in names)
        print(
            f"{path:<10}{run['req_per_s']:>9.1f}{lat['p50']:>9.2f}{lat['p99']:>9.2f}{'':>18}{cells}"
        )
    ratio = runs["router"]["req_per_s"] / first["req_per_s"]
    print(
        f"router sustains {runs['router']['req_per_s']:.0f} req/s, {ratio:.2f}x the direct "
        f"path's {first['req_per_s']:.0f} req/s; router CPU "
        f"{runs['router']['cpu_ms_per_request']['router']:.3f} ms per request"
    )


# Where the router's CPU time goes, by the file (or the built-in's owner) a function lives in;
# the first match wins. "idle" is the event loop waiting for I/O: not work, left out of shares.
AREAS = [
    ("idle (epoll wait)", ("method 'poll' of 'select.epoll'",)),
    ("router/ (pdserve's gateway)", ("/router/",)),
    ("pydantic", ("pydantic",)),
    ("fastapi", ("fastapi",)),
    ("starlette", ("starlette",)),
    ("uvicorn + httptools", ("uvicorn", "httptools")),
    ("grpc (client)", ("grpc",)),
    ("protobuf", ("protobuf", "google._upb", "pdserve_pb2", "FromString", "SerializeToString")),
    ("redis client", ("/redis/",)),
    ("tokenizer", ("tokenizer",)),
    ("prometheus_client", ("prometheus_client",)),
    ("json", ("json",)),
    ("services/ (registry, convert, sampling)", ("/services/",)),
    ("asyncio", ("asyncio", "_contextvars", "selectors")),
    ("socket syscalls", ("socket", "_ssl")),
]


def area_of(filename: str, name: str) -> str:
    key = filename if filename != "~" else name
    for area, needles in AREAS:
        if any(n in key for n in needles):
            return area
    return "other"


def profile_summary(path: Path, requests: int, top: int = 20) -> dict[str, Any]:
    """The router's cProfile stats: CPU time per area and the top functions, per request."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    areas: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, calls, tottime, _, _) in stats.items():
        area = area_of(filename, name)
        areas[area] = areas.get(area, 0.0) + tottime
        functions.append((tottime, calls, f"{Path(filename).name}:{line}({name})", area))
    busy = sum(t for a, t in areas.items() if not a.startswith("idle"))
    print(
        f"\nrouter CPU under cProfile, per /v1/completions request ({requests} of them; the "
        f"/health calls included; cProfile slows Python code ~2x): {busy * 1e3 / requests:.3f} ms"
    )
    print(f"{'area':<42}{'ms/request':>11}{'share':>8}")
    for area, seconds in sorted(areas.items(), key=lambda item: -item[1]):
        share = "" if area.startswith("idle") else f"{seconds / busy:>8.1%}"
        print(f"{area:<42}{seconds * 1e3 / requests:>11.3f}{share}")
    print(f"\ntop {top} functions by own time:\n{'ms/request':>10}{'calls/req':>10}  function")
    for tottime, calls, where, _ in sorted(functions, reverse=True)[:top]:
        print(f"{tottime * 1e3 / requests:>10.3f}{calls / requests:>10.1f}  {where}")
    return {"areas_ms_per_request": {a: t * 1e3 / requests for a, t in areas.items()}}


def save_plot(path: Path, samples: dict[str, list[Sample]], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in MODES.items():
        ms = sorted(s.total * 1e3 for s in samples[name])
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency per request, ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="timed sequential requests")
    parser.add_argument("--warmup", type=int, default=50, help="untimed rounds first")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: loops at once")
    parser.add_argument("--total", type=int, default=2000, help="throughput: requests per path")
    parser.add_argument(
        "--router-arg", action="append", default=[], help="extra `pdserve router` flag (repeat)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run the router under cProfile, write its stats here and summarize them "
        "(slows the router: its latencies are then not the real ones)",
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    assert args.max_tokens >= 2, "max_tokens >= 2: one token from prefill, the rest decoded"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = machine_info(1)
    command = "python " + shlex.join(sys.argv)
    print(f"$ {command}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable, "
        f"load avg {machine['load_avg_1m_at_start']}), python {machine['python']}"
    )

    async def run() -> dict[str, Any]:
        async with running_setup(args) as setup:
            return await measure(args, setup)

    result = asyncio.run(run())
    summary = summarize(result["samples"])
    print_latency(summary, args, result["prompt_tokens"])
    print_throughput(result["throughput"])
    profile = None
    if args.profile:
        sent = args.requests * 3 + 4 * args.concurrency + args.total
        profile = profile_summary(args.profile, sent)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {
        "command": command,
        "machine": machine,
        "config": config,
        "prompt_tokens": result["prompt_tokens"],
        "latency": summary,
        "added_ms_p50": summary["router"]["total_ms"]["p50"] - summary["direct"]["total_ms"]["p50"],
        "throughput": result["throughput"],
        "profile": profile,
        "samples_ms": {
            k: [round(s.total * 1e3, 4) for s in v] for k, v in result["samples"].items()
        },
    }
    path = args.out_dir / "gateway_overhead.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    plot = args.out_dir / "gateway_overhead.png"
    title = f"router vs direct, instant fake workers, {machine['cores']} cores"
    saved = [path] + ([plot] if save_plot(plot, result["samples"], title) else [])
    print("saved " + " and ".join(str(p) for p in saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
