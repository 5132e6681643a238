"""Wire-level robustness: malformed frames to real servers, and lying or dying peers."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, TransferError, make_client
from kvtransfer import framing as fr
from kvtransfer.server_process import ServerProcess, ServerSpec, make_kv_cache
from kvtransfer.tcp import TcpKVServer

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
TOKEN = "t0k3n"
PINS = {"ok": [0, 3]}


def _header(op: int = fr.OP_PULL, token_len: int = 0, id_len: int = 0, num: int = 0) -> bytes:
    return fr.REQUEST_HEADER.pack(
        fr.MAGIC, fr.VERSION, op, token_len, id_len, num, LAYOUT.bytes_per_block
    )


def _malformed_frames() -> list[bytes]:
    rng = random.Random(7)
    frames = [
        b"",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PDKV",  # truncated header
        fr.REQUEST_HEADER.pack(b"PDKV", 99, fr.OP_PULL, 0, 0, 0, 0),  # bad version
        _header(op=77),  # unknown op
        _header(token_len=fr.MAX_TOKEN_LEN + 1),
        _header(num=fr.MAX_BLOCKS + 1),
        _header(token_len=2, id_len=2) + b"\xff\xfe\xff\xfe",  # not UTF-8
        _header(token_len=len(TOKEN), id_len=2, num=1) + TOKEN.encode() + b"ok" + b"\x01",
        _header(token_len=len(TOKEN), id_len=2, num=1)
        + TOKEN.encode()
        + b"ok"
        + struct.pack("<q", -5),  # negative block id
    ]
    frames += [rng.randbytes(fr.REQUEST_HEADER.size + rng.randrange(40)) for _ in range(20)]
    frames += [fr.MAGIC + rng.randbytes(30) for _ in range(10)]
    return frames


def _send_raw(port: int, frame: bytes) -> bytes:
    """Send ``frame``, half-close, and read whatever comes back until EOF or reset (5 s max)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        chunks = []
        try:
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:  # the server already closed, maybe with our garbage still unread
            pass
    return b"".join(chunks)


def _valid_pull(transport: str, address: str) -> torch.Tensor:
    async def run() -> torch.Tensor:
        client = make_client(transport, token=TOKEN)
        try:
            return await client.pull(address, "ok", PINS["ok"], LAYOUT, 10.0)
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.fixture(scope="module", params=["tcp", "torch"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    spec = ServerSpec(request.param, LAYOUT, 8, seed=3, token=TOKEN, pins=PINS)
    with ServerProcess(spec) as proc:
        yield proc


def test_malformed_frames_do_not_kill_the_server(server: ServerProcess):
    port = fr.parse_address(server.address, server.spec.transport)[1]
    for frame in _malformed_frames():
        reply = _send_raw(port, frame)
        if reply:
            status, message, _ = fr.parse_reply(reply)
            assert fr.STATUS_REASONS[status] in ("protocol", "refused"), message
    blocks = _valid_pull(server.spec.transport, server.address)
    assert torch.equal(blocks, make_kv_cache(LAYOUT, 8, 3)[PINS["ok"]])
    assert server.stats()["failures"]["protocol"] >= 5


class FakeServer:
    """A one-shot tcp peer: reads the request, answers ``reply`` + ``payload``, hangs up."""

    def __init__(self, reply: bytes, payload: bytes = b""):
        self.reply, self.payload = reply, payload
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)  # the request (small enough to arrive at once)
            conn.sendall(self.reply + self.payload)
        self.sock.close()


def _pull_fake(fake: FakeServer, num_blocks: int) -> TransferError:
    async def run() -> None:
        client = make_client("tcp", token=TOKEN)
        try:
            await client.pull(fake.address, "x", list(range(num_blocks)), LAYOUT, 5.0)
        finally:
            await client.close()

    with pytest.raises(TransferError) as info:
        asyncio.run(run())
    fake.thread.join(5)
    return info.value


FULL = 4 * LAYOUT.bytes_per_block


def test_connection_lost_mid_payload_returns_nothing():
    fake = FakeServer(fr.encode_reply(fr.STATUS_OK, "", FULL), b"\x01" * (FULL // 2))
    assert _pull_fake(fake, 4).reason == "connection_lost"


def test_wrong_announced_size_is_a_size_mismatch():
    fake = FakeServer(fr.encode_reply(fr.STATUS_OK, "", FULL + 4), b"\x01" * (FULL + 4))
    assert _pull_fake(fake, 4).reason == "size_mismatch"


def test_garbage_reply_is_a_protocol_error():
    fake = FakeServer(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    assert _pull_fake(fake, 4).reason == "protocol"


class _ExpiringSource(TensorBlockSource):
    """Fails its reads after ``reads_left`` of them (a source that breaks mid-transfer; a
    lease that runs out mid-transfer does not: see test_lease_expiry.py)."""

    reads_left = 2

    def copy_blocks(self, block_ids: list[int]) -> torch.Tensor:
        self.reads_left -= 1
        if self.reads_left < 0:
            raise KeyError("gone")
        return super().copy_blocks(block_ids)


def test_chunked_sending_and_abort_mid_transfer():
    kv = make_kv_cache(LAYOUT, 32, seed=5)
    ids = list(range(31, 0, -3))  # 11 blocks -> 4 chunks of 3 blocks
    source, expiring = TensorBlockSource(kv), _ExpiringSource(kv)
    source.pin("r", ids)
    expiring.pin("r", ids)

    async def run() -> None:
        chunk = 3 * LAYOUT.bytes_per_block
        servers = [
            TcpKVServer(s, LAYOUT, TOKEN, chunk_bytes=chunk, zero_copy=False)
            for s in (source, expiring)
        ]
        good, bad = [await s.start() for s in servers]
        client = make_client("tcp", token=TOKEN)
        blocks = await client.pull(good, "r", ids, LAYOUT, 5.0)
        assert torch.equal(blocks, kv[ids])
        with pytest.raises(TransferError) as info:
            await client.pull(bad, "r", ids, LAYOUT, 5.0)
        assert info.value.reason == "connection_lost"
        assert servers[1].stats.failures == {"unknown_request": 1}
        await client.close()
        for server in servers:
            await server.stop()

    asyncio.run(run())
