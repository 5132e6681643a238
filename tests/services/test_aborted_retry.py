"""ABORTED from a decode worker means "ask me again with the first token": a streamed pull that
failed before the prefill worker's first token came. The prefill must then go on to its first
token (the decode worker leaves the handle pinned instead of releasing it, which would abort a
prefill still computing), and the same request asked again with that token is served. Real
prefill and decode workers over tcp; the prefill worker drops every pull it serves."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.wire import params_to_proto
from pdserve import SamplingParams
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.router.cluster import wait_until
from tests.services.workers import AUTH, Result, generate, running, used_blocks

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(7 * i) % 30_000 + 100 for i in range(241)]  # 16k+1 tokens, some 15 chunks


def test_aborted_before_the_first_token_then_asked_again(redis_server, llm):  # type: ignore[no-untyped-def]
    base = ["--redis-url", redis_server.url, "--redis-prefix", "aborted:", "--kv-transport", "tcp"]
    slow_and_dropping = ["--max-num-batched-tokens", "16", "--kv-faults", "drop=1"]
    with running([("prefill", [*base, *slow_and_dropping]), ("decode", base)]) as (p, d):
        result = asyncio.run(_flow(p.info["grpc_address"], d.info["grpc_address"]))
        [want] = llm.generate([PROMPT], PARAMS)
        assert result.token_ids == want.outputs[0].token_ids
        assert result.kv_source == "recomputed"  # every pull is dropped
        for worker in (p, d):
            assert wait_until(lambda w=worker: used_blocks(w) == 0), f"{worker.role} leaked"


async def _flow(p_address: str, d_address: str) -> Result:
    request = pb.PrefillRequest(
        request_id="ab-1", token_ids=PROMPT, sampling=params_to_proto(PARAMS)
    )
    async with grpc.aio.insecure_channel(p_address) as channel:
        call = pb_grpc.PrefillServiceStub(channel).PrefillStream(request, timeout=60, metadata=AUTH)
        handle = (await call.read()).kv
        assert handle.streaming
        generate_request = pb.GenerateRequest(
            request_id="ab-d1",
            prompt_token_ids=PROMPT,
            sampling=params_to_proto(PARAMS),
            kv=handle,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(d_address, generate_request, Result())
        assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value.details()
        # The prefill goes on: its answer comes. Meanwhile the handle's holder (the router)
        # renews its lease, as whoever waits on a handle does.
        renewing = asyncio.ensure_future(_renew(channel, handle))
        try:
            event = await call.read()
        finally:
            renewing.cancel()
        assert event.HasField("done"), event
    generate_request.request_id = "ab-d2"
    generate_request.first_token = event.done.first_token
    result = Result(first_token=event.done.first_token, token_ids=[event.done.first_token])
    return await generate(d_address, generate_request, result)


async def _renew(channel: grpc.aio.Channel, handle: pb.KVHandle) -> None:
    stub = pb_grpc.PrefillServiceStub(channel)
    while True:
        await asyncio.sleep(0.5)
        request = pb.RenewLeaseRequest(request_id=handle.request_id)
        await stub.RenewLease(request, timeout=5, metadata=AUTH)
