"""A decode worker only follows KV handles that name a registered prefill worker of its own
fingerprint, at the addresses that worker registered: a forged handle is refused before the
decode worker connects anywhere (no pull, no Release to the address it names). Real worker
processes registered in a real Redis."""

from __future__ import annotations

import select
import socket
import uuid

import grpc
import pytest

from common.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from tests.conftest import PROMPTS
from tests.services.workers import Result, disaggregated, generate, prefill, run, running

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def workers(redis_server):  # type: ignore[no-untyped-def]
    args = ["--redis-url", redis_server.url, "--redis-prefix", f"h{uuid.uuid4().hex[:6]}:"]
    with running([("prefill", args), ("decode", args)]) as pair:
        yield pair


def listener() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


def any_connected(socks: list[socket.socket], within: float = 1.5) -> bool:
    """Whether anything connected to one of ``socks``, waiting ``within`` seconds for all of
    them together (a late connect, after the refusal, would still show)."""
    readable, _, _ = select.select(socks, [], [], within)
    return bool(readable)


def generate_with(d, answer: pb.PrefillResponse, prompt: list[int], request_id: str) -> None:  # type: ignore[no-untyped-def]
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        first_token=answer.first_token,
        kv=answer.kv,
    )
    request.sampling.max_tokens = 4
    run(generate(d.info["grpc_address"], request, Result()))


def test_a_handle_of_a_registered_prefill_worker_is_pulled(workers, llm) -> None:  # type: ignore[no-untyped-def]
    p, d = workers
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    result = run(
        disaggregated(p.info["grpc_address"], d.info["grpc_address"], "ok", prompt, GREEDY)
    )
    assert result.kv_source == "pulled"


@pytest.mark.parametrize("forged", ["address", "release_address", "worker", "fingerprint"])
def test_a_forged_handle_is_refused_before_any_connection(workers, llm, forged: str) -> None:  # type: ignore[no-untyped-def]
    p, d = workers
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    answer = run(prefill(p.info["grpc_address"], f"forged-{forged}", prompt, GREEDY))
    kv_trap, release_trap = listener(), listener()
    handle = answer.kv
    if forged == "address":
        handle.address = f"tcp://127.0.0.1:{kv_trap.getsockname()[1]}"
    elif forged == "release_address":
        handle.release_address = f"127.0.0.1:{release_trap.getsockname()[1]}"
    elif forged == "worker":
        handle.prefill_worker_id = "prefill-that-does-not-exist"
    else:
        handle.fingerprint = "0" * len(handle.fingerprint)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        generate_with(d, answer, prompt, f"forged-{forged}")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KV handle refused" in (raised.value.details() or "")
    assert not any_connected([kv_trap, release_trap])
    kv_trap.close()
    release_trap.close()
