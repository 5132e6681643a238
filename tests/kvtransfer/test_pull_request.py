"""The client-side pull every transport shares: its request frame, the size check of a reply,
the advertised address, and transport constructors that pass the common arguments on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, TransferError
from kvtransfer import framing as fr
from kvtransfer.base import PullRequest
from kvtransfer.metrics import TransferMetrics
from kvtransfer.shm import ShmKVClient, ShmKVServer
from kvtransfer.tcp import TcpKVClient, TcpKVServer
from kvtransfer.torch_dist import TorchKVClient

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)


def _pull(num_blocks: int, streamed: bool = False) -> PullRequest:
    out = LAYOUT.empty_blocks(num_blocks)
    return PullRequest("tcp://h:1", "req", list(range(num_blocks)), out, 5.0, streamed)


@pytest.mark.parametrize("streamed", [False, True])
def test_encode_pull_is_the_wire_request(streamed: bool) -> None:
    """Byte for byte the frame transports built by hand before PullRequest: header, token,
    request id, little-endian int64 block ids; the op tells a streamed part."""
    pull = _pull(3, streamed)
    frame = fr.encode_pull(pull, "tok")
    op = fr.OP_PULL_READY if streamed else fr.OP_PULL
    header = fr.REQUEST_HEADER.pack(fr.MAGIC, fr.VERSION, op, 3, 3, 3, LAYOUT.bytes_per_block)
    assert frame == header + b"tok" + b"req" + np.arange(3, dtype="<i8").tobytes()
    assert fr.parse_request(frame) == fr.Request(op, "tok", "req", [0, 1, 2], pull.bytes_per_block)
    assert fr.parse_request(fr.encode_pull(pull, None)).token == ""


def test_announced_blocks() -> None:
    per_block = LAYOUT.bytes_per_block
    assert _pull(3).announced_blocks(3 * per_block) == 3
    for wrong in (0, 2 * per_block, 4 * per_block):  # a plain pull takes all or nothing
        with pytest.raises(TransferError) as err:
            _pull(3).announced_blocks(wrong)
        assert err.value.reason == "size_mismatch"
    streamed = _pull(3, streamed=True)
    assert [streamed.announced_blocks(n * per_block) for n in range(4)] == [0, 1, 2, 3]
    for wrong in (per_block + 1, 4 * per_block):  # mid-block, or more than asked for
        with pytest.raises(TransferError):
            streamed.announced_blocks(wrong)


@pytest.mark.parametrize("host", ["10.0.0.7", "::1"])
def test_format_address_round_trips(host: str) -> None:
    address = fr.format_address("tcp", host, 4242)
    assert address == ("tcp://[::1]:4242" if ":" in host else "tcp://10.0.0.7:4242")
    assert fr.parse_address(address, "tcp") == (host, 4242, {})


def test_constructors_pass_the_common_arguments_on() -> None:
    metrics = TransferMetrics()
    source = TensorBlockSource(torch.zeros(4, *LAYOUT.block_shape), 60.0)
    server = TcpKVServer(source, LAYOUT, "tok", metrics, chunk_bytes=0)
    assert (server.source, server.layout, server.token, server.metrics) == (
        source,
        LAYOUT,
        "tok",
        metrics,
    )
    assert server.chunk_bytes == 0 and server.zero_copy
    shm = ShmKVServer(source, LAYOUT, "tok", path="/dev/shm/x")
    assert (shm.token, shm.path) == ("tok", "/dev/shm/x")
    for client_cls in (TcpKVClient, ShmKVClient, TorchKVClient):
        client = client_cls("tok", "cpu", metrics)
        assert (client.token, client.device, client.metrics) == (
            "tok",
            torch.device("cpu"),
            metrics,
        )
    assert TcpKVClient(max_idle_per_server=1).connections.max_idle_per_server == 1
    with pytest.raises(TypeError):
        TorchKVClient(max_idle_per_server=1)  # torch keeps one pair per server: no such option
    with pytest.raises(TypeError):
        TcpKVServer(source, LAYOUT, path="/dev/shm/x")  # shm's option, not tcp's
