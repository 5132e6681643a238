"""The KV a decode worker holds after a pull is, bit for bit, the KV it would have computed
itself (float32, every layer, every token slot of the prompt), on every transport, with the KV
streamed while the prompt computes and pulled once it is done. Token equality alone cannot catch
a transfer that swaps, shifts or truncates blocks, or a streamed part sent before its chunk was
written.

Real prefill worker processes (one per transport) compute the prompt in 16-token chunks; the
decode side is this process's engine (the engine a decode worker runs) with the transport's real
client, doing what the decode service does: admit, take the pull plan, pull (verified), commit.
The same engine computing the prompt itself, with the same chunks, gives the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtransfer
from common.sampling_params import SamplingParams
from common.settings import from_fields
from common.wire import params_to_proto
from kvtransfer.base import KVLayout
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.worker.convert import layout_from_proto
from services.worker.launcher import WorkerProcess
from tests.conftest import PROMPTS, assert_no_leaks
from tests.services.workers import AUTH, prefill, running, used_blocks

CHUNK = 16  # prefill tokens per step, on both sides: the reference is computed the same way
TRANSPORTS = [t for t in ("tcp", "shm", "torch", "ucx") if t in kvtransfer.available_transports()]
PARAMS = SamplingParams(temperature=0, max_tokens=4)
TOKEN = os.environ["PDSERVE_CLUSTER_TOKEN"]  # conftest's: the workers' cluster token


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The decode side (and the reference): no prefix cache, so nothing is reused between
    requests and every slot compared was written by this request."""
    config = from_fields(
        EngineConfig,
        num_threads=1,
        num_blocks=96,
        enable_prefix_caching=False,
        max_num_batched_tokens=CHUNK,
    )
    return LLMEngine(config)


@pytest.fixture(scope="module")
def prompt(engine: LLMEngine) -> list[int]:
    ids = engine.tokenizer.encode(" ".join(PROMPTS * 3))  # some 250 tokens, ~16 chunks
    assert len(ids) % engine.pool.block_size, "the last block must be partly filled"
    return ids


