"""Hardening of the KV transfer servers and clients, on real sockets and real servers (loopback):

- tcp server: the cluster token is checked before the request body is read (a peer without the
  token cannot make the server wait for, or allocate, a body); at most ``max_connections``
  authenticated connections are held (``framing.MAX_CONNECTIONS`` by default), more are closed
  as they authenticate, and unauthenticated ones only up to their pre-auth budget; a
  connection that sends no complete request for the idle time is closed, others are served;
- torch server: a client on the server's own GPU is refused at CONNECT with the way out (NCCL
  cannot join two processes on one GPU);
- shm client: its mappings of prefill workers' KV files are bounded (``shm.MAX_MAPPINGS``,
  least recently used dropped first), and one whose file is gone (a dead peer) is dropped.

The tcp tests run the server on an event loop in a thread and talk to it with blocking sockets,
so a test can watch a server that is waiting for bytes that never come.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, TransferError, make_client, shm
from kvtransfer import framing as fr
from kvtransfer.shm import ShmKVClient, ShmKVServer
from kvtransfer.tcp import TcpKVClient, TcpKVServer
from kvtransfer.torch_dist import TorchKVServer

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
TOKEN = "t0k3n"
NUM_BLOCKS = 8
IDS = [0, 3]
IDLE = 0.5  # the idle limit the idle tests give the server (framing.IDLE_SECONDS is 60 s)

T = TypeVar("T")


class LoopThread:
    """An event loop in a daemon thread: servers run there while the test blocks on sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class TcpServer:
    """A TcpKVServer (blocks ``IDS`` of a random cache pinned as "ok") on a LoopThread."""

    def __init__(self, loop: LoopThread):
        self.kv = torch.randn(NUM_BLOCKS, *LAYOUT.block_shape)
        source = TensorBlockSource(self.kv, lease_seconds=60.0)
        source.pin("ok", IDS, with_checksums=False)
        self.server = TcpKVServer(source, LAYOUT, TOKEN)
        self.listener = self.server._listener
        self.address = loop.run(self.server.start("127.0.0.1"))
        self.port = fr.parse_address(self.address, "tcp")[1]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5.0)


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def tcp(loop_thread: LoopThread) -> Iterator[TcpServer]:
    server = TcpServer(loop_thread)
    yield server
    loop_thread.run(server.server.stop())


def _frame(token: str = TOKEN, request_id: str = "ok", ids: list[int] = IDS) -> bytes:
    request = fr.Request(fr.OP_PULL, token, request_id, ids, LAYOUT.bytes_per_block)
    return fr.encode_request(request)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionResetError("server closed the connection")
        buf += chunk
    return bytes(buf)


def _read_reply(sock: socket.socket) -> tuple[str, str, bytes]:
    """(reason, message, payload) of one reply; reason "ok" for STATUS_OK."""
    header = _recv_exactly(sock, fr.REPLY_HEADER.size)
    msg_len = fr.REPLY_HEADER.unpack(header)[3]
    status, message, payload_len = fr.parse_reply(header + _recv_exactly(sock, msg_len))
    reason = "ok" if status == fr.STATUS_OK else fr.STATUS_REASONS[status]
    return reason, message, _recv_exactly(sock, payload_len)


def _raw_pull(sock: socket.socket) -> torch.Tensor:
    """One complete valid pull of ``IDS`` on ``sock`` (blocking)."""
    sock.sendall(_frame())
    reason, message, payload = _read_reply(sock)
    assert reason == "ok", message
    return torch.frombuffer(bytearray(payload), dtype=torch.float32).view(-1, *LAYOUT.block_shape)


