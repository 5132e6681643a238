"""Per-request disaggregation: the ``conditional`` policy's rule, then a real router deciding
for real requests (a prefill and a decode worker): short prompts and prompts the decode worker
already caches are computed there, long ones on the prefill worker; every decision is counted,
the response's usage says how the request got its KV and how long each phase took, and the
router's phase histograms fill."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from router.disaggregation import (
    AlwaysDisaggregate,
    ConditionalDisaggregation,
    Decision,
    RequestFacts,
    make_disaggregation_policy,
)
from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, wait_until
from tests.services.workers import metric

LOCAL, BUSY = 64, 256


DECODE_BUSY = 8


@pytest.mark.parametrize(
    ("prompt", "cached", "queued", "sequences", "expected"),
    [
        (40, 0, 0, 0, Decision(False, "short")),
        (LOCAL, 0, 10_000, 0, Decision(False, "short")),
        (300, 260, 0, 0, Decision(False, "cached")),  # 40 uncached
        (200, 0, 0, 0, Decision(True, "long")),
        (200, 0, BUSY + 1, 0, Decision(False, "prefill_busy")),  # shorter than the wait
        (400, 0, BUSY + 1, 0, Decision(True, "long")),  # longer than the wait: still remote
        (400, 0, BUSY, 0, Decision(True, "long")),
        # The prefill pool is busy, but a local prefill would stall the decode worker's streams.
        (200, 0, BUSY + 1, DECODE_BUSY - 1, Decision(False, "prefill_busy")),
        (200, 0, BUSY + 1, DECODE_BUSY, Decision(True, "decode_busy")),
        (40, 0, BUSY + 1, 100, Decision(False, "short")),  # short stays local: a brief stall
    ],
)
def test_the_conditional_rule(
    prompt: int, cached: int, queued: int, sequences: int, expected: Decision
) -> None:
    policy = ConditionalDisaggregation(LOCAL, BUSY, DECODE_BUSY)
    assert policy.decide(RequestFacts(prompt, cached, queued, sequences)) == expected


@pytest.mark.parametrize(
    ("prompt", "cached", "queued", "local_queue", "expected"),
    [
        (40, 0, 0, LOCAL - 1, Decision(False, "short")),
        # A burst: the decode worker already has a short prompt's worth to compute itself.
        (40, 0, 0, LOCAL, Decision(True, "local_queue")),
        (40, 0, BUSY, 10 * BUSY, Decision(True, "local_queue")),  # the pool is not busy
        (40, 0, BUSY + 1, 10 * BUSY, Decision(True, "local_queue")),  # its queue is shorter
        (300, 260, 0, 10 * BUSY, Decision(False, "cached")),  # its prefix is only there
        # The pool is busy: the prompt goes to the shorter queue, the decode worker's only while
        # it runs fewer than DECODE_BUSY sequences.
        (40, 0, BUSY + 1, BUSY + 1 - 40, Decision(False, "prefill_busy")),
        (40, 0, BUSY + 1, BUSY + 2 - 40, Decision(True, "local_queue")),
        (200, 0, 5 * BUSY, 4 * BUSY, Decision(False, "prefill_busy")),
        (200, 0, 5 * BUSY, 5 * BUSY, Decision(True, "long")),
        (200, 0, BUSY + 1, 10 * BUSY, Decision(True, "long")),
    ],
)
def test_a_burst_of_short_prompts_goes_to_the_prefill_pool(
    prompt: int, cached: int, queued: int, local_queue: int, expected: Decision
) -> None:
    policy = ConditionalDisaggregation(LOCAL, BUSY, DECODE_BUSY)
    facts = RequestFacts(prompt, cached, queued, 0, local_queue_tokens=local_queue)
    assert policy.decide(facts) == expected
    if not expected.remote and expected.reason == "prefill_busy":
        busy = RequestFacts(prompt, cached, queued, DECODE_BUSY, local_queue_tokens=local_queue)
        assert policy.decide(busy) == Decision(True, "decode_busy")


def test_always_and_unknown_policies() -> None:
    assert AlwaysDisaggregate().decide(RequestFacts(1, 1, 0)) == Decision(True, "always")
    assert make_disaggregation_policy("always", 1, 1).name == "always"
    with pytest.raises(ValueError, match="unknown disaggregation policy"):
        make_disaggregation_policy("sometimes", 1, 1)


@pytest.fixture(scope="module")
def cluster(pd_pair: Cluster) -> Iterator[tuple[Cluster, Router]]:
    c = pd_pair.with_own_routers()  # the shared prefill and decode workers
    try:
        router = c.add_router(
            "--disaggregation",
            "conditional",
            "--local-prefill-tokens",
            str(LOCAL),
            "--prefill-busy-tokens",
            str(BUSY),
        )
        router.wait_ready(num_workers=2)
        yield c, router
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def complete(router: Router, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def decisions(router: Router, decision: str, reason: str) -> float:
    labels = f'decision="{decision}",reason="{reason}"'
    return router.metric("pdserve_router_disaggregation_decisions_total", labels)


def test_short_long_and_cached_prompts_go_where_they_cost_least(cluster) -> None:  # type: ignore[no-untyped-def]
    c, router = cluster
    short = complete(router, "The capital of France is")
    [timing] = short["usage"]["pdserve_timings"]
    assert timing["kv_source"] == "local"
    assert "prefill_queue_ms" not in timing and timing["decode_first_step_ms"] > 0
    assert decisions(router, "local", "short") == 1

    document = "Paged attention stores keys and values in fixed-size blocks. " * 14  # ~170 tokens
    long = complete(router, document + "Summarize:")
    [timing] = long["usage"]["pdserve_timings"]
    assert timing["kv_source"] == "pulled"
    for phase in ("prefill_queue", "prefill_compute", "kv_transfer", "decode_queue"):
        assert timing[f"{phase}_ms"] >= 0, timing
    assert timing["prefill_compute_ms"] > 0 and timing["kv_transfer_ms"] > 0
    assert decisions(router, "remote", "long") == 1

    again = complete(router, document + "List the key points:")  # same ~170-token prefix
    [timing] = again["usage"]["pdserve_timings"]
    assert timing["kv_source"] == "local"
    assert decisions(router, "local", "cached") == 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160

    for source, count in (("local", 2), ("pulled", 1)):
        labels = f'source="{source}"'
        assert router.metric("pdserve_router_kv_sources_total", labels) == count
    for phase in ("prefill_compute", "kv_transfer", "decode_first_step"):
        labels = f'phase="{phase}"'
        assert router.metric("pdserve_router_ttft_phase_seconds_count", labels) >= 1
    for worker in c.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0)


def test_a_burst_of_short_prompts_is_shared_with_the_prefill_worker(cluster) -> None:  # type: ignore[no-untyped-def]
    """Eight short prompts at once: the decode worker computes the first ones itself, and those
    that find it with a short prompt's worth (LOCAL tokens) still to compute go to the prefill
    worker - or stay, once the prefill worker has more than BUSY tokens queued and a longer
    queue than the decode worker's (``prefill_busy``). Once they are answered, its local queue
    is empty again: the next one is local."""
    c, router = cluster
    before = {
        reason: decisions(router, decision, reason)
        for decision, reason in (
            ("local", "short"),
            ("remote", "local_queue"),
            ("local", "prefill_busy"),
        )
    }
    prompts = [f"Request {i}: " + "tell me about paged attention " * 6 for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(router, p), prompts))
    assert all(a["usage"]["completion_tokens"] == 3 for a in answers)
    assert all(30 <= a["usage"]["prompt_tokens"] <= LOCAL for a in answers)  # all "short"
    short = decisions(router, "local", "short") - before["short"]
    remote = decisions(router, "remote", "local_queue") - before["local_queue"]
    busy = decisions(router, "local", "prefill_busy") - before["prefill_busy"]
    assert short + remote + busy == len(prompts)
    assert short >= 1 and remote >= 1, (short, remote, busy)
    sources = [a["usage"]["pdserve_timings"][0]["kv_source"] for a in answers]
    assert sources.count("pulled") == remote, sources

    complete(router, "A short question after the burst:")  # nothing left in the local queue
    assert decisions(router, "local", "short") - before["short"] == short + 1
    for worker in c.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0)


def test_the_usage_field_streams_too(cluster) -> None:  # type: ignore[no-untyped-def]
    _, router = cluster
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    usage_events = [line for line in response.text.splitlines() if '"usage":{' in line]
    assert usage_events and '"pdserve_timings":[{"kv_source":"local"' in usage_events[-1]


def test_streamed_and_whole_kv_give_the_same_answers(cluster) -> None:  # type: ignore[no-untyped-def]
    """Two routers over the same pair, both always disaggregating: one streams the KV while the
    prompt computes (the default), one pulls it once the prefill is done (--no-stream-kv). Same
    answers, sampled ones included (n > 1, a seed), and one token only; no block left behind."""
    c, _ = cluster
    streaming = c.add_router("--disaggregation", "always")
    whole = c.add_router("--disaggregation", "always", "--no-stream-kv")
    for router in (streaming, whole):
        router.wait_ready(num_workers=2)
    document = "Continuous batching admits new requests at every step. " * 12
    bodies = [
        {"prompt": document, "max_tokens": 6, "temperature": 0},
        {"prompt": document + "Why?", "max_tokens": 5, "n": 2, "seed": 7, "temperature": 1.0},
        {"prompt": document + "In short:", "max_tokens": 1, "temperature": 0},
        {"prompt": document + "Once:", "max_tokens": 1, "n": 2, "seed": 3, "temperature": 1.0},
    ]
    for body in bodies:
        answers = []
        for router in (streaming, whole):
            response = httpx.post(
                router.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120
            )
            assert response.status_code == 200, response.text
            answers.append(response.json())
        texts = [[choice["text"] for choice in answer["choices"]] for answer in answers]
        assert texts[0] == texts[1], body
        if body["max_tokens"] > 1:  # the part of the pull the prefill did not hide
            timing = answers[0]["usage"]["pdserve_timings"][0]
            assert 0 <= timing["kv_transfer_exposed_ms"] <= timing["kv_transfer_ms"]
        assert answers[0]["usage"]["completion_tokens"] == answers[1]["usage"]["completion_tokens"]
    streamed = streaming.metric("pdserve_router_kv_sources_total", 'source="pulled"')
    assert streamed == len(bodies)
    for worker in c.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0)


def test_a_streamed_pull_that_fails_before_the_first_token_is_recomputed(redis_server) -> None:  # type: ignore[no-untyped-def]
    """Every pull from this prefill worker arrives corrupted. The streamed pull fails before the
    decode worker has the first token, so it cannot recompute yet and answers ABORTED; the
    router asks the same worker again once the prefill's answer is in, and that attempt,
    failing its pull again, computes the prompt itself. The client sees a normal answer."""
    c = Cluster(redis_server.url)
    try:
        c.add_workers("prefill", extra=("--kv-faults", "corrupt=1"))
        (decode,) = c.add_workers("decode")
        router = c.add_router("--disaggregation", "always")
        router.wait_ready(num_workers=2)
        document = "A decode worker pulls the prompt's blocks while they are computed. " * 8
        answer = complete(router, document)
        [timing] = answer["usage"]["pdserve_timings"]
        assert timing["kv_source"] == "recomputed"
        assert answer["usage"]["completion_tokens"] == 3
        assert router.metric("pdserve_router_retries_total", 'pool="decode",reason="aborted"') == 1
        assert metric(decode, "pdserve_kv_pulls_total", 'outcome="failed"') == 1
        assert metric(decode, "pdserve_kv_pulls_total", 'outcome="recomputed"') == 1
        for worker in c.workers:
            assert wait_until(lambda w=worker: blocks_in_use(w) == 0)
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


def test_a_decode_worker_without_prefix_cache_is_never_expected_to_cache(redis_server) -> None:  # type: ignore[no-untyped-def]
    """The router remembers where it sent prompts, as a hint of what each decode worker caches;
    a worker run with --no-prefix-caching keeps nothing, so the same long prompt sent twice is
    computed on the prefill worker both times (before, the second went local as "cached" and
    its whole prompt stalled the decode worker's running streams)."""
    c = Cluster(redis_server.url)
    try:
        c.add_workers("prefill", "decode", extra=("--no-prefix-caching",))
        router = c.add_router("--disaggregation", "conditional", "--local-prefill-tokens", "64")
        router.wait_ready(num_workers=2)
        workers = httpx.get(router.url + "/v1/workers", timeout=10).json()["data"]
        assert [w["prefix_caching"] for w in workers] == [False, False]
        document = "Paged attention stores keys and values in fixed-size blocks. " * 14
        for _ in range(2):
            [timing] = complete(router, document)["usage"]["pdserve_timings"]
            assert timing["kv_source"] == "pulled"
        assert decisions(router, "remote", "long") == 2
        assert decisions(router, "local", "cached") == 0
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()