@pytest.fixture(scope="module")
def reference(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """The prompt's KV as the engine computes it: its blocks, in prompt order."""
    engine.add_request("reference", prompt, PARAMS, pin_blocks=True)
    block_ids = None
    while block_ids is None:
        for output in engine.step():
            block_ids = output.kv_block_ids
    blocks = engine.runner.kv_cache[block_ids].clone()
    engine.release_pinned("reference")
    assert_no_leaks(engine)
    return blocks


@pytest.fixture(scope="module")
def prefill_workers(redis_server) -> Iterator[dict[str, WorkerProcess]]:  # type: ignore[no-untyped-def]
    # No prefix cache there either: each request computes the whole prompt (and streams it).
    base = [
        "--redis-url",
        redis_server.url,
        "--max-num-batched-tokens",
        str(CHUNK),
        "--no-prefix-caching",
    ]
    specs = [
        ("prefill", [*base, "--kv-transport", t, "--redis-prefix", f"eq-{t}:"]) for t in TRANSPORTS
    ]
    with running(specs) as workers:
        yield dict(zip(TRANSPORTS, workers))


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pulled_kv_is_bitwise_the_locally_computed_kv(
    transport: str,
    streamed: bool,
    engine: LLMEngine,
    prompt: list[int],
    reference: torch.Tensor,
    prefill_workers: dict[str, WorkerProcess],
) -> None:
    worker = prefill_workers[transport]
    rid = f"eq-{transport}-{'streamed' if streamed else 'whole'}"
    pull = _streamed_pull if streamed else _whole_pull
    try:
        block_ids = asyncio.run(pull(engine, worker, transport, rid, prompt))
        pulled = engine.runner.kv_cache[block_ids]
    finally:
        engine.abort_request(rid)
    num_tokens, block_size = len(prompt), engine.pool.block_size
    for layer in range(engine.model.config.num_layers):
        for kind, name in ((0, "keys"), (1, "values")):
            got = _slots(pulled[:, layer, kind], num_tokens, block_size)
            want = _slots(reference[:, layer, kind], num_tokens, block_size)
            diff = (got - want).abs().max().item()
            assert torch.equal(got, want), f"layer {layer} {name} differ (max |diff| {diff:g})"
    assert_no_leaks(engine)
    assert _wait(lambda: used_blocks(worker) == 0)


def _slots(blocks: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """[blocks, kv_heads, block_size, head_dim] -> [num_tokens, kv_heads, head_dim]: the
    prompt's token slots only (the last block's tail was never written)."""
    tokens = blocks.permute(0, 2, 1, 3).reshape(-1, blocks.shape[1], blocks.shape[3])
    assert tokens.shape[0] >= num_tokens > tokens.shape[0] - block_size
    return tokens[:num_tokens]


async def _whole_pull(
    engine: LLMEngine, worker: WorkerProcess, transport: str, rid: str, prompt: list[int]
) -> list[int]:
    """Prefill, then pull the finished prompt's blocks (verified against the handle's
    checksums) into the engine; returns the engine's blocks holding the prompt."""
    answer = await prefill(worker.info["grpc_address"], rid, prompt, PARAMS)
    handle = answer.kv
    plan = _admit(engine, rid, prompt, answer.first_token)
    client = kvtransfer.make_client(transport, token=TOKEN)
    try:
        blocks = await client.pull_verified(
            handle.address,
            handle.request_id,
            [handle.block_ids[i] for i in plan.block_indices],
            layout_from_proto(handle.layout),
            30.0,
            [handle.checksums[i] for i in plan.block_indices],
        )
    finally:
        await client.close()
        await _release(worker, handle)
    engine.commit_pull(plan, blocks)
    return plan.dest_block_ids


async def _streamed_pull(
    engine: LLMEngine, worker: WorkerProcess, transport: str, rid: str, prompt: list[int]
) -> list[int]:
    """PrefillStream: pull the blocks while the prompt still computes (in several parts), the
    first token coming with the last one; returns the engine's blocks holding the prompt."""
    async with grpc.aio.insecure_channel(worker.info["grpc_address"]) as channel:
        call = pb_grpc.PrefillServiceStub(channel).PrefillStream(
            pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=params_to_proto(PARAMS)),
            timeout=60,
            metadata=AUTH,
        )
        handle = (await call.read()).kv
        assert handle.streaming
        plan = _admit(engine, rid, prompt, None)
        layout: KVLayout = layout_from_proto(handle.layout)
        client = kvtransfer.make_client(transport, token=TOKEN)
        try:
            ids = [handle.block_ids[i] for i in plan.block_indices]
            key = handle.request_id  # the pin's handle
            result = await client.pull_streamed(handle.address, key, ids, layout, 30.0)
        finally:
            await client.close()
        answer = (await call.read()).done
    await _release(worker, handle)
    assert result.num_parts >= 2, "the prompt's blocks came in one part: nothing streamed"
    assert result.final is not None and result.final["first_token"] == answer.first_token
    engine.commit_pull(plan, result.blocks, answer.first_token)
    return plan.dest_block_ids


def _admit(engine: LLMEngine, rid: str, prompt: list[int], first_token: int | None):  # type: ignore[no-untyped-def]
    """Queue a prefilled request and step until the scheduler reserves its blocks."""
    assert engine.add_prefilled_request(rid, prompt, first_token, PARAMS) is None
    for _ in range(10):
        engine.step()
        plans = engine.take_pull_plans()
        if plans:
            [plan] = plans
            assert plan.block_indices == list(range(-(-len(prompt) // engine.pool.block_size)))
            return plan
    raise AssertionError("the request was never admitted")


async def _release(worker: WorkerProcess, handle: pb.KVHandle) -> None:
    async with grpc.aio.insecure_channel(worker.info["grpc_address"]) as channel:
        await pb_grpc.PrefillServiceStub(channel).Release(
            pb.ReleaseRequest(request_id=handle.request_id), timeout=10, metadata=AUTH
        )


def _wait(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ----- every length, n and mode, over each transport ---------------------------------------------
SAMPLED = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
_ATTEMPTS = itertools.count()  # hypothesis may run an example again: ids stay unique


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    length=st.one_of(st.sampled_from([1, 16, 17, 33, 48, 49]), st.integers(2, 320)),
    n=st.sampled_from([1, 2, 3]),
    streamed=st.booleans(),
    salt=st.integers(0, 10**6),
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_any_length_n_and_mode_over_the_transport(
    transport: str,
    length: int,
    n: int,
    streamed: bool,
    salt: int,
    engine: LLMEngine,
    prefill_workers: dict[str, WorkerProcess],
) -> None:
    """A sampled prompt length (the block size's special residues among them), n and hand-off
    mode, through a real prefill worker and the transport's real client: the KV in place after
    the first step here is bitwise the locally computed KV (but for the last prompt token with
    n > 1, computed here in a step of its own: float32 rounding), and the greedy tokens of
    every sequence are the local run's."""
    prompt = _prompt(length, salt)
    rid = f"any-{transport}-{length}-{n}-{int(streamed)}-{salt}-{next(_ATTEMPTS)}"
    want_tokens, want_kv = _local(engine, f"{rid}-local", prompt, SAMPLED)
    worker = prefill_workers[transport]
    try:
        tokens, kv = asyncio.run(_handed_over(engine, worker, transport, rid, prompt, n, streamed))
    finally:
        engine.abort_request(rid)  # a no-op when it finished
    assert tokens == [want_tokens] * n
    exact = length if n == 1 else length - 1
    assert torch.equal(kv[:exact], want_kv[:exact]), "the pulled KV differs"
    torch.testing.assert_close(kv, want_kv, rtol=1e-5, atol=1e-4)
    assert_no_leaks(engine)
    assert _wait(lambda: used_blocks(worker) == 0)


def _prompt(length: int, salt: int) -> list[int]:
    generator = torch.Generator().manual_seed(length * 7919 + salt)
    return torch.randint(100, 40_000, (length,), generator=generator).tolist()


def _token_slots(engine: LLMEngine, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[num_tokens, layers, 2, kv_heads, head_dim]: the first token slots of ``block_ids``."""
    blocks = engine.runner.kv_cache[torch.tensor(block_ids, dtype=torch.long)]
    tokens = blocks.permute(0, 4, 1, 2, 3, 5)
    return tokens.reshape(-1, *tokens.shape[2:])[:num_tokens].clone()


def _run(engine: LLMEngine, rid: str, steps: int | None = None) -> dict[int, list[int]]:
    """Step the engine (``steps`` times, or until ``rid`` finishes): ``rid``'s new tokens per
    sequence index."""
    tokens: dict[int, list[int]] = {}
    count = 0
    while steps is None or count < steps:
        count += 1
        for out in engine.step():
            if out.request_id != rid:
                continue
            for seq_out in out.outputs:
                tokens.setdefault(seq_out.index, []).extend(seq_out.token_ids)
            if out.finished:
                return tokens
    return tokens


def _local(
    engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of the engine computing the prompt itself, and its KV right then."""
    engine.add_request(rid, prompt, params)
    [seq] = engine.sequences(rid)
    tokens: dict[int, list[int]] = {}
    while not tokens:
        tokens = _run(engine, rid, steps=1)
    kv = _token_slots(engine, seq.block_table, len(prompt))
    tokens[0] += _run(engine, rid).get(0, [])
    return tokens[0], kv


async def _handed_over(
    engine: LLMEngine,
    worker: WorkerProcess,
    transport: str,
    rid: str,
    prompt: list[int],
    n: int,
    streamed: bool,
) -> tuple[list[list[int]], torch.Tensor]:
    """The prompt computed by the prefill worker, its KV pulled over ``transport`` (streamed:
    while it computes, the first token with the last part) into the engine, which decodes:
    every sequence's tokens (the first included) and the prompt's KV after the first step."""
    params = dataclasses.replace(SAMPLED, n=n)
    request = pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=params_to_proto(SAMPLED))
    client = kvtransfer.make_client(transport, token=TOKEN)
    async with grpc.aio.insecure_channel(worker.info["grpc_address"]) as channel:
        stub = pb_grpc.PrefillServiceStub(channel)
        handle = None
        try:
            if streamed:
                call = stub.PrefillStream(request, timeout=60, metadata=AUTH)
                handle = (await call.read()).kv
                first = None
            else:
                answer = await stub.Prefill(request, timeout=60, metadata=AUTH)
                handle, first = answer.kv, answer.first_token
            assert engine.add_prefilled_request(rid, prompt, first, params) is None
            plan = _plan_of(engine, rid)
            ids = [handle.block_ids[i] for i in plan.block_indices]
            layout = layout_from_proto(handle.layout)
            if streamed and not ids:  # n > 1 of a one-token prompt: nothing to pull
                first = (await call.read()).done.first_token
                engine.commit_pull(plan, engine.runner.kv_cache[:0], first)
            elif streamed:
                key = handle.request_id  # the pin's handle
                result = await client.pull_streamed(handle.address, key, ids, layout, 30.0)
                assert result.final is not None, "the last part came without the first token"
                first = (await call.read()).done.first_token
                assert result.final["first_token"] == first
                engine.commit_pull(plan, result.blocks, first)
            else:
                checksums = [handle.checksums[i] for i in plan.block_indices]
                blocks = await client.pull_verified(
                    handle.address, handle.request_id, ids, layout, 30.0, checksums
                )
                engine.commit_pull(plan, blocks)
        finally:
            await client.close()
            release = pb.ReleaseRequest(request_id=handle.request_id)
            await stub.Release(release, timeout=10, metadata=AUTH)
    seq = engine.sequences(rid)[0]
    tokens = _run(engine, rid, steps=1)
    kv = _token_slots(engine, seq.block_table, len(prompt))
    for index, more in _run(engine, rid).items():
        tokens.setdefault(index, []).extend(more)
    tokens[0] = [first, *tokens.get(0, [])]
    return [tokens[i] for i in range(n)], kv


def _plan_of(engine: LLMEngine, rid: str):  # type: ignore[no-untyped-def]
    for _ in range(10):
        engine.step()
        plans = [p for p in engine.take_pull_plans() if p.request_id == rid]
        if plans:
            return plans[0]
    raise AssertionError("the request was never admitted")
