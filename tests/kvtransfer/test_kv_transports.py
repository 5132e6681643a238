"""Every available transport against a real server in another process.

Each transport gets one long-lived server process (pulls, refusals, counters) and one that the
fault tests hang and SIGKILL. Transports that cannot run here are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    ChecksumError,
    KVLayout,
    TransferError,
    TransferState,
    available_transports,
    block_checksums,
    make_client,
)
from kvtransfer.server_process import STALL_REQUEST, ServerProcess, ServerSpec, make_kv_cache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
NUM_BLOCKS = 64
SEED = 1234
TOKEN = "cluster-secret"
PINS = {
    "req-a": [5, 1, 9, 33],
    "req-big": list(range(0, 64, 2)),
    "req-runs": [10, 11, 12, 20, 21, 7],  # runs of consecutive blocks: one zero-copy view each
    STALL_REQUEST: [0],
}


def _transport_params() -> list[object]:
    found = available_transports()
    reasons = {"ucx": "ucxx is not installed here (pip install 'pdserve[ucx]')"}
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name not in found, reason=reasons.get(name, f"{name} transport unavailable")
            ),
        )
        for name in ("tcp", "torch", "ucx", "shm")
    ]


def _spec(transport: str) -> ServerSpec:
    return ServerSpec(transport, LAYOUT, NUM_BLOCKS, SEED, TOKEN, PINS)


@pytest.fixture(scope="module", params=_transport_params())
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    with ServerProcess(_spec(request.param)) as proc:
        yield proc


@pytest.fixture(scope="module")
def kv_cache() -> torch.Tensor:
    return make_kv_cache(LAYOUT, NUM_BLOCKS, SEED)


def _pull(
    transport: str,
    address: str,
    request_id: str,
    block_ids: list[int],
    token: str | None = TOKEN,
    timeout: float = 10.0,
    layout: KVLayout = LAYOUT,
) -> torch.Tensor:
    async def run() -> torch.Tensor:
        client = make_client(transport, token=token)
        try:
            return await client.pull(address, request_id, block_ids, layout, timeout)
        finally:
            await client.close()

    return asyncio.run(run())


def _expect_failure(reason: str, *args: object, **kwargs: object) -> TransferError:
    with pytest.raises(TransferError) as info:
        _pull(*args, **kwargs)  # type: ignore[arg-type]
    assert info.value.reason == reason, info.value
    return info.value


def test_pull_is_bit_exact_and_checksums_verify(server: ServerProcess, kv_cache: torch.Tensor):
    transport = server.spec.transport
    for request_id in ("req-a", "req-big", "req-runs"):
        ids = PINS[request_id]
        blocks = _pull(transport, server.address, request_id, ids)
        expected = kv_cache[ids]
        assert blocks.shape == (len(ids), *LAYOUT.block_shape)
        assert blocks.dtype == torch.float32
        assert torch.equal(blocks.view(torch.int32), expected.view(torch.int32))
        assert block_checksums(blocks) == block_checksums(expected)


def test_pull_verified_checks_checksums(server: ServerProcess, kv_cache: torch.Tensor):
    ids = PINS["req-a"]
    good = block_checksums(kv_cache[ids])
    bad = list(good)
    bad[2] ^= 1

    async def run() -> None:
        client = make_client(server.spec.transport, token=TOKEN)
        try:
            blocks = await client.pull_verified(server.address, "req-a", ids, LAYOUT, 10.0, good)
            assert torch.equal(blocks, kv_cache[ids])
            with pytest.raises(ChecksumError) as info:
                await client.pull_verified(server.address, "req-a", ids, LAYOUT, 10.0, bad)
            assert info.value.block_index == 2 and info.value.reason == "checksum"
            assert client.stats.failures == {"checksum": 1}
        finally:
            await client.close()

    asyncio.run(run())


def test_subset_and_repeated_pulls_on_one_client(server: ServerProcess, kv_cache: torch.Tensor):
    transport = server.spec.transport

    async def run() -> list[torch.Tensor]:
        client = make_client(transport, token=TOKEN)
        try:
            pulls = [client.pull(server.address, "req-a", [9, 5], LAYOUT, 10.0) for _ in range(3)]
            out = list(await asyncio.gather(*pulls))
            staging = LAYOUT.empty_blocks(1)
            into = await client.pull(server.address, "req-a", [33], LAYOUT, 10.0, out=staging)
            assert into is staging
            out.append(into)
            assert client.stats.num_ok == 4 and client.stats.num_failed == 0
            assert client.states == {}
            return out
        finally:
            await client.close()

    *pairs, single = asyncio.run(run())
    for blocks in pairs:
        assert torch.equal(blocks, kv_cache[[9, 5]])
    assert torch.equal(single, kv_cache[[33]])


def test_wrong_token_is_refused_and_counted(server: ServerProcess):
    transport = server.spec.transport
    before = server.stats()["failures"].get("refused", 0)
    _expect_failure("refused", transport, server.address, "req-a", [1], token="wrong")
    _expect_failure("refused", transport, server.address, "req-a", [1], token=None)
    assert server.stats()["failures"].get("refused", 0) == before + 2


def test_unknown_request_and_unpinned_block_are_refused(server: ServerProcess):
    transport = server.spec.transport
    _expect_failure("unknown_request", transport, server.address, "no-such-request", [1])
    _expect_failure("unknown_request", transport, server.address, "req-a", [2])  # not pinned
    assert server.stats()["failures"].get("unknown_request", 0) >= 2


def test_layout_mismatch_is_refused(server: ServerProcess):
    other = KVLayout(2, 2, 16, 16, "float32")
    err = _expect_failure(
        "size_mismatch", server.spec.transport, server.address, "req-a", [1], layout=other
    )
    assert "bytes per block" in str(err)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_client_counts_failures_and_states():
    async def run() -> None:
        client = make_client("tcp", token=TOKEN)
        address = f"tcp://127.0.0.1:{_closed_port()}"  # nothing listens there
        with pytest.raises(TransferError) as info:
            await client.pull(address, "r", [0], LAYOUT, 2.0)
        assert info.value.reason == "connection_lost"
        assert client.stats.failures == {"connection_lost": 1}
        assert "r" not in client.states
        await client.close()

    asyncio.run(run())


@pytest.fixture(scope="module", params=_transport_params())
def faulty_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    with ServerProcess(_spec(request.param)) as proc:
        yield proc


def test_hung_server_times_out(faulty_server: ServerProcess):
    start = time.monotonic()
    _expect_failure(
        "timeout",
        faulty_server.spec.transport,
        faulty_server.address,
        STALL_REQUEST,
        [0],
        timeout=1.0,
    )
    assert time.monotonic() - start < 4.0


def test_killed_server_fails_fast(faulty_server: ServerProcess):
    """SIGKILL the server while a pull waits on it: TransferError, long before the timeout."""
    transport, address = faulty_server.spec.transport, faulty_server.address

    async def run() -> tuple[TransferError, float]:
        client = make_client(transport, token=TOKEN)
        pull = asyncio.ensure_future(client.pull(address, STALL_REQUEST, [0], LAYOUT, 20.0))
        await asyncio.sleep(0.5)
        assert client.states[STALL_REQUEST] in (TransferState.PENDING, TransferState.TRANSFERRING)
        start = time.monotonic()
        faulty_server.kill()
        with pytest.raises(TransferError) as info:
            await pull
        await client.close()
        return info.value, time.monotonic() - start

    error, elapsed = asyncio.run(run())
    assert error.reason == "connection_lost", error
    assert elapsed < 10.0
    # A later pull to the dead address fails too: at once (connection refused), except with
    # ucx, whose connect only gives up at the timeout (ucxx does not surface the refusal).
    start = time.monotonic()
    with pytest.raises(TransferError) as info:
        _pull(transport, address, "req-a", [1], timeout=2.0)
    if transport == "ucx":
        assert info.value.reason in ("connection_lost", "timeout")
    else:
        assert info.value.reason == "connection_lost" and time.monotonic() - start < 1.0
