"""Cluster-token security and malformed input, against real worker processes.

One prefill and one decode worker run with ``PDSERVE_CLUSTER_TOKEN``; the tests call them over
real gRPC and pull from the prefill worker's real KV server. Every refusal must be counted on
the worker's /metrics, and nothing a peer sends may crash a worker or leave a block in use.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtransfer
from common.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from services.worker.convert import layout_from_proto
from services.worker.launcher import WorkerProcess
from tests.conftest import PROMPTS
from tests.services.workers import disaggregated, metric, prefill, run, running, used_blocks

TOKEN = "s3cret-cluster-token"
AUTH = (("x-pdserve-token", TOKEN),)
GREEDY = SamplingParams(temperature=0, max_tokens=6)
PREFILL_METHODS = ("Prefill", "Release", "RenewLease")
DECODE_METHODS = ("Generate",)
# Short leases and pull timeouts: fuzzed handles that point nowhere settle in about a second.
ARGS = ["--lease-seconds", "1", "--pull-timeout-seconds", "1"]


@pytest.fixture(scope="module")
def workers():
    env = {"PDSERVE_CLUSTER_TOKEN": TOKEN}
    with running([("prefill", ARGS), ("decode", ARGS)], env=env) as pair:
        yield pair


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(autouse=True)
def no_leaked_blocks(workers):
    """Every test ends with both pools back to zero blocks in use and the workers alive."""
    yield
    for worker in workers:
        assert worker.is_alive(), f"{worker.role} worker died:\n{worker.output_tail()}"
        assert "Traceback" not in worker.output_tail(1000), worker.output_tail(60)
        assert _settles(lambda w=worker: used_blocks(w) == 0), f"{worker.role} leaked blocks"
        assert _settles(lambda w=worker: metric(w, "pdserve_pinned_requests") == 0)


def _settles(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def _raw_call(
    address: str, service: str, method: str, payload: bytes, metadata=(), streaming=False
) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """Send ``payload`` as the request message bytes, exactly, and return the final status."""
    path = f"/pdserve.v1.{service}/{method}"
    async with grpc.aio.insecure_channel(address) as channel:
        if streaming:
            call = channel.unary_stream(path)(payload, metadata=metadata, timeout=30)
            async for _ in call:
                pass
            return await call.code()
        try:
            await channel.unary_unary(path)(payload, metadata=metadata, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def _status(
    address: str, service: str, method: str, payload: bytes, metadata=()
) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    async def call() -> grpc.StatusCode:
        try:
            return await _raw_call(
                address, service, method, payload, metadata, streaming=method == "Generate"
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    return run(call())


# -- the cluster token on gRPC -------------------------------------------------------------------


def test_grpc_calls_without_the_cluster_token_are_refused_and_counted(workers):
    p, d = workers
    p_addr, d_addr = p.info["grpc_address"], d.info["grpc_address"]
    refused = {w.role: metric(w, "pdserve_grpc_refused_total") for w in workers}
    message = pb.ReleaseRequest(request_id="x").SerializeToString()
    wrong = (("x-pdserve-token", TOKEN + "x"),)
    for method in PREFILL_METHODS:
        assert _status(p_addr, "PrefillService", method, message) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            _status(p_addr, "PrefillService", method, message, wrong)
            == grpc.StatusCode.UNAUTHENTICATED
        )
    generate = pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2]).SerializeToString()
    assert _status(d_addr, "DecodeService", "Generate", generate) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _status(d_addr, "DecodeService", "Generate", generate, wrong)
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert metric(p, "pdserve_grpc_refused_total") == refused["prefill"] + 2 * len(PREFILL_METHODS)
    assert metric(d, "pdserve_grpc_refused_total") == refused["decode"] + 2
    # The right token passes the same calls; health checks need none (probes carry no secret).
    assert _status(p_addr, "PrefillService", "Release", message, AUTH) == grpc.StatusCode.OK
    assert metric(p, "pdserve_grpc_refused_total") == refused["prefill"] + 2 * len(PREFILL_METHODS)

    async def health() -> int:
        async with grpc.aio.insecure_channel(p_addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            return int(answer.status)

    assert run(health()) == health_pb2.HealthCheckResponse.SERVING


def test_a_request_with_the_token_is_served_disaggregated(workers, tokenizer, llm):
    """Both hops authenticate: the router's calls and the decode worker's pull and Release."""
    p, d = workers
    ids = tokenizer.encode(PROMPTS[1])
    expected = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    pulled_before = metric(d, "pdserve_kv_pulls_total", 'outcome="pulled"')
    result = run(
        disaggregated(
            p.info["grpc_address"], d.info["grpc_address"], "tok-ok", ids, GREEDY, metadata=AUTH
        )
    )
    assert result.token_ids == expected
    assert result.kv_source == "pulled"
    assert metric(d, "pdserve_kv_pulls_total", 'outcome="pulled"') == pulled_before + 1


# -- the cluster token and reservations on KV transfer --------------------------------------------


def _pinned(p: WorkerProcess, tokenizer, request_id: str) -> pb.PrefillResponse:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(PROMPTS[2])
    answer = run(prefill(p.info["grpc_address"], request_id, ids, GREEDY, metadata=AUTH))
    assert answer.kv.block_ids, "the prompt spans at least one block"
    return answer


def _pull(handle: pb.KVHandle, token: str | None, request_id: str, block_ids: list[int]) -> str:
    """Pull like a decode worker would; the TransferError reason, or "ok"."""

    async def pull() -> str:
        client = kvtransfer.make_client(handle.transport, token=token)
        try:
            layout = layout_from_proto(handle.layout)
            await client.pull(handle.address, request_id, block_ids, layout, timeout=10)
        except kvtransfer.TransferError as exc:
            return exc.reason
        finally:
            await client.close()
        return "ok"

    return run(pull())


def _release(p: WorkerProcess, request_id: str) -> bool:
    async def release() -> bool:
        from protos import pdserve_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(p.info["grpc_address"]) as channel:
            stub = pb_grpc.PrefillServiceStub(channel)
            answer = await stub.Release(pb.ReleaseRequest(request_id=request_id), metadata=AUTH)
            return answer.released

    return run(release())


def _failures(p: WorkerProcess, reason: str) -> float:
    return metric(p, "pdserve_kv_transfer_failures_total", f'reason="{reason}",transport="tcp"')


def test_kv_pulls_without_the_cluster_token_are_refused_and_counted(workers, tokenizer):
    p, _ = workers
    answer = _pinned(p, tokenizer, "kv-token")
    handle, blocks = answer.kv, list(answer.kv.block_ids)
    before = _failures(p, "refused")
    key = handle.request_id  # the pin's handle
    assert _pull(handle, None, key, blocks) == "refused"
    assert _pull(handle, "not-" + TOKEN, key, blocks) == "refused"
    assert _failures(p, "refused") == before + 2
    assert _pull(handle, TOKEN, key, blocks) == "ok"  # the refusals cost it nothing
    assert _release(p, key)


def test_a_forged_pull_for_a_request_never_reserved_is_refused(workers, tokenizer):
    """The KV server serves only the blocks pinned for a request id, only while pinned."""
    p, _ = workers
    answer = _pinned(p, tokenizer, "kv-real")
    handle, blocks = answer.kv, list(answer.kv.block_ids)
    before = _failures(p, "unknown_request")
    key = handle.request_id  # the pin's handle: the request id alone names no pin
    assert _pull(handle, TOKEN, "kv-forged", blocks) == "unknown_request"
    assert _pull(handle, TOKEN, "kv-real", blocks) == "unknown_request"
    other = [b for b in range(128) if b not in blocks][:1]  # a block the request does not hold
    assert _pull(handle, TOKEN, key, other) == "unknown_request"
    assert _release(p, key)
    assert _pull(handle, TOKEN, key, blocks) == "unknown_request"  # released: gone
    assert _failures(p, "unknown_request") == before + 4


# -- malformed and hostile messages --------------------------------------------------------------

# A message that parses but makes no sense, or bytes that do not parse: INVALID_ARGUMENT.
# UNAVAILABLE: the worker is full (fuzzing can queue requests faster than they finish).
HEALTHY_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def test_bytes_that_do_not_parse_are_invalid_argument_and_counted(workers):
    """Not gRPC's default (UNKNOWN plus a logged traceback per call)."""
    p, d = workers
    before = metric(p, "pdserve_grpc_malformed_total"), metric(d, "pdserve_grpc_malformed_total")
    for payload in (b"\x00", b"\xff\xff", b"\x12\x05abc"):
        for method in PREFILL_METHODS:
            code = _status(p.info["grpc_address"], "PrefillService", method, payload, AUTH)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        code = _status(d.info["grpc_address"], "DecodeService", "Generate", payload, AUTH)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert metric(p, "pdserve_grpc_malformed_total") == before[0] + 3 * len(PREFILL_METHODS)
    assert metric(d, "pdserve_grpc_malformed_total") == before[1] + 3
    assert "Traceback" not in p.output_tail(200) + d.output_tail(200)


