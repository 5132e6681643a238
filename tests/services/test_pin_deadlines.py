"""A pin's life on a real prefill worker is bounded by its lease, whatever the peers do.

A streamed prefill whose lease runs out while its prompt still computes ends its PrefillStream at
once with ABORTED (it used to wait for engine events that never came) and frees its blocks; a
late Release naming an earlier attempt's handle does not end a newer pin of the same request id.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.wire import params_to_proto
from pdserve import SamplingParams
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from tests.services.workers import AUTH, running, used_blocks

LEASE_SECONDS = 0.5
# 16 tokens a step over ~1,900 tokens: ~120 steps, far longer than the lease on any machine.
PROMPT = [5 + (i * 7) % 1000 for i in range(1900)]
PARAMS = SamplingParams(temperature=0, max_tokens=4)


def wait_until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def prefill_worker(redis_server):  # type: ignore[no-untyped-def]
    args = [
        "--redis-url",
        redis_server.url,
        "--redis-prefix",
        "pin-deadlines:",
        "--lease-seconds",
        str(LEASE_SECONDS),
        "--max-num-batched-tokens",
        "16",
    ]
    with running([("prefill", args)]) as (p,):
        yield p


def request(request_id: str) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=request_id, token_ids=PROMPT, sampling=params_to_proto(PARAMS)
    )


async def expire_while_computing(address: str) -> tuple[pb.KVHandle, grpc.StatusCode, str, float]:
    """Open a PrefillStream, take its handle, never renew: (handle, status, detail, seconds
    from the handle to the stream's end)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
            request("lapsed"), timeout=30, metadata=AUTH
        )
        handle = (await call.read()).kv
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.read()
        return handle, failed.value.code(), failed.value.details() or "", time.monotonic() - start


def test_a_lease_that_runs_out_while_the_prompt_computes_ends_the_stream(prefill_worker):
    address = prefill_worker.info["grpc_address"]
    handle, code, detail, seconds = asyncio.run(expire_while_computing(address))
    assert code == grpc.StatusCode.ABORTED and "lease ended" in detail
    assert handle.streaming and handle.request_id != "lapsed"  # a handle of its own
    assert seconds < LEASE_SECONDS + 3.0  # the lease and the reaper's tick, not 120 s
    assert wait_until(lambda: used_blocks(prefill_worker) == 0, 5)


async def stale_release(address: str) -> tuple[bool, bool, pb.PrefillResponse]:
    """Two whole prefills of one request id; the first's Release comes again after the second
    pinned: (the first Release, the late one, the second's answer)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillServiceStub(channel)
        short = pb.PrefillRequest(
            request_id="again", token_ids=PROMPT[:40], sampling=params_to_proto(PARAMS)
        )
        first = await stub.Prefill(short, timeout=30, metadata=AUTH)
        old = pb.ReleaseRequest(request_id=first.kv.request_id)
        released = (await stub.Release(old, timeout=10, metadata=AUTH)).released
        second = await stub.Prefill(short, timeout=30, metadata=AUTH)
        late = (await stub.Release(old, timeout=10, metadata=AUTH)).released
        renew = pb.RenewLeaseRequest(request_id=second.kv.request_id)
        assert (await stub.RenewLease(renew, timeout=10, metadata=AUTH)).renewed
        new = pb.ReleaseRequest(request_id=second.kv.request_id)
        assert (await stub.Release(new, timeout=10, metadata=AUTH)).released
        return released, late, second


def test_a_late_release_of_an_earlier_attempt_leaves_the_newer_pin(prefill_worker):
    released, late, second = asyncio.run(stale_release(prefill_worker.info["grpc_address"]))
    assert released and not late
    assert second.kv.request_id.startswith("again")
    assert wait_until(lambda: used_blocks(prefill_worker) == 0, 5)
