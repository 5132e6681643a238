"""Simulated workers behind the real router and Redis (docs/simulation.md): a prefill and a
decode worker (`--simulate PROFILE`: real processes, gRPC, registry, leases, tcp KV pulls; the
model replaced by the profile's timing and deterministic tokens) answer the OpenAI API on the
local and the disaggregated route with the tokens a simulated colocated worker gives, take the
profile's time for prefill and transfer, and leave their block pools as they found them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, wait_until

LOCAL = 64  # prompts up to this many tokens are computed on the decode worker
PREFILL_TOKEN_S, LINK_LATENCY_S = 0.001, 0.05
PROFILE = {
    "name": "test-sim",
    "step": {
        "base_s": {"value": 0.005, "source": "a test's choice"},
        "prefill_token_s": PREFILL_TOKEN_S,
        "prefill_pair_s": 0,
        "decode_seq_s": 0.0005,
        "decode_context_s": 0,
    },
    "kv_bytes_per_token": 131072,
    "kv_pool_tokens": 16384,
    "transfer_latency_s": LINK_LATENCY_S,
    "transfer_bytes_per_s": 40e9,
}
DOCUMENT = "Paged attention stores keys and values in fixed-size blocks. " * 14  # ~170 tokens
CHATS = {
    "short": [{"role": "user", "content": "Say something."}],
    "long": [{"role": "user", "content": DOCUMENT + "Summarize."}],
}


def start(c: Cluster, roles: tuple[str, ...], profile: str) -> Router:
    c.add_workers(*roles, extra=("--simulate", profile))
    router = c.add_router("--disaggregation", "conditional", "--local-prefill-tokens", str(LOCAL))
    router.wait_ready(num_workers=len(roles))
    return router


@pytest.fixture(scope="module")
def clusters(redis_server, tmp_path_factory) -> Iterator[tuple[Router, Router, Cluster]]:  # type: ignore[no-untyped-def]
    """A simulated 1P+1D cluster, and a simulated colocated worker with a router of its own."""
    path = Path(tmp_path_factory.mktemp("profiles")) / "test-sim.json"
    path.write_text(json.dumps(PROFILE))
    disaggregated, colocated = Cluster(redis_server.url), Cluster(redis_server.url)
    try:
        pd_router = start(disaggregated, ("prefill", "decode"), str(path))
        co_router = start(colocated, ("colocated",), "h100-llama3-8b")  # a committed profile
        yield pd_router, co_router, disaggregated
    except BaseException:
        disaggregated.dump()
        colocated.dump()
        raise
    finally:
        disaggregated.stop()
        colocated.stop()


def chat(router: Router, messages: list[dict[str, str]], stream: bool = False) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    if stream:
        return streamed_chat(router, body)
    response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_chat(router: Router, body: dict) -> dict:
    text = ""
    body = {**body, "stream": True}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return {"choices": [{"message": {"content": text}}]}


def text_of(answer: dict) -> str:
    return str(answer["choices"][0]["message"]["content"])


def test_both_routes_give_the_colocated_tokens(clusters) -> None:  # type: ignore[no-untyped-def]
    pd_router, co_router, _ = clusters
    for kind, route in (("short", "local"), ("long", "pulled")):
        answer = chat(pd_router, CHATS[kind])
        [timing] = answer["usage"]["pdserve_timings"]
        assert timing["kv_source"] == route, timing
        assert answer["usage"]["completion_tokens"] == 8  # never an end token: max_tokens
        expected = chat(co_router, CHATS[kind])
        assert text_of(answer) == text_of(expected) != ""
        assert text_of(chat(pd_router, CHATS[kind], stream=True)) == text_of(expected)
    other = chat(co_router, [{"role": "user", "content": "Something else."}])
    assert text_of(other) != text_of(chat(co_router, CHATS["short"]))


def test_a_pulled_prompt_takes_the_profiles_prefill_and_transfer_time(clusters) -> None:  # type: ignore[no-untyped-def]
    pd_router, _, _ = clusters
    messages = [{"role": "user", "content": "Another document. " + DOCUMENT}]
    answer = chat(pd_router, messages)
    [timing] = answer["usage"]["pdserve_timings"]
    assert timing["kv_source"] == "pulled"
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens > 150
    # Loose bounds: a shared machine only adds time.
    assert timing["prefill_compute_ms"] >= 1000 * PREFILL_TOKEN_S * prompt_tokens * 0.9, timing
    assert timing["kv_transfer_ms"] >= 1000 * LINK_LATENCY_S * 0.9, timing


def test_pools_are_back_to_baseline(clusters) -> None:  # type: ignore[no-untyped-def]
    pd_router, _, disaggregated = clusters
    answers = [chat(pd_router, CHATS["long"]) for _ in range(2)]
    assert text_of(answers[0]) == text_of(answers[1])
    for worker in disaggregated.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0, timeout=15), worker.role
    _, body = pd_router.get("/v1/workers")
    assert sorted(w["role"] for w in body["data"] if w["healthy"]) == ["decode", "prefill"]
