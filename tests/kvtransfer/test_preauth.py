"""KV listeners authenticate before a connection holds a slot (issue #31, the internal plane).

- A flood of connections that never present the token (silent, a partial header, a header and
  part of a token, garbage) does not delay a real pull, on every listening transport: each
  flood connection sits in a small pre-auth budget (per peer address, oldest pushed out first),
  never in the authenticated connections that real clients pool.
- Unauthenticated connections are closed at the pre-auth deadline; authenticated ones are not.
- A flood from one address cannot push out another address's unauthenticated connection.
- The torch transport's rendezvous: no torch TCPStore listens (it would bind every interface,
  unauthenticated); a pair's store is reached through the KV listener with the token and the
  pair's secret id, and goes with the pair.

Servers are real (a child process, or an event loop in a thread when the test reads the
listener's counters); the flood is plain blocking sockets.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, TransferError, available_transports, make_client
from kvtransfer import framing as fr
from kvtransfer.pair_store import RemoteStore
from kvtransfer.server_process import ServerProcess, ServerSpec, make_kv_cache
from kvtransfer.tcp import TcpKVServer
from kvtransfer.torch_dist import TorchKVClient, TorchKVServer
from tests.kvtransfer.test_kv_hardening import LoopThread

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
NUM_BLOCKS = 8
IDS = [1, 6]
TOKEN = "cluster-secret"
FLOOD = 300  # more than framing.MAX_CONNECTIONS: once enough to lock every transfer out
PULLS = 3  # timed pulls with and without the flood


def _flood_frames() -> list[bytes]:
    """What flood connections send: nothing, part of a header, a header and part of its token,
    garbage (closed at once as malformed, so it holds nothing)."""
    head = fr.encode_request(fr.Request(fr.OP_PULL, TOKEN, "r", IDS, LAYOUT.bytes_per_block))
    return [b"", head[:10], head[: fr.REQUEST_HEADER.size + 3], b"\x00garbage" * 4]


def _open_flood(
    port: int, num: int = FLOOD, source: str = "127.0.0.1", frames: list[bytes] | None = None
) -> list[socket.socket]:
    """``num`` connections from ``source``, sending each of ``frames`` in turn."""
    frames = frames or _flood_frames()
    socks = []
    for i in range(num):
        sock = socket.create_connection(
            ("127.0.0.1", port), timeout=5.0, source_address=(source, 0)
        )
        if frames[i % len(frames)]:
            sock.sendall(frames[i % len(frames)])
        socks.append(sock)
    return socks


def _is_closed(sock: socket.socket, wait: float) -> bool:
    """True when the server closes ``sock`` within ``wait`` seconds (what it sent first, a
    protocol error reply to garbage, is skipped)."""
    sock.settimeout(wait)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionError:
        pass
    finally:
        sock.settimeout(5.0)
    return True


def _timed_pulls(transport: str, address: str, expected: torch.Tensor) -> list[float]:
    """Seconds of ``PULLS`` pulls, each by a fresh client (so on a new connection)."""

    async def run() -> list[float]:
        times = []
        for _ in range(PULLS):
            client = make_client(transport, token=TOKEN)
            start = time.perf_counter()
            try:
                blocks = await client.pull(address, "ok", IDS, LAYOUT, 10.0)
            finally:
                await client.close()
            times.append(time.perf_counter() - start)
            assert torch.equal(blocks, expected)
        return times

    return asyncio.run(run())


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    """A server process per transport that can run here, started side by side."""

    def start(transport: str) -> ServerProcess:
        return ServerProcess(ServerSpec(transport, LAYOUT, NUM_BLOCKS, 7, TOKEN, {"ok": IDS}))

    names = [name for name in ("tcp", "shm", "torch", "ucx") if name in available_transports()]
    with ThreadPoolExecutor(len(names)) as pool:
        started = dict(zip(names, pool.map(start, names)))
    yield started
    for server in started.values():
        server.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm", "torch", "ucx"])
def test_a_preauth_flood_does_not_delay_a_real_transfer(
    transport: str, servers: dict[str, ServerProcess]
) -> None:
    """300 connections from the client's own address that never authenticate: pulls on new
    connections still succeed, within a bound close to their time without the flood (before,
    256 idle connections held every slot for 60 s and each pull failed as connection_lost)."""
    if transport not in servers:
        pytest.skip(f"KV transport {transport!r} cannot run on this machine")
    server = servers[transport]
    expected = make_kv_cache(LAYOUT, NUM_BLOCKS, 7)[IDS]
    port = fr.parse_address(server.address.partition("?")[0], transport)[1]
    normal = _timed_pulls(transport, server.address, expected)
    flood = _open_flood(port)
    try:
        flooded = _timed_pulls(transport, server.address, expected)
        held = sum(not _is_closed(sock, 0.0) for sock in flood)
    finally:
        for sock in flood:
            sock.close()
    base, under = statistics.median(normal), statistics.median(flooded)
    print(
        f"\n{transport}: pull {base * 1e3:.1f} ms (median of {PULLS}) without, "
        f"{under * 1e3:.1f} ms (max {max(flooded) * 1e3:.1f}) with {FLOOD} pre-auth connections "
        f"open ({held} still held by the server)"
    )
    assert held <= fr.MAX_PREAUTH_PER_PEER
    assert under < 3 * base + 0.25
    assert max(flooded) < fr.PREAUTH_SECONDS  # nobody waited for a flood connection to expire


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def _tcp_server(loop_thread: LoopThread) -> tuple[TcpKVServer, int]:
    source = TensorBlockSource(make_kv_cache(LAYOUT, NUM_BLOCKS, 7), lease_seconds=60.0)
    source.pin("ok", IDS, with_checksums=False)
    server = TcpKVServer(source, LAYOUT, TOKEN)
    address = loop_thread.run(server.start("127.0.0.1"))
    return server, fr.parse_address(address, "tcp")[1]


def _eventually(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _budgets(loop_thread: LoopThread, listener: fr.SocketListener) -> tuple[int, int]:
    """(refused, unauthenticated held), read on the listener's loop: read from the test's
    thread, an accept could be seen half done (its push-out counted, the new connection not
    yet held; CI once saw 32 held for 33)."""

    async def read() -> tuple[int, int]:
        return listener.num_refused, listener.num_preauth

    return loop_thread.run(read())


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
    message = _recv_exactly(sock, fr.REPLY_HEADER.unpack(header)[3])
    status, text, payload_len = fr.parse_reply(header + message)
    payload = _recv_exactly(sock, payload_len)
    return ("ok" if status == fr.STATUS_OK else fr.STATUS_REASONS[status]), text, payload


def _authenticated_pull(port: int) -> socket.socket:
    """A connection that made one complete pull (and stays open)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    frame = fr.Request(fr.OP_PULL, TOKEN, "ok", IDS, LAYOUT.bytes_per_block)
    sock.sendall(fr.encode_request(frame))
    reason, message, payload = _read_reply(sock)
    assert reason == "ok" and len(payload) == len(IDS) * LAYOUT.bytes_per_block, message
    return sock