def _is_closed(sock: socket.socket, wait: float) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``wait`` seconds (0: now)
    having sent nothing; False when it is still open then."""
    sock.settimeout(wait)
    try:
        data = sock.recv(1, socket.MSG_PEEK)
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionError:
        return True
    finally:
        sock.settimeout(5.0)
    assert data == b"", f"the server sent {data!r}"
    return True


def _eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _client_pull(address: str, transport: str = "tcp") -> torch.Tensor:
    async def run() -> torch.Tensor:
        client = make_client(transport, token=TOKEN)
        try:
            return await client.pull(address, "ok", IDS, LAYOUT, 5.0)
        finally:
            await client.close()

    return asyncio.run(run())


def test_a_wrong_token_is_refused_before_the_body_is_read(tcp: TcpServer) -> None:
    """A wrong token declaring the largest body gets "refused" and EOF with no body sent,
    while the right token makes the server wait for the body: the token is checked first."""
    huge = fr.REQUEST_HEADER.pack(
        fr.MAGIC, fr.VERSION, fr.OP_PULL, 5, fr.MAX_ID_LEN, fr.MAX_BLOCKS, LAYOUT.bytes_per_block
    )
    with tcp.connect() as sock:
        sock.sendall(huge + b"wrong")  # header and token only: ~8 MiB of body never follow
        reason, message, payload = _read_reply(sock)  # within the 5 s socket timeout
        assert (reason, payload) == ("refused", b""), message
        assert _is_closed(sock, 2.0)
    assert tcp.server.stats.failures == {"refused": 1}

    # The same header with the right token: the server now waits for the rest of the frame.
    frame = _frame(ids=[3])
    head = fr.request_head_len(frame)
    with tcp.connect() as sock:
        sock.sendall(frame[:head])
        assert not _is_closed(sock, 0.3)  # no reply: it is reading the body
        sock.sendall(frame[head:])
        reason, message, payload = _read_reply(sock)
        assert reason == "ok", message
        assert payload == tcp.kv[[3]].numpy().tobytes()
    assert torch.equal(_client_pull(tcp.address), tcp.kv[IDS])
    assert tcp.server.stats.failures == {"refused": 1}


def test_connections_beyond_the_cap_are_closed_and_served_again_later(tcp: TcpServer) -> None:
    """At the cap of authenticated connections a new one is closed when it authenticates (a
    pull on it fails as connection_lost) while the held ones still serve; once they close,
    pulls work again. (Unauthenticated connections have budgets of their own: test_preauth.)"""
    assert tcp.listener.max_connections == fr.MAX_CONNECTIONS
    tcp.listener.max_connections = 3
    held = [tcp.connect() for _ in range(3)]
    for sock in held:
        assert torch.equal(_raw_pull(sock), tcp.kv[IDS])
    assert tcp.listener.num_authenticated == 3
    extra = [tcp.connect() for _ in range(2)]
    try:
        for sock in extra:
            sock.sendall(_frame())
            assert _is_closed(sock, 2.0)  # no reply: closed as its token checked out
        assert tcp.listener.num_refused == 2
        with pytest.raises(TransferError) as info:
            _client_pull(tcp.address)
        assert info.value.reason == "connection_lost"
        assert tcp.listener.num_refused == 3
        assert not any(_is_closed(sock, 0) for sock in held)
        assert torch.equal(_raw_pull(held[0]), tcp.kv[IDS])  # held ones are served
    finally:
        for sock in held + extra:
            sock.close()
    _eventually(lambda: tcp.listener.num_connections == 0)
    assert torch.equal(_client_pull(tcp.address), tcp.kv[IDS])
    assert tcp.listener.num_refused == 3


def test_a_burst_of_connections_cannot_exceed_the_preauth_budget() -> None:
    """Connections that arrive together (queued while the loop was busy) are held only up to
    the per-peer pre-auth budget; the oldest beyond it are closed."""

    async def run() -> tuple[int, int]:
        source = TensorBlockSource(torch.zeros(NUM_BLOCKS, *LAYOUT.block_shape))
        server = TcpKVServer(source, LAYOUT, TOKEN)
        server._listener.max_preauth_per_peer = 2
        port = fr.parse_address(await server.start("127.0.0.1"), "tcp")[1]
        # The loop does not run during these connects: all six wait in the listen backlog.
        burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
        await asyncio.sleep(0.3)
        counts = server._listener.num_connections, server._listener.num_refused
        for sock in burst:
            sock.close()
        await server.stop()
        return counts

    assert asyncio.run(run()) == (2, 4)


def _shorten_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers read requests with ``read_request``'s default timeout, bound to
    ``IDLE_SECONDS`` at import: patch that default (patching the constant has no effect)."""
    assert fr.read_request.__defaults__ == (None, fr.IDLE_SECONDS)
    monkeypatch.setattr(fr.read_request, "__defaults__", (None, IDLE))


