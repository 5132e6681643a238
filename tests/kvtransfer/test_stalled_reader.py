"""A reader that stops reading holds pinned blocks one lease at most (tcp, real sockets).

A raw client sends a valid pull for many blocks (far more bytes than the sockets buffer) and then
never reads. The server's send has a deadline (the lease): it gives up, closes the connection,
the read ends, and a Release that came meanwhile drops the pin: the reader count returns to zero
and ``on_unpin`` frees the blocks. Before, the sender sat in ``sock_sendall`` forever.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import torch

from kvtransfer import KVLayout, TensorBlockSource
from kvtransfer import framing as fr
from kvtransfer.tcp import TcpKVServer

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16)  # 128 KiB a block
NUM_BLOCKS = 256  # 32 MiB: far beyond what the two sockets' buffers hold
LEASE_SECONDS = 0.5
TOKEN = "t0k3n"


def wait_until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_stalled_reader_is_cut_off_and_its_pin_dropped() -> None:
    kv = torch.zeros((NUM_BLOCKS, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    freed: list[str] = []
    source = TensorBlockSource(kv, LEASE_SECONDS, on_unpin=freed.append)
    ids = list(range(NUM_BLOCKS))
    source.pin("req@1", ids, with_checksums=False, request_id="req")
    loop = asyncio.new_event_loop()
    server = TcpKVServer(source, LAYOUT, TOKEN)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    address = asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    _, port, _ = fr.parse_address(address, "tcp")
    client = socket.create_connection(("127.0.0.1", port))
    try:
        pull = fr.Request(fr.OP_PULL, TOKEN, "req@1", ids, LAYOUT.bytes_per_block)
        client.sendall(fr.encode_request(pull))  # ... and never read the answer
        assert wait_until(lambda: source.num_readers == 1, 5)
        assert source.release("req@1")  # the decode worker's Release: the read holds the pin
        time.sleep(0.1)
        assert source.holds("req@1") and freed == []
        start = time.monotonic()
        assert wait_until(lambda: source.num_readers == 0 and freed == ["req"], 5)
        assert time.monotonic() - start < LEASE_SECONDS + 1.0
        assert not source.holds("req@1")
        assert server.stats.failures == {"timeout": 1}
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
