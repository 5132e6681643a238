"""Hostile input against a real gateway (one prefill + one decode worker, real router processes):
requests built to make the router or the workers do unbounded work, extreme integers, deep or
broken bodies. Each gets a 400 naming the limit (or the field) before any work is done; nothing
answers 5xx, hangs or cuts a stream; the router's memory stays within a bound; afterwards the
system still serves and the workers hold no KV blocks.

Two routers share the workers: ``small`` with every per-request limit set low, and ``default``
with the defaults (what `pdserve up` runs), which takes the attack that once grew a router to
6.7 GB: 200,000 one-token prompts with n=16.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    spawn_router,
    wait_until,
)

SMALL_LIMITS = (
    *("--max-prompts", "8", "--max-n", "4", "--max-fan-out", "16"),
    *("--max-stop-strings", "4", "--max-stop-chars", "16", "--max-messages", "8"),
    *("--max-body-depth", "16", "--max-request-prompt-tokens", "200"),
    *("--max-request-output-tokens", "300", "--max-model-len", "128"),
)
RSS_GROWTH_BOUND = 200 << 20  # bytes; docs/reliability.md "Limits" states the same bound


@dataclass
class Stack:
    cluster: Cluster
    small: Router
    default: Router
    rss_at_start: dict[int, int] = field(default_factory=dict)  # router pid -> bytes


@pytest.fixture(scope="module")
def stack(pd_pair: Cluster) -> Iterator[Stack]:
    c = pd_pair.with_own_routers()  # the shared prefill and decode workers
    try:
        s = Stack(c, spawn_router(c, *SMALL_LIMITS), spawn_router(c))
        for process in [*c.workers, *c.routers]:
            process.wait_ready()
        for router in (s.small, s.default):
            router.wait_ready(num_workers=2)
            s.rss_at_start[router.process.pid] = rss(router)
        yield s
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def post(router: Router, body: Any, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(router.url + path, content=content, headers=headers, timeout=60)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}


def nested(depth: int) -> bytes:
    return b'{"model": "x", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


CHAT = "/v1/chat/completions"

# (id, router, path, body, param, text in the message, the flag named)
# fmt: off
LIMIT_CASES = [
    ("prompts", "/v1/completions", completion(prompt=["a"] * 9), "prompt", "prompts is 9",
     "--max-prompts"),
    ("token-prompts", "/v1/completions", completion(prompt=[[1]] * 9), "prompt", "prompts is 9",
     "--max-prompts"),
    ("n", "/v1/completions", completion(n=5), "n", "n is 5", "--max-n"),
    ("fan-out", "/v1/completions", completion(prompt=["a"] * 5, n=4), "n",
     "(prompts x n) is 20", "--max-fan-out"),
    ("stop-count", "/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), "stop",
     "stop strings is 5", "--max-stop-strings"),
    ("stop-length", "/v1/completions", completion(stop=["x" * 17]), "stop",
     "stop string's length is 17", "--max-stop-chars"),
    ("chat-stop-length", CHAT, chat(stop="y" * 40), "stop", "length is 40", "--max-stop-chars"),
    ("messages", CHAT, chat(messages=[{"role": "user", "content": "hi"}] * 9), "messages",
     "messages is 9", "--max-messages"),
    ("prompt-tokens", "/v1/completions", completion(prompt=[[5] * 100] * 3), "prompt",
     "prompt tokens is 300", "--max-request-prompt-tokens"),
    ("output-tokens", "/v1/completions", completion(prompt=["a", "b"], max_tokens=100, n=3),
     "max_tokens", "is 600", "--max-request-output-tokens"),
    ("chat-output-tokens", CHAT, chat(max_tokens=90, n=4), "max_tokens", "is 360",
     "--max-request-output-tokens"),
    ("depth", "/v1/completions", nested(40), None, "nesting depth", "--max-body-depth"),
    ("depth-huge", "/v1/completions", nested(100_000), None, "nesting depth",
     "--max-body-depth"),
]
# fmt: on


@pytest.mark.parametrize(
    ("path", "body", "param", "text", "flag"),
    [pytest.param(*case[1:], id=case[0]) for case in LIMIT_CASES],
)
def test_requests_over_a_limit_get_a_400_naming_it(
    stack: Stack, path: str, body: Any, param: Any, text: str, flag: str
) -> None:
    response = post(stack.small, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert text in error["message"] and flag in error["message"], error
    assert error["code"] == "request_too_large", error


# fmt: off
FIELD_CASES = [
    ("max_tokens-2**70", completion(max_tokens=2**70), "max_tokens"),
    ("seed-2**63", completion(seed=2**63), "seed"),
    ("top_k-2**31", completion(top_k=2**31), "top_k"),
    ("logprobs-21", completion(logprobs=21), "logprobs"),
    ("token-2**31", completion(prompt=[2**31]), "prompt.0"),
    ("token-huge", completion(prompt=[[1], [10**30]]), "prompt.1.0"),
    ("stop_token_ids-2**40", completion(stop_token_ids=[2**40]), "stop_token_ids.0"),
    ("n-2**64", completion(n=2**64), "n"),
    ("temperature-nan", b'{"model": "%s", "prompt": "a", "temperature": NaN}' % MODEL.encode(),
     "temperature"),
    ("top_p-infinity", b'{"model": "%s", "prompt": "a", "top_p": Infinity}' % MODEL.encode(),
     "top_p"),
    ("invalid-utf8", b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}', None),
]
# fmt: on


@pytest.mark.parametrize(
    ("body", "param"), [pytest.param(*case[1:], id=case[0]) for case in FIELD_CASES]
)
def test_extreme_values_get_a_400_naming_the_field(stack: Stack, body: Any, param: Any) -> None:
    response = post(stack.small, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_seed_at_the_end_of_int64_with_n_2_is_served(stack: Stack, stream: bool) -> None:
    """Once a 500 (non-streaming) or a reset connection (streaming): seed + 1 overflowed."""
    for seed in (2**63 - 1, -(2**63)):
        body = completion(seed=seed, n=2, temperature=1.0, max_tokens=3, stream=stream)
        response = post(stack.small, body)
        assert response.status_code == 200, response.text
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]"), response.text
            assert '"error"' not in response.text
        else:
            assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1]


def test_fuzz_from_the_openapi_document_with_workers(stack: Stack) -> None:
    """schemathesis, valid and invalid bodies from the router's own schema, against the router
    with workers: no 5xx, no hang (each call has 60 s), no stream cut before ``[DONE]``."""
    schema = schemathesis.openapi.from_url(stack.small.url + "/openapi.json")
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    statuses: set[int] = set()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*(schema.as_strategy(mode) for mode in modes)))
    def check(case) -> None:  # type: ignore[no-untyped-def]
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # past the model check: to the limits and the workers
            # A short answer: a body without a limit generated to the context's end (9-38 s a run)
            limits = [k for k in ("max_tokens", "max_completion_tokens") if k in case.body]
            for key in limits or ["max_tokens"]:
                value = case.body.get(key, 8)
                case.body[key] = min(value, 8) if isinstance(value, int) else value
        response = case.call(timeout=60)
        statuses.add(response.status_code)
        shown = (case.method, case.path, str(case.body)[:300], response.text[-300:])
        assert response.status_code < 500, shown
        content_type = response.headers.get("content-type") or [""]
        if isinstance(content_type, list):  # schemathesis keeps every value of a header
            content_type = content_type[0]
        if content_type.startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), shown

    check()
    assert 400 in statuses and 200 in statuses, statuses


def rss(router: Router) -> int:
    return int(psutil.Process(router.process.pid).memory_info().rss)


def test_the_fan_out_attack_is_refused_at_once_and_costs_no_memory(stack: Stack) -> None:
    """200,000 one-token prompts with n=16 (a 1.4 MB body, under the default body limit)."""
    router = stack.default
    before = rss(router)
    body = {"model": MODEL, "prompt": [[1]] * 200_000, "n": 16, "max_tokens": 1}
    started = time.monotonic()
    for stream in (False, True):
        response = post(router, {**body, "stream": stream})
        assert response.status_code == 400, response.text
        assert "--max-prompts" in response.json()["error"]["message"]
    response = post(router, {**body, "n": 17})
    assert response.status_code == 400 and "--max-n" in response.text, response.text
    assert time.monotonic() - started < 30
    assert rss(router) - before < RSS_GROWTH_BOUND, (before, rss(router))


def test_afterwards_the_system_serves_and_holds_no_blocks(stack: Stack) -> None:
    """Runs last in this module: everything above left nothing behind."""
    for router in (stack.small, stack.default):
        response = post(router, completion(max_tokens=4, temperature=0))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
        growth = rss(router) - stack.rss_at_start[router.process.pid]
        assert growth < RSS_GROWTH_BOUND, f"the router grew by {growth >> 20} MiB"
    for worker in stack.cluster.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0), worker.role
