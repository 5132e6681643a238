"""A KV block is never freed while a transfer reads it, on every transport.

The server's source frees a pin through ``on_unpin``, which here does what the prefill worker's
engine does next: it reuses the blocks (they are overwritten with garbage). A served pull stops
in the middle of its transfer (the ``pause`` fault) for longer than the lease, while the lease
is expired again and again; the pull must still deliver exactly the pinned bytes (checksums
taken at pin time verify it), and the blocks may be reused only after it is done.

For ``shm`` the decode side copies the blocks itself: a client speaking the wire protocol by
hand reads the server's OK, lets the lease expire, checks the blocks are still held, copies,
and only its DONE lets them go.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import KVFaults, KVLayout, TensorBlockSource, make_client, make_server
from kvtransfer import framing as fr
from kvtransfer.base import block_checksums

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
TOKEN = "t0k3n"
BLOCKS = [1, 3, 5, 6]  # not all consecutive: zero-copy tcp sends several rows
LEASE_SECONDS = 0.2
PAUSE_SECONDS = 1.0


class ReusingSource(TensorBlockSource):
    """A source whose unpinned blocks are reused at once (overwritten), as the engine would."""

    def __init__(self, kv_cache: torch.Tensor):
        super().__init__(kv_cache, LEASE_SECONDS, on_unpin=self._reuse)
        self.unpinned = threading.Event()

    def _reuse(self, request_id: str) -> None:
        self.kv_cache[torch.tensor(BLOCKS)] = -1.0
        self.unpinned.set()


def transports() -> list[str]:
    from kvtransfer import available_transports

    return [t for t in ("tcp", "torch", "ucx") if t in available_transports()]


async def expire_until(source: TensorBlockSource, done: asyncio.Future[object]) -> None:
    """Once the server reads the blocks (connection set-up may take a while), expire the lease
    again and again until the pull is over."""
    while not done.done() and not source._pins["req"].readers:
        source.renew_lease("req")
        await asyncio.sleep(0.01)
    while not done.done():
        source.expire()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", transports())
def test_expiry_in_the_middle_of_a_transfer_waits_for_it(transport: str) -> None:
    async def run() -> None:
        kv_cache = torch.randn(8, *LAYOUT.block_shape)
        source = ReusingSource(kv_cache)
        expected = kv_cache[torch.tensor(BLOCKS)].clone()
        checksums = source.pin("req", BLOCKS)
        faults = KVFaults(pause=PAUSE_SECONDS)
        server = make_server(transport, source, LAYOUT, TOKEN, faults=faults)
        address = await server.start("127.0.0.1")
        client = make_client(transport, token=TOKEN)
        try:
            pull = asyncio.ensure_future(
                client.pull_verified(address, "req", BLOCKS, LAYOUT, 30.0, checksums)
            )
            await expire_until(source, pull)
            blocks = pull.result()
            assert torch.equal(blocks, expected)
            assert not source.is_pinned("req")  # it expired meanwhile...
            for _ in range(50):  # ...and is let go once the transfer is done
                if source.unpinned.is_set():
                    break
                await asyncio.sleep(0.05)
            assert source.unpinned.is_set() and not source.holds("req")
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())


@pytest.fixture
def shm_cache() -> Iterator[tuple[str, torch.Tensor]]:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="pdserve-test-")
    os.close(fd)
    numel = 8 * int(torch.Size(LAYOUT.block_shape).numel())
    flat = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
    kv_cache = flat.view(8, *LAYOUT.block_shape)
    kv_cache.copy_(torch.randn(kv_cache.shape))
    yield path, kv_cache
    os.unlink(path)


def test_shm_holds_the_blocks_until_the_client_is_done_copying(shm_cache) -> None:  # type: ignore[no-untyped-def]
    path, kv_cache = shm_cache

    async def run() -> None:
        source = ReusingSource(kv_cache)
        expected = kv_cache[torch.tensor(BLOCKS)].clone()
        source.pin("req", BLOCKS)
        server = make_server("shm", source, LAYOUT, TOKEN, path=path)
        address = await server.start("127.0.0.1")
        host, port, _ = fr.parse_address(address, "shm")
        loop = asyncio.get_running_loop()
        sock = socket.create_connection((host, port))
        sock.setblocking(False)
        try:
            request = fr.Request(fr.OP_PULL, TOKEN, "req", BLOCKS, LAYOUT.bytes_per_block)
            await loop.sock_sendall(sock, fr.encode_request(request))
            status, _, _ = await fr.read_reply(loop, sock)
            assert status == fr.STATUS_OK
            await asyncio.sleep(2 * LEASE_SECONDS)
            assert source.expire() == ["req"]  # the lease ran out during the copy...
            await asyncio.sleep(0.2)
            assert not source.unpinned.is_set() and source.holds("req")  # ...the blocks stay
            copied = kv_cache[torch.tensor(BLOCKS)].clone()  # the client's copy
            done = fr.Request(fr.OP_DONE, "", "req", [], 0)
            await loop.sock_sendall(sock, fr.encode_request(done))
            for _ in range(50):
                if source.unpinned.is_set():
                    break
                await asyncio.sleep(0.05)
            assert source.unpinned.is_set() and not source.holds("req")
            assert torch.equal(copied, expected)
            assert block_checksums(copied) == block_checksums(expected)
        finally:
            sock.close()
            await server.stop()

    asyncio.run(run())


def test_a_client_that_leaves_mid_copy_lets_the_blocks_go(shm_cache) -> None:  # type: ignore[no-untyped-def]
    path, kv_cache = shm_cache

    async def run() -> None:
        source = ReusingSource(kv_cache)
        source.pin("req", BLOCKS)
        server = make_server("shm", source, LAYOUT, TOKEN, path=path)
        address = await server.start("127.0.0.1")
        host, port, _ = fr.parse_address(address, "shm")
        loop = asyncio.get_running_loop()
        sock = socket.create_connection((host, port))
        sock.setblocking(False)
        request = fr.Request(fr.OP_PULL, TOKEN, "req", BLOCKS, LAYOUT.bytes_per_block)
        await loop.sock_sendall(sock, fr.encode_request(request))
        await fr.read_reply(loop, sock)
        source.release("req")
        await asyncio.sleep(0.2)
        assert source.holds("req") and not source.unpinned.is_set()
        sock.close()  # gone without DONE
        for _ in range(50):
            if source.unpinned.is_set():
                break
            await asyncio.sleep(0.05)
        assert source.unpinned.is_set()
        await server.stop()

    asyncio.run(run())
