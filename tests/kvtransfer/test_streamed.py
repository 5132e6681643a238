"""Streamed pulls on every transport: a decode worker pulls a prompt's KV blocks while the prefill
still computes them. The test plays the prefill worker: it "computes" blocks one at a time
(the source's progress), then sets the final answer; the client must get every block, exactly,
in several parts, and the final answer with the last one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator

import pytest
import torch

from kvtransfer import KVLayout, TensorBlockSource, available_transports, make_client, make_server
from kvtransfer.base import KVTransferClient, TransferError
from kvtransfer.streaming import STREAM_RECHECK_SECONDS

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
TOKEN = "t0k3n"
PROMPT_BLOCKS = [5, 2, 7, 3, 9]  # the prompt's blocks, in prompt order
NUM_TOKENS = 18  # the last block holds 2 of its 4 slots


def transports() -> list[str]:
    return [t for t in ("tcp", "shm", "torch", "ucx") if t in available_transports()]


def kv_cache(transport: str) -> tuple[torch.Tensor, str | None]:
    shape = (12, *LAYOUT.block_shape)
    if transport != "shm":
        return torch.randn(shape), None
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="pdserve-test-")
    os.close(fd)
    numel = int(torch.Size(shape).numel())
    cache = torch.from_file(path, shared=True, size=numel, dtype=torch.float32).view(shape)
    cache.copy_(torch.randn(shape))
    return cache, path


@contextlib.asynccontextmanager
async def tcp_served(source: TensorBlockSource) -> AsyncIterator[tuple[KVTransferClient, str]]:
    """A tcp KV server of ``source`` and a client of it: (client, address)."""
    server = make_server("tcp", source, LAYOUT, TOKEN)
    address = await server.start("127.0.0.1")
    client = make_client("tcp", token=TOKEN)
    try:
        yield client, address
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("transport", transports())
def test_a_streamed_pull_gets_every_block_as_it_is_computed(transport: str) -> None:
    cache, path = kv_cache(transport)
    computed = [0]

    async def run() -> None:
        source = TensorBlockSource(cache, lease_seconds=5)
        source.pin("req", PROMPT_BLOCKS, progress=lambda: computed[0], num_tokens=NUM_TOKENS)
        options = {"path": path} if path else {}
        server = make_server(transport, source, LAYOUT, TOKEN, **options)
        address = await server.start("127.0.0.1")
        client = make_client(transport, token=TOKEN)
        try:
            wanted = PROMPT_BLOCKS[1:]  # the decode side caches the first block itself
            pull = asyncio.ensure_future(client.pull_streamed(address, "req", wanted, LAYOUT, 10.0))
            for tokens in range(0, NUM_TOKENS + 1, 2):  # the prefill, two tokens at a time
                computed[0] = tokens
                source.progressed()  # as the prefill worker does after each step
                await asyncio.sleep(0.05)
            assert not pull.done(), "the last block waits for the final answer"
            source.finish("req", {"first_token": 42})
            result = await asyncio.wait_for(pull, 10)
            assert result.num_blocks == len(wanted) and result.num_parts >= 3
            assert torch.equal(result.blocks, cache[torch.tensor(wanted)])
            assert result.final == {"first_token": 42}
            assert 0 <= result.exposed_s < result.seconds
        finally:
            await client.close()
            await server.stop()
            if path:
                os.unlink(path)

    asyncio.run(run())


def test_a_prompt_computed_before_its_final_answer_goes_in_one_part_with_it() -> None:
    """Between the prefill's last step and its first token's answer the source sends nothing:
    the rest of the prompt then comes in one part with the final answer, not in two."""
    cache = torch.randn(12, *LAYOUT.block_shape)

    async def run() -> None:
        source = TensorBlockSource(cache, lease_seconds=5)
        source.pin("req", PROMPT_BLOCKS, progress=lambda: NUM_TOKENS, num_tokens=NUM_TOKENS)
        async with tcp_served(source) as (client, address):
            pull = asyncio.ensure_future(
                client.pull_streamed(address, "req", PROMPT_BLOCKS, LAYOUT, 10.0)
            )
            await asyncio.sleep(0.2)
            assert not pull.done() and source.ready_count("req", PROMPT_BLOCKS) == (0, None)
            source.finish("req", {"first_token": 7})
            result = await asyncio.wait_for(pull, 10)
            assert result.num_parts == 1 and result.final == {"first_token": 7}
            assert torch.equal(result.blocks, cache[torch.tensor(PROMPT_BLOCKS)])

    asyncio.run(run())


def test_a_streamed_pull_of_a_request_never_pinned_is_refused() -> None:
    async def run() -> None:
        source = TensorBlockSource(torch.randn(4, *LAYOUT.block_shape))
        async with tcp_served(source) as (client, address):
            with pytest.raises(TransferError) as info:
                await client.pull_streamed(address, "nope", [1], LAYOUT, 5.0)
        assert info.value.reason == "unknown_request"

    asyncio.run(run())


def test_a_streamed_pull_whose_prefill_stalls_ends_at_its_deadline() -> None:
    """Each part's wait renews the lease, so only the request's deadline can end a pull whose
    prefill stopped making progress: it must, with a timeout, and free nothing it holds."""
    cache, _ = kv_cache("tcp")

    async def run() -> None:
        source = TensorBlockSource(cache, lease_seconds=5)
        source.pin("req", PROMPT_BLOCKS, progress=lambda: 4, num_tokens=NUM_TOKENS)  # one block
        async with tcp_served(source) as (client, address):
            start = asyncio.get_running_loop().time()
            with pytest.raises(TransferError) as info:
                await client.pull_streamed(address, "req", PROMPT_BLOCKS, LAYOUT, 10.0, 1.0)
            assert info.value.reason == "timeout"
            assert asyncio.get_running_loop().time() - start < 3.0
            assert source.is_pinned("req")  # the pin is the owner's, untouched by the client

    asyncio.run(run())


class _CountedSource(TensorBlockSource):
    """Records when each pull looked at its blocks."""

    looks: list[float]

    def ready_count(self, key: str, block_ids: list[int]) -> tuple[int, dict | None]:
        self.looks.append(time.monotonic())
        return super().ready_count(key, block_ids)


def test_a_waiting_pull_looks_again_when_a_step_is_announced_not_by_polling() -> None:
    """While the prefill computes, a waiting pull looks at its blocks only when the source
    announces progress (a step, the final answer) or at the re-check bound: not every 2 ms, which
    took the prefill worker's core from its step. An announced step is seen at once."""
    cache = torch.randn(12, *LAYOUT.block_shape)
    computed = [0]

    async def run() -> None:
        source = _CountedSource(cache, lease_seconds=5)
        source.looks = []
        source.pin("req", PROMPT_BLOCKS, progress=lambda: computed[0], num_tokens=NUM_TOKENS)
        async with tcp_served(source) as (client, address):
            pull = asyncio.ensure_future(
                client.pull_streamed(address, "req", PROMPT_BLOCKS, LAYOUT, 10.0)
            )
            await asyncio.sleep(0.6)  # nothing computed: the pull waits
            idle_looks = len(source.looks)
            assert 1 <= idle_looks <= 1 + 0.6 / STREAM_RECHECK_SECONDS + 1, source.looks
            computed[0] = 8  # two blocks
            announced = time.monotonic()
            source.progressed()
            await asyncio.sleep(0.1)
            assert len(source.looks) > idle_looks
            assert source.looks[idle_looks] - announced < 0.05  # seen at once, not re-checked
            computed[0] = NUM_TOKENS
            source.progressed()
            await asyncio.sleep(0.1)
            finished = time.monotonic()
            source.finish("req", {"first_token": 3})
            result = await asyncio.wait_for(pull, 10)
            assert time.monotonic() - finished < 0.1
            assert result.final == {"first_token": 3} and result.num_parts >= 2
            assert torch.equal(result.blocks, cache[torch.tensor(PROMPT_BLOCKS)])
            assert source.progress.num_waiting == 0

    asyncio.run(run())


def test_a_pin_released_while_its_pull_waits_refuses_the_pull_at_once() -> None:
    """The release announces progress: the waiting pull is refused then, not at its re-check."""
    cache = torch.randn(12, *LAYOUT.block_shape)

    async def run() -> None:
        source = TensorBlockSource(cache, lease_seconds=5)
        source.pin("req", PROMPT_BLOCKS, progress=lambda: 0, num_tokens=NUM_TOKENS)
        async with tcp_served(source) as (client, address):
            pull = asyncio.ensure_future(
                client.pull_streamed(address, "req", PROMPT_BLOCKS, LAYOUT, 10.0)
            )
            await asyncio.sleep(0.1)
            released = time.monotonic()
            assert source.release("req")
            with pytest.raises(TransferError) as info:
                await asyncio.wait_for(pull, 10)
            assert info.value.reason == "unknown_request"
            assert time.monotonic() - released < STREAM_RECHECK_SECONDS / 2

    asyncio.run(run())
