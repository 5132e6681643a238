"""Routing across independently scaled pools, on real processes: workers that join are used
within seconds, a worker stopped with SIGTERM costs no request, and prefix-aware routing sends
prompts that share a system prompt to the prefill worker that caches it."""

from __future__ import annotations

import random
import signal
import threading
import time

import openai
import pytest

from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, cluster, wait_until
from tests.services.workers import metric


def finished(worker) -> float:  # type: ignore[no-untyped-def]
    return metric(worker, "pdserve_requests_total", 'outcome="finished"')


class Traffic:
    """Closed-loop load: ``concurrency`` threads sending short completions until stopped."""

    def __init__(self, router: Router, concurrency: int = 3):
        self.client = router.client(timeout=60)
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(concurrency)]
        self.stop = threading.Event()
        self.num_ok = 0
        self.failures: list[str] = []

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def _loop(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                response = self.client.completions.create(
                    model=MODEL, prompt=f"Request {i}-{n}: count to ten.", max_tokens=8
                )
                assert response.choices[0].finish_reason in ("length", "stop")
                self.num_ok += 1
            except Exception as exc:  # every failure is a finding
                self.failures.append(f"{type(exc).__name__}: {exc}")


def test_scale_out_then_graceful_stop_loses_no_request(redis_server):  # type: ignore[no-untyped-def]
    with cluster(redis_server.url, ("prefill", "decode")) as (c, router):
        first_decode = c.workers[1]
        with Traffic(router) as traffic:
            assert wait_until(lambda: traffic.num_ok >= 3, timeout=60)
            (second_decode,) = c.add_workers("decode")
            joined = time.monotonic()
            assert wait_until(lambda: finished(second_decode) >= 1, timeout=15), (
                "the new decode worker got no request"
            )
            print(f"new decode worker served its first request {time.monotonic() - joined:.1f}s in")

            first_decode.signal(signal.SIGTERM)
            assert first_decode.proc is not None
            assert first_decode.proc.wait(timeout=60) == 0
            served_by_second = finished(second_decode)
            ok_before = traffic.num_ok
            assert wait_until(lambda: traffic.num_ok >= ok_before + 5, timeout=60)
            assert finished(second_decode) > served_by_second
        assert traffic.failures == []
        assert router.num_healthy() == 2  # the stopped worker left the view
        assert wait_until(lambda: blocks_in_use(second_decode) == 0)


SYSTEM = (
    "You are the support assistant of {name}, a company that sells {thing}. Answer in one short "
    "sentence, politely, without inventing facts. Our opening hours are nine to five on weekdays. "
    "Shipping takes three to five business days; returns are free within thirty days. Never "
    "share personal data. If a question is not about {thing}, say you can only help with {thing}. "
)
QUESTIONS = ["Do you ship abroad?", "Can I return an item?", "When are you open?", "Hi!"]


def conversations(names: list[str]) -> list[list[dict[str, str]]]:
    """Every (system prompt, question) pair, shuffled so pools cannot get lucky by alternation."""
    items = [
        [
            {"role": "system", "content": SYSTEM.format(name=name, thing=name.lower() + "s")},
            {"role": "user", "content": q},
        ]
        for name in names
        for q in QUESTIONS
    ]
    random.Random(0).shuffle(items)
    return items


def prefill_hit_rate(router: Router, names: list[str]) -> float:
    """Fraction of prompt tokens that the prefill workers' prefix caches already held."""
    client = router.client(timeout=60)
    cached = total = 0
    for messages in conversations(names):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0
        )
        cached += response.usage.prompt_tokens_details.cached_tokens
        total += response.usage.prompt_tokens
    return cached / total


def test_prefix_aware_routing_finds_the_cached_system_prompt(redis_server):  # type: ignore[no-untyped-def]
    roles = ("prefill", "prefill", "decode")
    with cluster(redis_server.url, roles, "--prefill-policy", "prefix_aware") as (c, aware):
        round_robin = c.add_router("--prefill-policy", "round_robin")
        round_robin.wait_ready(num_workers=3)
        prefills = c.workers[:2]

        before = [finished(p) for p in prefills]
        rr_rate = prefill_hit_rate(round_robin, ["Lamp", "Chair", "Table", "Mirror"])
        rr_split = [finished(p) - b for p, b in zip(prefills, before)]

        before = [finished(p) for p in prefills]
        aware_rate = prefill_hit_rate(aware, ["Kettle", "Teapot", "Cup", "Spoon"])
        aware_split = [finished(p) - b for p, b in zip(prefills, before)]

        print(
            f"prefill hit rate: round_robin {rr_rate:.2f} {rr_split}, "
            f"prefix_aware {aware_rate:.2f} {aware_split}"
        )
        assert rr_split == [8, 8]  # round robin ignores the cache
        assert aware_rate > rr_rate
        # Each system prompt is computed once: 4 misses of 16; everything else reuses it.
        assert aware_rate > 0.6


def test_router_keeps_serving_from_its_last_view_while_redis_is_down(redis_executable):  # type: ignore[no-untyped-def]
    from services.redis_server import RedisServer

    with RedisServer(executable=redis_executable) as redis:
        with cluster(redis.url, ("prefill", "decode")) as (c, router):
            client = router.client(timeout=30)
            ask = lambda: client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)  # noqa: E731
            assert ask().choices[0].finish_reason == "length"
            redis.stop()
            assert wait_until(lambda: router.get("/v1/workers")[1]["registry"]["stale"], 10)
            started = time.monotonic()
            for _ in range(3):
                assert ask().choices[0].finish_reason == "length"
            assert time.monotonic() - started < 10
            assert router.get("/ready")[0] == 200
            redis.start()  # same port, empty: the workers register again by themselves
            assert wait_until(lambda: not router.get("/v1/workers")[1]["registry"]["stale"], 10)
            assert wait_until(lambda: router.num_healthy() == 2, 10)
            assert ask().choices[0].finish_reason == "length"


def test_workers_with_different_fingerprints_are_never_paired(redis_server):  # type: ignore[no-untyped-def]
    c = Cluster(redis_server.url)
    try:
        c.add_workers("prefill")
        c.add_workers("decode", extra=("--block-size", "32"))
        router = c.add_router()
        assert wait_until(lambda: len(router.get("/v1/workers")[1]["data"]) == 2)
        status, body = router.get("/ready")
        assert status == 503
        assert "no prefill/decode pair has equal fingerprints" in body["error"]["message"]
        (pair,) = router.get("/v1/workers")[1]["incompatible_pairs"]
        assert "block_size 16 != 32" in pair["reason"]
        with pytest.raises(openai.InternalServerError) as failure:
            router.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert failure.value.status_code == 503
        assert "equal fingerprints" in failure.value.message
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()
