"""The router's one owner of calls to workers (router/worker_calls.py): no request to a worker is
built anywhere else, the retry rule is the table its docstring writes, and the retry loop and
deadlines behave so against scripted workers (real gRPC servers answering a chosen status: a
real worker cannot be made to answer RESOURCE_EXHAUSTED or hang on demand)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router import worker_calls
from router.chunks import SubRequest
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import PolicyContext, RouteRequest, make_policy
from router.worker_calls import Handoff, Retry, WorkerCalls, retry_rule
from services.registry import Fingerprint, Role, WorkerRecord

ROUTER = Path(__file__).resolve().parents[2] / "router"
OWNER = ROUTER / "worker_calls.py"
Code = grpc.StatusCode


def test_only_worker_calls_builds_a_request_to_a_worker_or_calls_one() -> None:
    built = re.compile(r"pb\.\w+Request\(|\w+ServiceStub\(")
    elsewhere = {
        f"{path.name}:{number}"
        for path in ROUTER.glob("*.py")
        if path != OWNER
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if built.search(line)
    }
    assert not elsewhere, f"requests to workers built outside worker_calls.py: {elsewhere}"
    assert len(built.findall(OWNER.read_text())) >= 4  # the pattern does find them


# status -> what the router does: the table of worker_calls.py's docstring.
RULES = {
    Code.UNAVAILABLE: Retry.ANOTHER_WORKER,
    Code.RESOURCE_EXHAUSTED: Retry.ANOTHER_WORKER,
    Code.ABORTED: Retry.SAME_WORKER,
    Code.DEADLINE_EXCEEDED: Retry.ANOTHER_WORKER,
    Code.CANCELLED: Retry.ANOTHER_WORKER,
    Code.INTERNAL: Retry.ANOTHER_WORKER,
    Code.UNKNOWN: Retry.ANOTHER_WORKER,
    Code.UNAUTHENTICATED: Retry.ANOTHER_WORKER,
    Code.INVALID_ARGUMENT: Retry.BAD_REQUEST,
}


@pytest.mark.parametrize("code", [c for c in Code if c != Code.OK], ids=lambda c: c.name)
def test_the_retry_rule_is_the_documented_table(code: grpc.StatusCode) -> None:
    assert retry_rule(code) == RULES.get(code, Retry.WORKER_ERROR)
    if code in RULES:
        assert code.name in (worker_calls.__doc__ or ""), f"{code.name} is not in the table"


# -- the loop against scripted workers ------------------------------------------------------

HANG = "hang"
FINGERPRINT = Fingerprint("m", "w", "t", 16, "float32", 1, 1, 8)


class Scripted(pb_grpc.DecodeServiceServicer, pb_grpc.PrefillServiceServicer):
    """Answers each call with the next scripted status (None: a normal answer; HANG: never)."""

    def __init__(self, script: list[Any]):
        self.script = script
        self.requests: list[Any] = []

    async def _next(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.requests.append(request)
        step = self.script.pop(0) if self.script else None
        if step == HANG:
            await asyncio.sleep(3600)
        if step is not None:
            await context.abort(step, "scripted")

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        await self._next(request, context)
        yield pb.GenerateChunk(index=0, text="ok", token_ids=[7], finish_reason="length")

    async def Prefill(self, request, context):  # type: ignore[no-untyped-def]
        await self._next(request, context)
        return pb.PrefillResponse(first_token=5, kv=pb.KVHandle(request_id=request.request_id))


async def serve(
    pool: Role, name: str, script: list[Any]
) -> tuple[grpc.aio.Server, Scripted, WorkerRecord]:
    servicer = Scripted(script)
    server = grpc.aio.server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    record = WorkerRecord(name, pool, f"127.0.0.1:{port}", "", "tcp", "m", FINGERPRINT)
    return server, servicer, record


async def calls_to(config: RouterConfig) -> AsyncIterator[WorkerCalls]:
    context = PolicyContext(None, {})  # type: ignore[arg-type]  # round robin reads no view
    policy = make_policy("round_robin", context)
    calls = WorkerCalls(config, RouterMetrics(), dict.fromkeys(("prefill", "decode"), policy))
    try:
        yield calls
    finally:
        await calls.close()


def sub_request() -> SubRequest:
    return SubRequest("r", [1, 2, 3], SamplingParams(max_tokens=1))


async def generate(calls: WorkerCalls, workers: list[WorkerRecord], **kwargs: Any) -> list[str]:
    stream = calls.generate(
        "decode", sub_request(), RouteRequest([1, 2, 3]), lambda: workers, **kwargs
    )
    return [chunk.text async for chunk in stream]


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.INTERNAL])
def test_a_refused_call_goes_to_another_worker(code: grpc.StatusCode) -> None:
    async def run() -> None:
        s1, first, w1 = await serve("decode", "d1", [code])
        s2, second, w2 = await serve("decode", "d2", [])
        async for calls in calls_to(RouterConfig()):
            assert await generate(calls, [w1, w2], first_choice=w1) == ["ok"]
        assert len(first.requests) == len(second.requests) == 1
        await asyncio.gather(s1.stop(None), s2.stop(None))

    asyncio.run(run())


def test_an_invalid_request_is_a_400_and_never_retried() -> None:
    async def run() -> None:
        s1, first, w1 = await serve("decode", "d1", [Code.INVALID_ARGUMENT])
        s2, second, w2 = await serve("decode", "d2", [])
        async for calls in calls_to(RouterConfig()):
            with pytest.raises(APIError) as raised:
                await generate(calls, [w1, w2], first_choice=w1)
        assert raised.value.status == 400
        assert (len(first.requests), len(second.requests)) == (1, 0)
        await asyncio.gather(s1.stop(None), s2.stop(None))

    asyncio.run(run())


def test_aborted_asks_the_same_decode_worker_again_with_the_first_token() -> None:
    async def run() -> None:
        s1, first, w1 = await serve("decode", "d1", [Code.ABORTED])
        s2, second, w2 = await serve("decode", "d2", [])
        handoff = Handoff(pb.KVHandle(request_id="h"), w1)
        async for calls in calls_to(RouterConfig()):
            decoding = asyncio.ensure_future(
                generate(calls, [w1, w2], first_choice=w1, handoff=handoff)
            )
            await asyncio.sleep(0.3)
            assert len(first.requests) == 1 and not decoding.done()  # waits for the token
            handoff.know(pb.PrefillResponse(first_token=5))
            assert await decoding == ["ok"]
            assert handoff.taken
        assert [r.HasField("first_token") for r in first.requests] == [False, True]
        assert first.requests[1].first_token == 5 and not second.requests
        await asyncio.gather(s1.stop(None), s2.stop(None))

    asyncio.run(run())


def test_every_worker_failing_is_a_503_after_max_attempts() -> None:
    async def run() -> None:
        servers = [await serve("decode", f"d{i}", [Code.UNAVAILABLE]) for i in range(4)]
        async for calls in calls_to(RouterConfig(max_attempts=3)):
            with pytest.raises(APIError) as raised:
                await generate(calls, [w for _, _, w in servers])
        assert raised.value.status == 503
        assert sum(len(s.requests) for _, s, _ in servers) == 3
        await asyncio.gather(*(server.stop(None) for server, _, _ in servers))

    asyncio.run(run())


def test_a_prefill_worker_that_never_answers_costs_the_request_its_deadline_not_more() -> None:
    """Each prefill attempt had 120 s of its own, and the decode call 600 s more after them;
    now every call gets what is left of the request's one deadline."""

    async def run() -> None:
        s1, first, w1 = await serve("prefill", "p1", [HANG, HANG, HANG])
        config = RouterConfig(request_timeout_seconds=1.0, prefill_timeout_seconds=60.0)
        async for calls in calls_to(config):
            started = time.monotonic()
            with pytest.raises(APIError) as raised:
                await calls.prefill(sub_request(), RouteRequest([1, 2, 3]), lambda: [w1])
            assert time.monotonic() - started < 5.0
        assert raised.value.status == 504
        await s1.stop(None)

    asyncio.run(run())


