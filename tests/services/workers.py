"""Helpers for service tests: start real worker processes, call them over real gRPC, read their
real /metrics. Calls present the cluster token the test session's workers share (conftest)
unless a test passes its own ``metadata``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from common.sampling_params import SamplingParams
from common.wire import Metadata, params_to_proto, token_metadata
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.worker.launcher import WorkerProcess

AUTH: Metadata = token_metadata(os.environ.get("PDSERVE_CLUSTER_TOKEN"))
SMALL = [
    "--num-blocks",
    "128",
    "--threads",
    "1",
    "--heartbeat-seconds",
    "0.5",
    "--ttl-seconds",
    "2",
]


def start_workers(
    specs: list[tuple[str, list[str]]], env: dict[str, str] | None = None
) -> list[WorkerProcess]:
    """Start several workers at once (their model loads overlap) and wait for all."""
    workers = [WorkerProcess(role, [*SMALL, *args], env=env) for role, args in specs]
    for w in workers:
        w.spawn()
    try:
        for w in workers:
            w.wait_ready()
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers


@contextmanager
def running(
    specs: list[tuple[str, list[str]]], env: dict[str, str] | None = None
) -> Iterator[list[WorkerProcess]]:
    workers = start_workers(specs, env)
    try:
        yield workers
    except BaseException:
        for w in workers:  # the workers' own words explain most failures
            print(f"--- {w.role} worker output ---\n{w.output_tail()}")
        raise
    finally:
        stop_all(workers)


def stop_all(processes: list[WorkerProcess], timeout: float = 10.0) -> None:
    """SIGTERM (drain) to every live process, then wait for each (SIGKILL after ``timeout``)."""
    live = [p for p in processes if p.is_alive()]
    for process in live:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in live:
        assert process.proc is not None
        try:
            process.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def metric(worker: WorkerProcess, name: str, labels: str = "") -> float:
    """One sample from the worker's Prometheus endpoint (0 when absent)."""
    url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def used_blocks(worker: WorkerProcess) -> float:
    return metric(worker, "pdserve_kv_blocks", 'state="used"')


@dataclass
class Result:
    first_token: int | None = None
    token_ids: list[int] = field(default_factory=list)  # all output tokens, first included
    text: str = ""
    finish_reason: str = ""
    kv_source: str = ""
    num_cached_prefill: int = 0
    num_cached_decode: int = 0
    handle: pb.KVHandle | None = None


async def prefill(
    address: str, request_id: str, prompt: list[int], params: SamplingParams, metadata=AUTH
) -> pb.PrefillResponse:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillServiceStub(channel)
        return await stub.Prefill(
            pb.PrefillRequest(
                request_id=request_id, token_ids=prompt, sampling=params_to_proto(params)
            ),
            timeout=60,
            metadata=metadata,
        )


async def generate(
    address: str,
    request: pb.GenerateRequest,
    result: Result,
    max_chunks: int | None = None,
    metadata=AUTH,
) -> Result:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        call = stub.Generate(request, timeout=120, metadata=metadata)
        count = 0
        async for chunk in call:
            result.token_ids += chunk.token_ids
            result.text += chunk.text
            result.kv_source = chunk.kv_source
            result.num_cached_decode = chunk.num_cached_tokens
            if chunk.finish_reason:
                result.finish_reason = chunk.finish_reason
            count += 1
            if max_chunks is not None and count >= max_chunks:
                call.cancel()
                break
    return result


async def disaggregated(
    p_address: str,
    d_address: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    before_generate=None,
    max_chunks: int | None = None,
    metadata=AUTH,
) -> Result:  # type: ignore[no-untyped-def]
    """The router's flow: Prefill on P, then Generate on D with the first token and KVHandle."""
    answer = await prefill(p_address, request_id, prompt, params, metadata)
    result = Result(
        first_token=answer.first_token,
        token_ids=[answer.first_token],
        text=answer.first_text,
        num_cached_prefill=answer.num_cached_tokens,
        handle=answer.kv,
    )
    if answer.finish_reason:
        result.finish_reason = answer.finish_reason
        return result
    if before_generate is not None:
        await before_generate(answer)
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=params_to_proto(params),
        first_token=answer.first_token,
        first_logprobs=answer.logprobs,
        kv=answer.kv,
    )
    return await generate(d_address, request, result, max_chunks, metadata)


async def streamed(
    p_address: str,
    d_address: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    metadata=AUTH,
) -> Result:  # type: ignore[no-untyped-def]
    """The router's streamed flow: PrefillStream on P; Generate on D with the streaming handle
    as soon as it comes (D pulls while P computes); the first token from P's answer."""
    async with grpc.aio.insecure_channel(p_address) as channel:
        call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
            pb.PrefillRequest(
                request_id=request_id, token_ids=prompt, sampling=params_to_proto(params)
            ),
            timeout=60,
            metadata=metadata,
        )
        handle = (await call.read()).kv  # the first event; the answer follows
        assert handle.streaming and not handle.checksums
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=params_to_proto(params),
            kv=handle,
        )
        decoding = asyncio.create_task(generate(d_address, request, Result(), metadata=metadata))
        answer = (await call.read()).done
    result = Result(
        first_token=answer.first_token,
        token_ids=[answer.first_token],
        text=answer.first_text,
        num_cached_prefill=answer.num_cached_tokens,
        handle=handle,
        finish_reason=answer.finish_reason,
    )
    if answer.finish_reason:  # nothing to decode: the decode call is dropped
        decoding.cancel()
        return result
    decoded = await decoding
    result.token_ids += decoded.token_ids
    result.text += decoded.text
    result.finish_reason = decoded.finish_reason
    result.kv_source = decoded.kv_source
    result.num_cached_decode = decoded.num_cached_decode
    return result


async def colocated(
    address: str, request_id: str, prompt: list[int], params: SamplingParams
) -> Result:
    request = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=params_to_proto(params)
    )
    return await generate(address, request, Result())


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)