def test_an_idle_connection_is_closed_while_others_are_served(
    tcp: TcpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A silent connection and one stuck mid-header are closed after the idle time, while a
    connection sending a request every 0.2 s outlives it and gets correct blocks each time."""
    _shorten_idle(monkeypatch)
    silent, partial, busy = tcp.connect(), tcp.connect(), tcp.connect()
    start = time.monotonic()
    try:
        partial.sendall(_frame()[:10])  # part of a header, then nothing
        assert not _is_closed(silent, 0) and not _is_closed(partial, 0)
        while time.monotonic() - start < 3 * IDLE:
            assert torch.equal(_raw_pull(busy), tcp.kv[IDS])
            time.sleep(0.2)
        assert _is_closed(silent, 0) and _is_closed(partial, 0)
        assert not _is_closed(busy, 0)
        assert torch.equal(_raw_pull(busy), tcp.kv[IDS])
    finally:
        for sock in (silent, partial, busy):
            sock.close()
    _eventually(lambda: tcp.listener.num_connections == 0)
    assert torch.equal(_client_pull(tcp.address), tcp.kv[IDS])
    assert tcp.server.stats.failures == {}


def test_a_pooled_connection_closed_for_idleness_is_replaced(
    tcp: TcpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's pooled connection that the server closed as idle costs the next pull
    nothing: that pull succeeds on a fresh connection and no failure is counted."""
    _shorten_idle(monkeypatch)

    async def run() -> None:
        client = TcpKVClient(TOKEN)
        try:
            assert torch.equal(await client.pull(tcp.address, "ok", IDS, LAYOUT, 5.0), tcp.kv[IDS])
            [pooled] = client.connections._idle[("127.0.0.1", tcp.port)]
            await asyncio.sleep(2 * IDLE)
            assert tcp.listener.num_connections == 0  # the server closed it
            assert torch.equal(await client.pull(tcp.address, "ok", IDS, LAYOUT, 5.0), tcp.kv[IDS])
            assert pooled.fileno() == -1
            assert client.stats.num_ok == 2 and client.stats.failures == {}
        finally:
            await client.close()

    asyncio.run(run())


# shm: each peer is a ShmKVServer whose cache lives in its own file; the client maps the files.


def _shared_cache(path: Path, value: float) -> torch.Tensor:
    """A cache in a new file at ``path``, every element ``value`` (tells peers apart)."""
    shape = (NUM_BLOCKS, *LAYOUT.block_shape)
    numel = int(torch.Size(shape).numel())
    cache = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
    return cache.view(shape).fill_(value)


async def _shm_peer(path: Path, value: float) -> tuple[ShmKVServer, str]:
    source = TensorBlockSource(_shared_cache(path, value), lease_seconds=60.0)
    source.pin("ok", IDS, with_checksums=False)
    server = ShmKVServer(source, LAYOUT, TOKEN, path=str(path))
    return server, await server.start("127.0.0.1")


async def _shm_pull(client: ShmKVClient, address: str) -> float:
    """Pull ``IDS`` from ``address``; the one value its blocks hold."""
    blocks = await client.pull(address, "ok", IDS, LAYOUT, 5.0)
    values = blocks.unique().tolist()
    assert len(values) == 1, values
    return float(values[0])


def test_shm_mappings_are_bounded_least_recently_used_first(tmp_path: Path) -> None:
    """Pulling from one peer more than ``shm.MAX_MAPPINGS`` keeps that many mappings: the
    least recently used is dropped, and pulling from it again maps it again, correctly."""
    num = shm.MAX_MAPPINGS + 1
    paths = [str(tmp_path / f"kv-{i}") for i in range(num)]

    async def run() -> None:
        peers = [await _shm_peer(Path(path), i + 1) for i, path in enumerate(paths)]
        client = ShmKVClient(TOKEN)
        try:
            for i, (_, address) in enumerate(peers):
                assert await _shm_pull(client, address) == i + 1
            assert list(client._mappings) == paths[1:]
            kept = client._mappings[paths[-1]]
            assert await _shm_pull(client, peers[0][1]) == 1
            assert list(client._mappings) == paths[2:] + paths[:1]
            assert await _shm_pull(client, peers[-1][1]) == num
            assert client._mappings[paths[-1]] is kept  # a kept mapping is reused as it is
            assert list(client._mappings) == paths[2:-1] + [paths[0], paths[-1]]
        finally:
            await client.close()
            for server, _ in peers:
                await server.stop()

    asyncio.run(run())


def test_shm_mapping_of_a_file_that_is_gone_is_dropped(tmp_path: Path) -> None:
    """A pull whose peer's file is gone fails and drops the mapping; a peer restarted on a
    new file at that path is then mapped afresh and its blocks come back right."""
    path = tmp_path / "kv"

    async def run() -> None:
        server, address = await _shm_peer(path, 1.0)
        client = ShmKVClient(TOKEN)
        try:
            assert await _shm_pull(client, address) == 1.0
            assert list(client._mappings) == [str(path)]
            os.unlink(path)
            with pytest.raises(TransferError):
                await client.pull(address, "ok", IDS, LAYOUT, 5.0)
            assert list(client._mappings) == []
            await server.stop()
            server, address = await _shm_peer(path, 2.0)
            assert await _shm_pull(client, address) == 2.0
            assert list(client._mappings) == [str(path)]
        finally:
            await client.close()
            await server.stop()

    asyncio.run(run())


def test_shm_mapping_of_a_dead_peer_is_dropped_without_pulling_from_it(tmp_path: Path) -> None:
    """A peer that died (server stopped, file removed) is never pulled from again; its
    mapping is still dropped by the next pull from another peer."""

    async def run() -> list[str]:
        dead, dead_address = await _shm_peer(tmp_path / "dead", 1.0)
        alive, alive_address = await _shm_peer(tmp_path / "alive", 2.0)
        client = ShmKVClient(TOKEN)
        try:
            assert await _shm_pull(client, dead_address) == 1.0
            assert await _shm_pull(client, alive_address) == 2.0
            await dead.stop()
            os.unlink(tmp_path / "dead")
            assert await _shm_pull(client, alive_address) == 2.0
            return list(client._mappings)
        finally:
            await client.close()
            await alive.stop()

    assert asyncio.run(run()) == [str(tmp_path / "alive")]


def test_shm_peer_restarted_at_the_same_path_is_mapped_afresh(tmp_path: Path) -> None:
    """A peer that died and restarted with a new file at the same path (a fixed worker id)
    serves its new blocks, not the dead peer's stale ones."""
    path = tmp_path / "kv"

    async def run() -> float:
        dead, address = await _shm_peer(path, 1.0)
        client = ShmKVClient(TOKEN)
        try:
            assert await _shm_pull(client, address) == 1.0
            os.unlink(path)  # the dead peer's file; its server is stopped below
            restarted, address = await _shm_peer(path, 2.0)
            return await _shm_pull(client, address)
        finally:
            await client.close()
            await dead.stop()
            await restarted.stop()

    assert asyncio.run(run()) == 2.0


def test_a_server_stops_promptly_right_after_a_pull(tmp_path: Path) -> None:
    """stop() called right after a pull, while the client keeps its pooled connection, returns
    within 2 s (the connection task does not outlive the cancel)."""

    async def run() -> bool:
        server, address = await _shm_peer(tmp_path / "kv", 1.0)
        client = ShmKVClient(TOKEN)
        assert await _shm_pull(client, address) == 1.0
        stopping = asyncio.ensure_future(server.stop())
        done, _ = await asyncio.wait([stopping], timeout=2.0)
        await client.close()  # lets a hung stop() finish
        await stopping
        return bool(done)

    assert asyncio.run(run())


def _torch_pull_from_gpu(server_gpu: str, client_gpu: str) -> torch.Tensor:
    """A torch-transport pull between a server and a client that report these GPU UUIDs."""

    async def run() -> torch.Tensor:
        kv = torch.randn(NUM_BLOCKS, *LAYOUT.block_shape)
        source = TensorBlockSource(kv, lease_seconds=60.0)
        source.pin("ok", IDS, with_checksums=False)
        server = TorchKVServer(source, LAYOUT, TOKEN)
        server.gpu = server_gpu
        address = await server.start("127.0.0.1")
        client = make_client("torch", token=TOKEN)
        client.gpu = client_gpu  # type: ignore[attr-defined]
        try:
            blocks = await client.pull(address, "ok", IDS, LAYOUT, 10.0)
            assert torch.equal(blocks, kv[IDS])
            return blocks
        finally:
            await client.close()
            await server.stop()

    return asyncio.run(run())


def test_a_torch_client_on_the_servers_own_gpu_is_refused_with_the_way_out() -> None:
    """On an H100, two processes on one GPU failed in NCCL's first recv ("Duplicate GPU
    detected", docs/benchmarks.md); the server now refuses such a client at CONNECT, before any
    group is built, and says what to do. This machine has no GPU: both ends keep their CPU
    tensors (gloo) and only report the GPU UUIDs set here."""
    with pytest.raises(TransferError) as caught:
        _torch_pull_from_gpu("GPU-0f1e", "GPU-0f1e")
    assert caught.value.reason == "refused"
    assert "share one GPU (GPU-0f1e)" in str(caught.value)
    assert "--kv-transport tcp or ucx" in str(caught.value)
    _torch_pull_from_gpu("GPU-0f1e", "GPU-a2b3")  # another GPU: served
