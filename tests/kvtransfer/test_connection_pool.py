"""What a decode worker's KV client keeps between pulls stays bounded: pulls in flight leave
``states`` whatever their end (cancelled included), and idle connections are kept for a bounded
number of servers (a server that is gone is forgotten, its sockets closed)."""

from __future__ import annotations

import asyncio
import socket

import torch

from kvtransfer import KVLayout, TensorBlockSource, make_client
from kvtransfer.framing import parse_address
from kvtransfer.server_process import STALL_REQUEST, ServerProcess, ServerSpec
from kvtransfer.tcp import TcpKVServer

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
TOKEN = "t0k3n"


def test_a_cancelled_pull_leaves_no_state_behind():
    spec = ServerSpec("tcp", LAYOUT, 8, token=TOKEN, pins={STALL_REQUEST: [0]})
    with ServerProcess(spec) as server:

        async def run() -> None:
            client = make_client("tcp", token=TOKEN)
            pull = asyncio.ensure_future(
                client.pull(server.address, STALL_REQUEST, [0], LAYOUT, 30.0)
            )
            await asyncio.sleep(0.5)
            assert client.states  # in flight
            pull.cancel()
            await asyncio.gather(pull, return_exceptions=True)
            assert client.states == {}
            await client.close()

        asyncio.run(run())


def test_idle_connections_are_kept_for_a_bounded_number_of_servers():
    async def run() -> None:
        servers, addresses = [], []
        for _ in range(3):
            cache = torch.randn(8, *LAYOUT.block_shape)
            source = TensorBlockSource(cache, lease_seconds=30)
            source.pin("r", [1, 2])
            server = TcpKVServer(source, LAYOUT, token=TOKEN)
            addresses.append(await server.start("127.0.0.1"))
            servers.append(server)
        client = make_client("tcp", token=TOKEN)
        client.connections.max_servers = 2
        try:
            first = None
            for address in addresses:
                await client.pull(address, "r", [1, 2], LAYOUT, 10.0)
                if first is None:
                    host, port, _ = parse_address(address, "tcp")
                    [first] = client.connections._idle[(host, port)]
            assert client.connections.num_servers == 2
            assert first.fileno() == -1  # the least recently used server's socket was closed
            # Pulling from a forgotten server again just connects again.
            await client.pull(addresses[0], "r", [1, 2], LAYOUT, 10.0)
            assert client.connections.num_servers == 2
        finally:
            await client.close()
            for server in servers:
                await server.stop()

    asyncio.run(run())


def test_after_a_lull_a_pull_connects_afresh_whatever_is_pooled():
    """Every pooled connection to a server is dead (the server closes idle ones after
    ``framing.IDLE_SECONDS``): the pull still succeeds, retried on a new connection, not on
    another dead one (it failed that way: a decode worker recomputed the first prompt pulled
    from each prefill worker after a minute's lull)."""

    async def run() -> None:
        cache = torch.randn(8, *LAYOUT.block_shape)
        source = TensorBlockSource(cache, lease_seconds=30)
        source.pin("r", [1, 2])
        server = TcpKVServer(source, LAYOUT, token=TOKEN)
        address = await server.start("127.0.0.1")
        client = make_client("tcp", token=TOKEN)
        try:
            pulls = [client.pull(address, "r", [1, 2], LAYOUT, 10.0) for _ in range(3)]
            await asyncio.gather(*pulls)  # at once: three connections, then pooled
            host, port, _ = parse_address(address, "tcp")
            pooled = client.connections._idle[(host, port)]
            assert len(pooled) == 3
            for sock in pooled:  # as the server's idle timeout leaves them: peer gone
                sock.shutdown(socket.SHUT_RDWR)
            await client.pull(address, "r", [1, 2], LAYOUT, 10.0)
            assert len(client.connections._idle[(host, port)]) == 1  # the new one, pooled
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())