@FUZZ
@given(
    method=st.sampled_from(
        [("PrefillService", m) for m in PREFILL_METHODS]
        + [("DecodeService", m) for m in DECODE_METHODS]
    ),
    payload=st.binary(max_size=200),
)
def test_garbage_bytes_to_every_method_get_an_error_not_a_crash(workers, method, payload):
    p, d = workers
    service, name = method
    address = (p if service == "PrefillService" else d).info["grpc_address"]
    assert _status(address, service, name, payload, AUTH) in HEALTHY_CODES


token_ids = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=24)
sampling = st.builds(
    pb.SamplingParams,
    n=st.integers(0, 8),
    temperature=st.floats(width=32, allow_nan=True),
    top_p=st.floats(width=32, allow_nan=True),
    top_k=st.integers(-(2**31), 2**31 - 1),
    min_p=st.floats(width=32),
    seed=st.integers(-(2**63), 2**63 - 1),
    repetition_penalty=st.floats(width=32),
    max_tokens=st.integers(0, 4),  # valid requests must stay cheap
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(-5, 60000), max_size=3),
    logprobs=st.integers(0, 2**32 - 1),
)
valid_ids = st.lists(st.integers(1, 40000), min_size=1, max_size=24)


@FUZZ
@given(ids=st.one_of(token_ids, valid_ids), params=sampling)
def test_fuzzed_prefill_requests_answer_cleanly(workers, ids, params):
    p, _ = workers
    message = pb.PrefillRequest(request_id="fz-p", token_ids=ids, sampling=params)
    code = _status(
        p.info["grpc_address"], "PrefillService", "Prefill", message.SerializeToString(), AUTH
    )
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
    _release(p, "fz-p")  # a successful prefill pinned blocks: give them back


