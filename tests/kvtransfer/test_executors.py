"""Blocking KV work runs in threads its endpoint owns, not in asyncio's default executor.

A torch send whose reader never receives blocks a thread until the group timeout. Stalled
sends used to fill asyncio's default executor (6 threads on 2 cores), so a tcp gather or a
prefill's block checksums in the same process waited behind them. Here more pairs than that
stall at once, and a gather and a checksum still finish at once; and every endpoint's threads
end when it closes (counted by their name prefix).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, available_transports, block_checksums
from kvtransfer import framing as fr
from kvtransfer.base import _Endpoint
from kvtransfer.tcp import INLINE_GATHER_BYTES, TcpKVClient, TcpKVServer
from kvtransfer.torch_dist import TorchKVClient, TorchKVServer

pytestmark = pytest.mark.skipif("torch" not in available_transports(), reason="no gloo here")

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)  # 128 KiB a block
NUM_BLOCKS = 64  # 8 MiB: a gather above INLINE_GATHER_BYTES, a send far beyond socket buffers
GROUP_TIMEOUT = 6.0  # how long each stalled send holds its thread
# More stalled sends than asyncio's default executor has threads.
NUM_STALLED = min(32, (os.cpu_count() or 1) + 4) + 2
PROMPT_S = 1.5  # "at once", with room for a loaded 2-core machine
TOKEN = "t0k3n"


def _threads(endpoint: _Endpoint) -> int:
    return sum(t.name.startswith(endpoint.thread_prefix) for t in threading.enumerate())


async def _wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return bool(predicate())


async def _stall_sends(clients: list[TorchKVClient], address: str) -> list[asyncio.Task[int]]:
    """Give each client a pair, then ask for the blocks on each and never receive them: every
    pair's send on the server blocks until the group timeout. The replies' statuses, to come."""
    loop = asyncio.get_running_loop()
    pairs = [await client._pair(address, GROUP_TIMEOUT) for client in clients]
    ids = list(range(NUM_BLOCKS))
    for i, pair in enumerate(pairs):
        pull = fr.Request(fr.OP_PULL, TOKEN, f"stalled-{i}", ids, LAYOUT.bytes_per_block)
        await loop.sock_sendall(pair.sock, fr.encode_request(pull))

    async def status(sock: socket.socket) -> int:
        return (await fr.read_reply(loop, sock))[0]

    return [asyncio.ensure_future(status(pair.sock)) for pair in pairs]


async def _timed(work) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    await asyncio.wait_for(work, GROUP_TIMEOUT * 2)
    return time.monotonic() - start


def test_stalled_torch_sends_starve_no_gather_nor_checksum() -> None:
    assert LAYOUT.bytes_per_block * NUM_BLOCKS > INLINE_GATHER_BYTES

    async def run() -> None:
        kv = torch.randn(NUM_BLOCKS, *LAYOUT.block_shape)
        source = TensorBlockSource(kv, lease_seconds=60.0)
        ids = list(range(NUM_BLOCKS))
        for i in range(NUM_STALLED):
            source.pin(f"stalled-{i}", ids, with_checksums=False)
        source.pin("gathered", ids, with_checksums=False)
        torch_server = TorchKVServer(source, LAYOUT, TOKEN, group_timeout=GROUP_TIMEOUT)
        tcp_server = TcpKVServer(source, LAYOUT, TOKEN, zero_copy=False)  # gathers in a thread
        stallers = [TorchKVClient(TOKEN) for _ in range(NUM_STALLED)]
        tcp_client = TcpKVClient(TOKEN)
        endpoints: list[_Endpoint] = [torch_server, tcp_server, *stallers, tcp_client]
        try:
            torch_address = await torch_server.start()
            tcp_address = await tcp_server.start()
            replies = await _stall_sends(stallers, torch_address)
            await asyncio.sleep(0.5)  # the sends are in gloo now, waiting for their readers
            pulled = tcp_client.pull(tcp_address, "gathered", ids, LAYOUT, GROUP_TIMEOUT * 2)
            assert await _timed(pulled) < PROMPT_S
            assert await _timed(asyncio.to_thread(block_checksums, kv)) < PROMPT_S
            assert await asyncio.gather(*replies) == [fr.STATUS_OK] * NUM_STALLED
            assert torch_server.stats.num_ok == 0  # every send still waits for its reader
        finally:
            for client in stallers:
                await client.close()
            await tcp_client.close()
            await tcp_server.stop()
            await torch_server.stop()
        # Each endpoint's threads end once it is closed (a stalled send's at its timeout).
        assert await _wait_for(lambda: all(_threads(e) == 0 for e in endpoints), GROUP_TIMEOUT)

    asyncio.run(run())


def test_closing_an_endpoint_ends_its_threads() -> None:
    async def run() -> None:
        kv = torch.randn(NUM_BLOCKS, *LAYOUT.block_shape)
        source = TensorBlockSource(kv, lease_seconds=60.0)
        ids = list(range(NUM_BLOCKS))
        source.pin("req", ids, with_checksums=False)
        server = TorchKVServer(source, LAYOUT, TOKEN, group_timeout=GROUP_TIMEOUT)
        client = TorchKVClient(TOKEN)
        try:
            address = await server.start()
            blocks = await client.pull(address, "req", ids, LAYOUT, GROUP_TIMEOUT)
            assert torch.equal(blocks, kv)
            assert _threads(server) > 0 and _threads(client) > 0  # joined, read, sent, received
        finally:
            await client.close()
            await server.stop()
        assert await _wait_for(lambda: _threads(server) == _threads(client) == 0, 2.0)

    asyncio.run(run())