def test_unauthenticated_connections_are_closed_at_the_preauth_deadline(
    loop_thread: LoopThread,
) -> None:
    """Silent and partial connections are closed at the pre-auth deadline (not after the 60 s
    idle time); an authenticated connection outlives it and is still served; a wrong token
    is refused at once and never authenticates."""
    server, port = _tcp_server(loop_thread)
    listener = server._listener
    listener.preauth_seconds = 0.5
    try:
        real = _authenticated_pull(port)
        start = time.monotonic()
        flood = _open_flood(port, 8)
        garbage = flood[3::4]  # closed at once as malformed
        waiting = [sock for sock in flood if sock not in garbage]
        time.sleep(0.2)
        assert not any(_is_closed(sock, 0.0) for sock in waiting)
        assert all(_is_closed(sock, 2.0) for sock in waiting)
        assert time.monotonic() - start < 2.0
        assert listener.num_expired == len(waiting)
        assert all(_is_closed(sock, 0.0) for sock in garbage)
        assert listener.num_authenticated == 1 and not _is_closed(real, 0.0)
        real.close()

        wrong = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        frame = fr.Request(fr.OP_PULL, "wrong", "ok", IDS, LAYOUT.bytes_per_block)
        wrong.sendall(fr.encode_request(frame))
        reason, message, _ = _read_reply(wrong)
        assert reason == "refused", message
        assert _is_closed(wrong, 2.0)
        wrong.close()
        _eventually(lambda: listener.num_connections == 0)
        assert listener.num_authenticated == 0
        assert server.stats.failures == {"refused": 1, "protocol": len(garbage)}
        for sock in flood:
            sock.close()
    finally:
        loop_thread.run(server.stop())