def test_a_decode_retry_waits_for_the_first_token_no_longer_than_the_deadline() -> None:
    async def run() -> None:
        s1, _, w1 = await serve("decode", "d1", [Code.ABORTED])
        handoff = Handoff(pb.KVHandle(request_id="h"), w1)  # the first token never comes
        async for calls in calls_to(RouterConfig(request_timeout_seconds=1.0)):
            started = time.monotonic()
            with pytest.raises(APIError) as raised:
                await generate(calls, [w1], handoff=handoff)
            assert time.monotonic() - started < 5.0
        assert raised.value.status == 504
        await s1.stop(None)

    asyncio.run(run())


def test_aborted_asks_the_same_prefill_worker_again() -> None:
    """A prefill worker answers ABORTED when the request's pin ended while it computed: the
    worker is fine (with one prefill worker, counting it failed would end the request)."""

    async def run() -> None:
        s1, first, w1 = await serve("prefill", "p1", [Code.ABORTED])
        async for calls in calls_to(RouterConfig()):
            handoff = await calls.prefill(sub_request(), RouteRequest([1, 2, 3]), lambda: [w1])
        assert handoff.prefill == w1 and handoff.answer is not None
        assert [r.request_id for r in first.requests] == ["r-p0", "r-p1"]
        await s1.stop(None)

    asyncio.run(run())
