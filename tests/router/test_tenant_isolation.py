"""Prefix-cache tenants end to end, on real processes: the same prompt sent under two
``cache_salt`` values never shares cached blocks, on the prefill worker, on the decode worker
(which pulls every block again), in the router's prefix index (its disaggregation decision) and
on a colocated worker; under the same salt it hits as before. ``cached_tokens`` and
``kv_source`` therefore say nothing about another tenant's prompts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from services.worker.launcher import WorkerProcess
from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    spawn_router,
    spawn_workers,
    wait_until,
)
from tests.services.workers import metric

# Each test uses salts of its own: the workers and their published prefix hashes are shared.
DOCUMENT = "A tenant's prompt prefix is cached in blocks that no other tenant can reuse. " * 8
CONDITIONAL = ("--disaggregation", "conditional", "--local-prefill-tokens", "64")
CONDITIONAL += ("--prefill-busy-tokens", "256")


@dataclass
class Stack:
    cluster: Cluster
    colocated_cluster: Cluster
    always: Router  # every prompt through the prefill worker (the cluster's default flags)
    conditional: Router  # the default policy: a prompt cached on the decode worker stays there
    colocated: Router

    @property
    def decode(self) -> WorkerProcess:
        return self.cluster.workers[1]


@pytest.fixture(scope="module")
def stack(redis_server, pd_pair: Cluster) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    c, solo = pd_pair.with_own_routers(), Cluster(redis_server.url)  # c: the shared workers
    try:
        spawn_workers(solo, "colocated")
        s = Stack(c, solo, spawn_router(c), spawn_router(c, *CONDITIONAL), spawn_router(solo))
        for process in [*c.workers, *solo.workers, *c.routers, *solo.routers]:
            process.wait_ready()
        for router, num in ((s.always, 2), (s.conditional, 2), (s.colocated, 1)):
            router.wait_ready(num_workers=num)
        yield s
        for worker in [*c.workers, *solo.workers]:
            assert wait_until(lambda w=worker: blocks_in_use(w) == 0), "KV blocks leaked"
    except BaseException:
        c.dump()
        solo.dump()
        raise
    finally:
        c.stop()
        solo.stop()


def post(router: Router, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + path, json=body, timeout=120)


def complete(router: Router, prompt: str, salt: str | None) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = post(router, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def kv_source(answer: dict[str, Any]) -> str:
    return str(answer["usage"]["pdserve_timings"][0]["kv_source"])


def decode_hits(stack: Stack) -> float:
    return metric(stack.decode, "pdserve_prefix_cache_hits_total")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("salt", "why"), [("", "at least 1"), ("x" * 257, "at most 256")])
def test_a_bad_salt_is_a_400_naming_it(stack: Stack, path: str, salt: Any, why: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "cache_salt": salt}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    response = post(stack.always, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and why in error["message"], error
    response = post(stack.always, path, {**body, "cache_salt": 7})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_disaggregated_hits_only_under_the_same_salt(stack: Stack) -> None:
    prompt = DOCUMENT + "Disaggregated:"
    first = complete(stack.always, prompt, "tenant-a")
    assert cached(first) == 0 and kv_source(first) == "pulled"
    before = decode_hits(stack)
    other = complete(stack.always, prompt, "tenant-b")
    assert cached(other) == 0  # the prefill worker holds A's blocks, not B's
    assert decode_hits(stack) == before  # so does the decode worker: B pulled every block
    assert cached(complete(stack.always, prompt, None)) == 0
    again = complete(stack.always, prompt, "tenant-a")
    assert cached(again) >= 128, again["usage"]
    assert decode_hits(stack) > before  # the decode worker reuses A's pulled blocks for A
    texts = {a["choices"][0]["text"] for a in (first, other, again)}
    assert len(texts) == 1  # the KV pulled under each salt is the prompt's


def test_chat_carries_the_salt(stack: Stack) -> None:
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Chat?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}

    def chat(salt: str) -> int:
        response = post(stack.always, "/v1/chat/completions", {**body, "cache_salt": salt})
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert chat("chat-a") == 0
    assert chat("chat-b") == 0
    assert chat("chat-a") >= 128


def decisions(router: Router, reason: str) -> float:
    labels = f'decision="local",reason="{reason}"'
    return router.metric("pdserve_router_disaggregation_decisions_total", labels)


def test_the_routers_prefix_index_is_per_salt(stack: Stack) -> None:
    """A's prompt, cached on the decode worker, keeps A's next request there ("cached"); B's
    request for the same prompt is judged uncached and goes to the prefill worker."""
    router, prompt = stack.conditional, DOCUMENT + "Routed:"
    first = complete(router, prompt, "route-a")
    assert kv_source(first) == "pulled" and cached(first) == 0
    other = complete(router, prompt, "route-b")
    assert kv_source(other) == "pulled" and cached(other) == 0
    assert decisions(router, "cached") == 0
    again = complete(router, prompt, "route-a")
    assert kv_source(again) == "local" and cached(again) >= 128
    assert decisions(router, "cached") == 1


def test_colocated_hits_only_under_the_same_salt(stack: Stack) -> None:
    prompt = DOCUMENT + "Colocated:"
    first = complete(stack.colocated, prompt, "tenant-a")
    assert cached(first) == 0 and kv_source(first) == "colocated"
    assert cached(complete(stack.colocated, prompt, "tenant-b")) == 0
    assert cached(complete(stack.colocated, prompt, None)) == 0
    assert cached(complete(stack.colocated, prompt, "tenant-a")) >= 128
