"""gRPC channels of peers that left are closed and dropped (``common.channels.ChannelPool``), with
real ``grpc.aio`` channels connected to real gRPC servers: by the pool itself, and by the router,
which prunes its channels to the addresses of the workers still in the registry (real Redis)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.channels import ChannelPool
from router import gateway as gateway_module
from router.config import RouterConfig
from router.gateway import Gateway, ModelInfo
from services.registry import Fingerprint, RegistryConfig, WorkerRecord, WorkerRegistration

FP = Fingerprint(
    model_id="m",
    weights_hash="ab" * 32,
    tokenizer_hash="cd" * 32,
    block_size=16,
    kv_dtype="float32",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


@asynccontextmanager
async def servers(count: int) -> AsyncIterator[list[str]]:
    """``count`` real gRPC servers (the standard health service) on 127.0.0.1; their addresses."""
    started: list[grpc.aio.Server] = []
    addresses = []
    try:
        for _ in range(count):
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            started.append(server)
            addresses.append(f"127.0.0.1:{port}")
        yield addresses
    finally:
        await asyncio.gather(*(s.stop(None) for s in started))


async def answers(channel: grpc.aio.Channel) -> bool:
    """A real call over ``channel`` succeeds."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def assert_closed(channel: grpc.aio.Channel) -> None:
    """Shut down: no call can use it any more."""
    assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    with pytest.raises(grpc.aio.UsageError, match="closed"):
        await answers(channel)


async def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)


def test_prune_closes_and_drops_the_channels_of_peers_that_left() -> None:
    """Three connected channels, pruned to one live address: the other two are shut down and
    gone from the pool (a later ``get`` opens a new channel); the live one is the same channel,
    still answering."""

    async def main() -> None:
        async with servers(3) as (a, b, c):
            pool = ChannelPool()
            opened = {address: pool.get(address) for address in (a, b, c)}
            assert [await answers(ch) for ch in opened.values()] == [True] * 3
            assert pool.get(a) is opened[a] and len(pool) == 3  # one channel per peer

            await pool.prune([a])

            assert len(pool) == 1
            assert pool.get(a) is opened[a]
            assert opened[a].get_state() == grpc.ChannelConnectivity.READY
            assert await answers(opened[a])
            for address in (b, c):
                await assert_closed(opened[address])
            again = pool.get(b)  # a peer that comes back gets a new channel
            assert again is not opened[b] and await answers(again)
            assert len(pool) == 2
            await pool.prune([])
            assert len(pool) == 0
            await assert_closed(opened[a])
            await assert_closed(again)

    run(main())


def test_a_channel_in_use_is_pruned_only_once_its_calls_end() -> None:
    """A peer that left while a call still uses its channel (a draining worker's last stream)
    keeps its channel until the call ends; the next prune closes it."""

    async def main() -> None:
        async with servers(2) as (live, gone):
            pool = ChannelPool()
            with pool.using(gone) as channel:
                with pool.using(gone):  # two calls on it
                    await pool.prune([live])
                await pool.prune([live])
                assert len(pool) == 1 and await answers(channel)
            await pool.prune([live])
            assert len(pool) == 0
            await assert_closed(channel)

    run(main())


def test_a_peer_restarted_at_its_address_gets_a_fresh_channel() -> None:
    """A worker restarted in place (a container keeps its IP and port) comes back under a new
    id: the old channel, which failed to connect while the address was down, is in gRPC's
    reconnect backoff; a call for the new id gets a new channel that answers at once (the
    compose rolling restart lost requests to the old one), and the old one closes at the next
    prune. The same id keeps its channel."""

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        pool = ChannelPool()
        old = pool.get(address, "decode-1")
        assert await answers(old) and pool.get(address, "decode-1") is old
        await server.stop(None)
        for _ in range(3):  # connection refused: the channel backs off
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await answers(old)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        again = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), again)
        assert again.add_insecure_port(address) == port
        await again.start()
        try:
            with pool.using(address, "decode-2") as fresh:
                assert fresh is not old
                assert await answers(fresh)  # the first call: no backoff to wait out
            assert pool.get(address, "decode-2") is fresh and len(pool) == 1
            with pool.using(address) as anonymous:  # a call naming no id takes the current one
                assert anonymous is fresh
            await pool.prune([address])
            await assert_closed(old)
            assert await answers(fresh)
            await pool.close()
            await assert_closed(fresh)
        finally:
            await again.stop(None)

    run(main())


def test_close_closes_every_channel() -> None:
    async def main() -> None:
        async with servers(2) as addresses:
            pool = ChannelPool()
            channels = [pool.get(address) for address in addresses]
            assert all([await answers(ch) for ch in channels])
            await pool.close()
            assert len(pool) == 0
            for channel in channels:
                await assert_closed(channel)

    run(main())


def record(worker_id: str, role: str, grpc_address: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=grpc_address,
        kv_address="127.0.0.1:1",
        kv_transport="tcp",
        model=FP.model_id,
        fingerprint=FP,
        kv_blocks_total=64,
    )


def test_the_router_closes_channels_of_workers_that_left_the_registry(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router (``Gateway``, its pruning loop every 0.1 s here instead of 30 s) with channels to
    three registered workers: the one that deregisters loses its channel (shut down, dropped);
    the one still registered and the draining one (it may still be streaming) keep theirs."""
    monkeypatch.setattr(gateway_module, "CHANNEL_PRUNE_SECONDS", 0.1)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    config = RouterConfig(redis_url=redis_server.url, redis_prefix=prefix, refresh_seconds=0.1)
    model = ModelInfo(
        "m", "m", tokenizer=None, tokenizer_hash="cd" * 32, max_model_len=64, longest_token_bytes=1
    )  # type: ignore[arg-type]
    registry = RegistryConfig(
        redis_url=redis_server.url, prefix=prefix, ttl_seconds=5, heartbeat_seconds=0.2
    )

    async def main() -> None:
        async with servers(3) as (stays, drains, leaves):
            workers = {
                address: WorkerRegistration(registry, record(name, role, address))
                for address, name, role in (
                    (stays, "prefill-a", "prefill"),
                    (drains, "decode-a", "decode"),
                    (leaves, "prefill-b", "prefill"),
                )
            }
            for registration in workers.values():
                await registration.register()
            gateway = Gateway(config, model)
            await gateway.start()
            try:
                assert len(gateway.view.workers()) == 3
                pool = gateway.orchestrator.calls.channels
                opened = {address: pool.get(address) for address in workers}
                assert all([await answers(ch) for ch in opened.values()])
                await asyncio.sleep(0.5)  # several prunes: every worker is registered
                assert len(pool) == 3

                await workers[drains].set_draining()
                await workers[leaves].deregister()
                # The pruner drops the channel from the pool, then awaits its close: wait for
                # both (one full run looked in between and saw the channel still open).
                await eventually(
                    lambda: (
                        len(pool) == 2
                        and opened[leaves].get_state() == grpc.ChannelConnectivity.SHUTDOWN
                    ),
                    5,
                    "the channel of prefill-b closed",
                )

                await assert_closed(opened[leaves])
                for address in (stays, drains):
                    assert pool.get(address) is opened[address]
                    assert await answers(opened[address])
            finally:
                await gateway.close()
                for registration in workers.values():
                    await registration.close()

    run(main())
