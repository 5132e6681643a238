"""The disaggregated request lifecycle across real processes: real Redis, real gRPC servers,
real KV transports on loopback. Block counts are read from each worker's real /metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest

import kvtransfer
from common.wire import params_to_proto
from pdserve import SamplingParams
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.worker.launcher import WorkerProcess
from tests.conftest import PROMPTS
from tests.services.workers import (
    AUTH,
    Result,
    colocated,
    disaggregated,
    metric,
    prefill,
    run,
    running,
    streamed,
    used_blocks,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="module")
def expected(llm):
    """The offline engine's greedy tokens: what every path must reproduce."""
    outs = llm.generate(PROMPTS[:4], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.mark.parametrize("transport", ["tcp", "torch", "ucx", "shm"])
def test_disaggregated_equals_colocated_and_offline(transport, expected, tokenizer, redis_server):
    if transport not in kvtransfer.available_transports():
        pytest.skip(f"KV transport {transport!r} cannot run on this machine (see kvtransfer)")
    args = [
        "--kv-transport",
        transport,
        "--redis-url",
        redis_server.url,
        "--redis-prefix",
        f"t-{transport}:",
    ]
    with running([("prefill", args), ("decode", args), ("colocated", args)]) as (p, d, c):
        for i, prompt in enumerate(PROMPTS[:4]):
            ids = tokenizer.encode(prompt)
            dis = run(
                disaggregated(p.info["grpc_address"], d.info["grpc_address"], f"r{i}", ids, GREEDY)
            )
            col = run(colocated(c.info["grpc_address"], f"c{i}", ids, GREEDY))
            flow = run(
                streamed(p.info["grpc_address"], d.info["grpc_address"], f"s{i}", ids, GREEDY)
            )
            assert dis.kv_source == flow.kv_source == "pulled"
            assert dis.token_ids == col.token_ids == flow.token_ids == expected[i]
            assert dis.text == flow.text == tokenizer.decode(expected[i])
        assert wait_until(lambda: used_blocks(p) == 0 == used_blocks(d), 5)
        assert used_blocks(c) == 0


def test_streamed_kv_from_a_chunked_prefill_equals_offline(redis_server, llm, tokenizer):
    """The prefill computes 16 tokens a step, so the decode worker pulls the prompt's blocks
    in several parts while later chunks compute; the answer is the offline engine's."""
    base = ["--redis-url", redis_server.url, "--redis-prefix", "chunked:"]
    chunked = [*base, "--max-num-batched-tokens", "16"]
    prompt = " ".join(PROMPTS * 3)  # some 250 tokens: many chunks, several blocks
    ids = tokenizer.encode(prompt)
    params = SamplingParams(temperature=0, max_tokens=8)
    offline = llm.generate([prompt], params)[0].outputs[0].token_ids
    with running([("prefill", chunked), ("decode", base)]) as (p, d):
        result = run(streamed(p.info["grpc_address"], d.info["grpc_address"], "ch", ids, params))
        assert result.kv_source == "pulled"
        assert result.token_ids == offline
        assert len(result.handle.block_ids) == -(-len(ids) // 16)
        assert wait_until(lambda: used_blocks(p) == 0 == used_blocks(d), 5)
        assert metric(d, "pdserve_kv_pulls_total", 'outcome="pulled"') == 1


def scrape(worker: WorkerProcess) -> dict[str, float]:
    """Every sample of one /metrics scrape, by name with labels: one snapshot of the engine."""
    url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    lines = (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, _, value in lines if name}


def test_pulled_requests_respect_the_decode_workers_max_num_seqs(redis_server, tokenizer, expected):
    """Six disaggregated requests at once on a decode worker with --max-num-seqs 2: its /metrics,
    polled meanwhile, never show more than 2 running, yet show 2 running while others wait for
    room; every request is pulled and gives the offline tokens; no block leaks."""
    limit = 2
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)  # long enough to overlap
    ids = [tokenizer.encode(prompt) for prompt in PROMPTS[:6]]
    base = ["--redis-url", redis_server.url, "--redis-prefix", "max-seqs:"]
    decode = [*base, "--max-num-seqs", str(limit)]
    with running([("prefill", base), ("decode", decode)]) as (p, d):
        samples: list[dict[str, float]] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                samples.append(scrape(d))
                stop.wait(0.02)

        async def all_at_once() -> list[Result]:
            p_address, d_address = p.info["grpc_address"], d.info["grpc_address"]
            calls = [
                disaggregated(p_address, d_address, f"max-seqs-{i}", prompt, params)
                for i, prompt in enumerate(ids)
            ]
            return list(await asyncio.gather(*calls))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            results = run(all_at_once())
        finally:
            stop.set()
            poller.join(timeout=10)
        running_seqs = [s["pdserve_num_running"] for s in samples]
        present = [s["pdserve_num_running"] + s["pdserve_num_waiting"] for s in samples]
        print(f"{len(samples)} samples: running <= {max(running_seqs)}, +waiting <= {max(present)}")
        assert max(running_seqs) == limit  # reached, never passed
        assert max(present) > limit  # the limit held requests back
        for result in results:
            assert result.kv_source == "pulled" and result.finish_reason == "length"
            assert len(result.token_ids) == params.max_tokens
        for result, offline in zip(results, expected):  # greedy: ignore_eos changes no prefix
            assert result.token_ids[: len(offline)] == offline
        assert metric(d, "pdserve_kv_pulls_total", 'outcome="pulled"') == len(ids)
        assert wait_until(lambda: used_blocks(p) == 0 == used_blocks(d), 5)


@pytest.fixture(scope="module")
def pair(redis_server):
    args = ["--redis-url", redis_server.url, "--redis-prefix", "faults:", "--lease-seconds", "2"]
    with running([("prefill", args), ("decode", args)]) as workers:
        yield workers


def test_unpulled_blocks_are_freed_when_the_lease_expires(pair, tokenizer):
    p, _ = pair
    answer = run(
        prefill(p.info["grpc_address"], "never-pulled", tokenizer.encode(PROMPTS[7]), GREEDY)
    )
    assert len(answer.kv.block_ids) > 0
    assert used_blocks(p) >= len(answer.kv.block_ids)
    assert wait_until(lambda: used_blocks(p) == 0, timeout=6)
    assert metric(p, "pdserve_lease_expirations_total") >= 1


def test_abort_mid_decode_frees_decode_blocks_at_once(pair, tokenizer):
    p, d = pair
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    result = run(
        disaggregated(
            p.info["grpc_address"],
            d.info["grpc_address"],
            "abort-me",
            tokenizer.encode(PROMPTS[2]),
            params,
            max_chunks=3,
        )
    )
    assert len(result.token_ids) >= 3 and not result.finish_reason
    assert wait_until(lambda: used_blocks(d) == 0 and used_blocks(p) == 0, timeout=5)


@pytest.mark.parametrize("streamed_call", [False, True], ids=["whole", "streamed"])
def test_a_duplicate_prefill_id_is_refused_and_the_first_request_keeps_its_blocks(
    pair, tokenizer, expected, streamed_call
):
    """A second Prefill(Stream) with a live request's id gets INVALID_ARGUMENT; the first
    request's pinned blocks stay pinned (once, a refused streamed call aborted the first),
    its pull still succeeds and gives the offline tokens, and nothing leaks."""
    p, d = pair
    ids = tokenizer.encode(PROMPTS[0])
    rid = f"dup-{streamed_call}"
    params = SamplingParams(temperature=0, max_tokens=12)

    async def flow() -> tuple[grpc.StatusCode | None, list[int], str]:
        async def refuse_duplicate(answer):  # type: ignore[no-untyped-def]
            pinned = used_blocks(p)
            async with grpc.aio.insecure_channel(p.info["grpc_address"]) as channel:
                stub = pb_grpc.PrefillServiceStub(channel)
                request = pb.PrefillRequest(
                    request_id=rid, token_ids=ids, sampling=params_to_proto(params)
                )
                try:
                    if streamed_call:
                        async for _ in stub.PrefillStream(request, timeout=30, metadata=AUTH):
                            pass
                    else:
                        await stub.Prefill(request, timeout=30, metadata=AUTH)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
            assert used_blocks(p) == pinned  # the first request's blocks are still pinned

        codes: list[grpc.StatusCode] = []
        result = await disaggregated(
            p.info["grpc_address"],
            d.info["grpc_address"],
            rid,
            ids,
            params,
            before_generate=refuse_duplicate,
        )
        return (codes[0] if codes else None), result.token_ids, result.kv_source

    code, tokens, source = run(flow())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert source == "pulled" and tokens == expected[0]
    assert wait_until(lambda: used_blocks(p) == 0 == used_blocks(d), 5)


def test_prefix_reuse_skips_shared_blocks_on_both_sides(pair, tokenizer):
    p, d = pair
    system = "You are a helpful assistant who answers briefly and precisely. " * 6
    first = tokenizer.encode(system + "Here is a list of fruits:")
    second = tokenizer.encode(system + "Here is a list of trees:")

    def received() -> float:
        return metric(d, "pdserve_kv_transfer_bytes_total", 'direction="received",transport="tcp"')

    before = received()
    a = run(disaggregated(p.info["grpc_address"], d.info["grpc_address"], "px1", first, GREEDY))
    bytes_first = received() - before
    b = run(disaggregated(p.info["grpc_address"], d.info["grpc_address"], "px2", second, GREEDY))
    bytes_second = received() - before - bytes_first
    assert a.num_cached_prefill == 0 and b.num_cached_prefill > 0
    assert a.num_cached_decode == 0 and b.num_cached_decode >= b.num_cached_prefill
    block_bytes = 30 * 2 * 3 * 16 * 64 * 4
    assert bytes_first == len(a.handle.block_ids) * block_bytes
    assert bytes_second == (len(b.handle.block_ids) - b.num_cached_decode // 16) * block_bytes


def test_prefill_killed_before_the_pull_decode_recomputes(redis_server, tokenizer, expected):
    args = ["--redis-url", redis_server.url, "--redis-prefix", "kill-p:"]
    with running([("prefill", args), ("decode", args)]) as (p, d):

        async def kill_prefill(answer):  # type: ignore[no-untyped-def]
            p.kill()

        ids = tokenizer.encode(PROMPTS[0])
        result = run(
            disaggregated(
                p.info["grpc_address"],
                d.info["grpc_address"],
                "kp",
                ids,
                GREEDY,
                before_generate=kill_prefill,
            )
        )
        assert result.kv_source == "recomputed"
        assert result.token_ids == expected[0]
        assert wait_until(lambda: used_blocks(d) == 0, 5)
        assert metric(d, "pdserve_kv_pulls_total", 'outcome="recomputed"') == 1


def test_decode_killed_mid_stream_leaves_prefill_clean_and_is_dropped(redis_server, tokenizer):
    import asyncio

    from services.registry import RegistryConfig, RegistryView

    prefix = "kill-d:"
    args = ["--redis-url", redis_server.url, "--redis-prefix", prefix]
    config = RegistryConfig(
        redis_url=redis_server.url, prefix=prefix, ttl_seconds=2, heartbeat_seconds=0.5
    )

    async def live_roles():  # type: ignore[no-untyped-def]
        async with RegistryView(config) as view:
            await view.refresh()
            return sorted(w.role for w in view.workers())

    with running([("prefill", args), ("decode", args)]) as (p, d):
        assert run(live_roles()) == ["decode", "prefill"]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

        async def go():  # type: ignore[no-untyped-def]
            task = asyncio.create_task(
                disaggregated(
                    p.info["grpc_address"],
                    d.info["grpc_address"],
                    "kd",
                    tokenizer.encode(PROMPTS[3]),
                    params,
                )
            )
            await asyncio.sleep(3)
            os.kill(d.pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError):
                await task

        run(go())
        assert wait_until(lambda: used_blocks(p) == 0, 5)
        assert wait_until(lambda: run(live_roles()) == ["prefill"], timeout=6)


def test_redis_restart_workers_register_again_by_themselves(redis_server):

    from services.registry import RegistryConfig, RegistryView

    prefix = "restart:"
    args = ["--redis-url", redis_server.url, "--redis-prefix", prefix]
    config = RegistryConfig(
        redis_url=redis_server.url, prefix=prefix, ttl_seconds=2, heartbeat_seconds=0.5
    )

    async def live_ids():  # type: ignore[no-untyped-def]
        async with RegistryView(config) as view:
            await view.refresh()
            return sorted(w.worker_id for w in view.workers())

    with running([("prefill", args), ("decode", args)]) as (p, d):
        ids = sorted([p.info["worker_id"], d.info["worker_id"]])
        assert run(live_ids()) == ids
        redis_server.restart(down_seconds=1.0)  # a restarted Redis has lost every key
        assert wait_until(lambda: run(live_ids()) == ids, timeout=10)
        assert p.is_alive() and d.is_alive()


def test_workers_with_different_block_sizes_are_never_paired(redis_server):

    from services.registry import RegistryConfig, RegistryView

    prefix = "compat:"
    base = ["--redis-url", redis_server.url, "--redis-prefix", prefix]
    config = RegistryConfig(redis_url=redis_server.url, prefix=prefix)

    async def pairs():  # type: ignore[no-untyped-def]
        async with RegistryView(config) as view:
            await view.refresh()
            return view.compatible_pairs(), view.incompatible_pairs()

    with running(
        [
            ("prefill", base),
            ("decode", [*base, "--block-size", "32"]),
            ("decode", [*base, "--dtype", "bfloat16"]),
        ]
    ):
        compatible, incompatible = run(pairs())
        assert compatible == []
        reasons = sorted(reason for _, _, reason in incompatible)
        assert len(reasons) == 2
        assert any("block_size" in r for r in reasons)
        assert any("kv_dtype" in r for r in reasons)


def test_sigterm_drains_in_flight_requests_and_deregisters(redis_server, tokenizer):
    import asyncio

    args = ["--redis-url", redis_server.url, "--redis-prefix", "drain:"]
    with running([("colocated", args)]) as (c,):
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

        async def go():  # type: ignore[no-untyped-def]
            task = asyncio.create_task(
                colocated(c.info["grpc_address"], "drain", tokenizer.encode(PROMPTS[0]), params)
            )
            await asyncio.sleep(1.0)
            c.signal(signal.SIGTERM)
            return await task

        result = run(go())
        assert result.finish_reason == "length" and len(result.token_ids) == 60
        assert c.proc.wait(timeout=20) == 0
