"""The cluster token between a real router and real workers, and what reaches the router's log.

Workers started with ``PDSERVE_CLUSTER_TOKEN`` serve a router holding the same token; a router
with another token is refused on every call, counted by the workers, and its clients get a
clear 503 instead of a hang. Prompts never appear in the router's log unless asked for.
"""

from __future__ import annotations

import urllib.request

import openai
import pytest

from services.worker.launcher import WorkerProcess
from tests.router.cluster import MODEL, ROUTER_ARGS, Cluster, Router, blocks_in_use, wait_until
from tests.services.workers import SMALL, metric

TOKEN = "cluster-s3cret"
SECRET_PROMPT = "my bank PIN is 4711 and"


@pytest.fixture(scope="module")
def secured(redis_server):  # type: ignore[no-untyped-def]
    c = Cluster(redis_server.url)
    env = {"PDSERVE_CLUSTER_TOKEN": TOKEN}
    workers = [WorkerProcess(r, [*SMALL, *c.worker_args()], env=env) for r in ("prefill", "decode")]
    for w in workers:
        w.spawn()
        c.workers.append(w)
    try:
        for w in workers:
            w.wait_ready()
        yield c
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def _router(c: Cluster, token: str, *extra: str) -> Router:
    args = [*ROUTER_ARGS, *c.worker_args(*extra)]
    process = WorkerProcess("router", args, env={"PDSERVE_CLUSTER_TOKEN": token})
    c.routers.append(process)
    process.start()
    router = Router(process)
    router.wait_ready(num_workers=2)
    return router


def test_a_router_with_the_token_is_served(secured: Cluster) -> None:
    router = _router(secured, TOKEN)
    answer = router.client().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    assert all(wait_until(lambda w=w: blocks_in_use(w) == 0) for w in secured.workers)


def test_a_router_with_another_token_uses_no_worker(secured: Cluster) -> None:
    """The workers sign their registry records with the cluster token; a router holding another
    token finds no record it can trust, so it never sends its token anywhere: its clients get a
    503 naming the empty pool, the workers see no call, and the router logs why."""
    p, d = secured.workers
    before = metric(p, "pdserve_grpc_refused_total")
    args = [*ROUTER_ARGS, *secured.worker_args("--max-attempts", "2")]
    process = WorkerProcess("router", args, env={"PDSERVE_CLUSTER_TOKEN": "not-the-token"})
    secured.routers.append(process)
    process.start()
    router = Router(process)
    assert wait_until(lambda: router.get("/ready")[0] == 503)
    with pytest.raises(openai.APIStatusError) as caught:
        router.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert caught.value.status_code == 503
    assert metric(p, "pdserve_grpc_refused_total") == before
    assert router.get("/v1/workers")[1]["data"] == []
    assert "does not match" in router.process.output_tail(100)
    assert blocks_in_use(p) == 0 and blocks_in_use(d) == 0


def test_prompts_stay_out_of_the_log_unless_asked(secured: Cluster) -> None:
    quiet = _router(secured, TOKEN)
    chatty = _router(secured, TOKEN, "--log-requests")
    for router in (quiet, chatty):
        router.client().completions.create(
            model=MODEL, prompt=SECRET_PROMPT, max_tokens=2, temperature=0
        )
    assert SECRET_PROMPT not in quiet.process.output_tail(200)
    assert SECRET_PROMPT not in "".join(w.output_tail(200) for w in secured.workers)
    assert SECRET_PROMPT in chatty.process.output_tail(200)


def test_ops_endpoints_can_be_kept_to_the_cluster_token(secured: Cluster) -> None:
    """With --ops-need-token, /metrics and /v1/workers answer only the cluster token (401 for
    none, for a wrong one and for an API key); /health and /ready stay open for probes; the API
    itself is unchanged."""
    args = [*ROUTER_ARGS, *secured.worker_args("--ops-need-token", "--api-key", "sk-client-key")]
    process = WorkerProcess("router", args, env={"PDSERVE_CLUSTER_TOKEN": TOKEN})
    secured.routers.append(process)
    process.start()
    router = Router(process)
    router.wait_ready()
    for path in ("/metrics", "/v1/workers"):
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer sk-client-key"},
        ):
            status, body = router.get(path, headers)
            assert status == 401, (path, headers, body)
            assert body["error"]["code"] == "invalid_api_key"
        status, _ = router.get(path, {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, path
    assert router.get("/health")[0] == 200 and router.get("/ready")[0] == 200
    answer = router.client(api_key="sk-client-key").completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0
    )
    assert answer.usage.completion_tokens == 2
    text = (
        urllib.request.urlopen(  # noqa: S310 (a local test server)
            urllib.request.Request(
                router.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
            )
        )
        .read()
        .decode()
    )
    assert 'pdserve_router_rejected_total{reason="unauthenticated"} 6.0' in text