def test_a_flood_from_one_address_cannot_push_out_another_address(
    loop_thread: LoopThread,
) -> None:
    """One address's flood is held only up to the per-peer budget, its oldest connections
    pushed out; a slow client's unauthenticated connection from another address stays, and
    completes its pull once it sends the rest of its request."""
    server, port = _tcp_server(loop_thread)
    listener = server._listener
    # The slow client must outlive the flood's setup even on a loaded CI machine (CI once
    # took over the default 3 s to open the 100 connections, and the slow one expired).
    listener.preauth_seconds = 60.0
    try:
        frame = fr.encode_request(fr.Request(fr.OP_PULL, TOKEN, "ok", IDS, LAYOUT.bytes_per_block))
        slow = socket.create_connection(("127.0.0.1", port), 5.0, ("127.0.0.2", 0))
        slow.sendall(frame[:10])
        flood = _open_flood(port, 100, source="127.0.0.3", frames=[b""])  # silent
        _eventually(lambda: _budgets(loop_thread, listener)[0] == 100 - fr.MAX_PREAUTH_PER_PEER)
        refused, preauth = _budgets(loop_thread, listener)
        assert preauth == fr.MAX_PREAUTH_PER_PEER + 1
        assert sum(_is_closed(sock, 0.0) for sock in flood) == refused
        assert not any(_is_closed(sock, 0.0) for sock in flood[-fr.MAX_PREAUTH_PER_PEER :])
        assert not _is_closed(slow, 0.0)
        slow.sendall(frame[10:])
        reason, message, payload = _read_reply(slow)
        assert reason == "ok" and len(payload) == len(IDS) * LAYOUT.bytes_per_block, message
        slow.close()
        for sock in flood:
            sock.close()
        _eventually(lambda: listener.num_connections == 0)
    finally:
        loop_thread.run(server.stop())


def test_the_torch_transport_listens_only_on_its_own_host(
    servers: dict[str, ServerProcess],
) -> None:
    """During a pair's life, every socket the torch server's process listens on is bound to
    the host it was given (before, its TCPStore listened on every interface), and its address
    names no store port."""
    if "torch" not in servers:
        pytest.skip("the torch KV transport cannot run on this machine")
    server = servers["torch"]
    assert "store" not in server.address
    expected = make_kv_cache(LAYOUT, NUM_BLOCKS, 7)[IDS]

    async def pull_and_look() -> list[str]:
        client = TorchKVClient(TOKEN)
        try:
            assert torch.equal(await client.pull(server.address, "ok", IDS, LAYOUT, 10), expected)
            sockets = psutil.Process(server.process.pid).net_connections(kind="inet")
            return [c.laddr.ip for c in sockets if c.status == "LISTEN"]
        finally:
            await client.close()

    listening = asyncio.run(pull_and_look())
    assert listening and set(listening) == {"127.0.0.1"}, listening


def test_a_pair_store_needs_the_token_and_the_pair_id(loop_thread: LoopThread) -> None:
    """A pair's rendezvous store answers only requests with the token and the pair's secret
    id (an outsider cannot read or write a group's keys, so cannot join or disturb it); a
    CONNECT without the token gets no pair id; the store goes with the pair."""
    source = TensorBlockSource(make_kv_cache(LAYOUT, NUM_BLOCKS, 7), lease_seconds=60.0)
    source.pin("ok", IDS, with_checksums=False)
    server = TorchKVServer(source, LAYOUT, TOKEN)
    address = loop_thread.run(server.start("127.0.0.1"))
    port = fr.parse_address(address, "torch")[1]

    async def pull_then_probe() -> None:
        client = TorchKVClient(TOKEN)
        outsider = TorchKVClient("wrong")
        try:
            await client.pull(address, "ok", IDS, LAYOUT, 10.0)
            [pair_id] = server._stores
            with pytest.raises(TransferError) as info:
                await outsider.pull(address, "ok", IDS, LAYOUT, 10.0)
            assert info.value.reason == "refused"
            assert list(server._stores) == [pair_id]  # no pair for the outsider

            def probe(token: str, pair: str) -> object:
                store = RemoteStore(("127.0.0.1", port), token, pair, 5.0)
                try:
                    return store.check(["pdserve-kv/0/0"])
                except RuntimeError as exc:
                    return str(exc)

            assert "refused" in str(await asyncio.to_thread(probe, "wrong", pair_id))
            assert "refused" in str(await asyncio.to_thread(probe, TOKEN, "f" * 32))
            assert await asyncio.to_thread(probe, TOKEN, pair_id) is True  # gloo's rank 0 key
        finally:
            await client.close()
            await outsider.close()

    try:
        asyncio.run(pull_then_probe())
        _eventually(lambda: not server._stores)  # dropped with the pair's connection
        assert server.stats.failures == {"refused": 3}
    finally:
        loop_thread.run(server.stop())