kv_handles = st.builds(
    pb.KVHandle,
    request_id=st.sampled_from(["fz-d", "someone-else", ""]),
    transport=st.sampled_from(["tcp", "ucx", "torch", "shm", "carrier-pigeon", ""]),
    address=st.sampled_from(["", "tcp://127.0.0.1:1", "nonsense", "tcp://[::1]:99999"]),
    block_ids=st.lists(st.integers(-3, 200), max_size=6),
    num_tokens=st.integers(0, 5000),
    layout=st.builds(
        pb.KVLayout,
        num_layers=st.integers(0, 64),
        num_kv_heads=st.integers(0, 8),
        head_dim=st.integers(0, 256),
        block_size=st.integers(0, 64),
        dtype=st.sampled_from(["float32", "bfloat16", "int8", ""]),
    ),
    checksums=st.lists(st.integers(0, 2**32 - 1), max_size=6),
    block_hashes=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6),
    fingerprint=st.sampled_from(["", "other-model"]),
    release_address=st.sampled_from(["", "127.0.0.1:1"]),
)


@FUZZ
@given(ids=valid_ids, first=st.integers(-5, 60000), handle=kv_handles, params=sampling)
def test_fuzzed_generate_requests_with_bogus_kv_handles_answer_cleanly(
    workers, ids, first, handle, params
):
    """A decode worker told to pull from nowhere, with any layout, recomputes or refuses."""
    _, d = workers
    message = pb.GenerateRequest(
        request_id="fz-d", prompt_token_ids=ids, sampling=params, first_token=first, kv=handle
    )
    code = _status(
        d.info["grpc_address"], "DecodeService", "Generate", message.SerializeToString(), AUTH
    )
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


def test_workers_still_serve_after_the_fuzzing(workers, tokenizer, llm):
    test_a_request_with_the_token_is_served_disaggregated(workers, tokenizer, llm)
