"""Routing policies on their own, against a real Redis registry (records and prefix sets
published by real `WorkerRegistration`s): which worker each policy picks, and why."""

from __future__ import annotations

import dataclasses
from collections import Counter

from router.policies import POLICIES, PolicyContext, RouteRequest, make_policy
from services.engine.hashing import hash_full_blocks
from services.registry import RegistryView, WorkerRegistration
from tests.services.test_registry import fast_config, make_record, run

PROMPT = list(range(100, 100 + 16 * 8))  # 8 full blocks of 16 tokens


def test_every_policy_is_registered_under_its_name():
    assert sorted(POLICIES) == ["least_loaded", "prefix_aware", "round_robin"]
    assert all(cls.name == name for name, cls in POLICIES.items())


def test_round_robin_and_least_loaded(redis_server):  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        config = fast_config(redis_server.url)
        a, b = make_record("a"), make_record("b")
        async with WorkerRegistration(config, a), WorkerRegistration(config, b):
            async with RegistryView(config) as view:
                in_flight: Counter[str] = Counter()
                context = PolicyContext(view, in_flight)
                workers = view.workers("prefill")
                request = RouteRequest(PROMPT)

                rr = make_policy("round_robin", context)
                picks = [(await rr.choose(workers, request)).worker_id for _ in range(4)]
                assert picks == ["a", "b", "a", "b"]

                least = make_policy("least_loaded", context)
                in_flight["a"] = 3
                assert {(await least.choose(workers, request)).worker_id for _ in range(3)} == {"b"}
                busy_b = dataclasses.replace(b, num_waiting=5)  # published load counts too
                assert (await least.choose([a, busy_b], request)).worker_id == "a"

    run(scenario())


def test_prefix_aware_prefers_the_published_cache_unless_the_load_outweighs_it(redis_server):  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        config = fast_config(redis_server.url)
        a = make_record("a")
        b = dataclasses.replace(make_record("b"), kv_blocks_cached=6)
        async with WorkerRegistration(config, a), WorkerRegistration(config, b) as reg_b:
            # b publishes that it caches the prompt's first 6 blocks (of 8); a caches nothing
            await reg_b.publish_prefix_hashes(hash_full_blocks(PROMPT, 16)[:6])
            async with RegistryView(config) as view:
                in_flight: Counter[str] = Counter()
                workers = view.workers("prefill")
                policy = make_policy("prefix_aware", PolicyContext(view, in_flight, 0.5))
                assert (await policy.choose(workers, RouteRequest(PROMPT))).worker_id == "b"
                # with 10 requests in flight on b, load weight 1.0 outweighs 6/8 cached blocks
                in_flight["b"] = 10
                heavy = make_policy("prefix_aware", PolicyContext(view, in_flight, 1.0))
                assert (await heavy.choose(workers, RouteRequest(PROMPT))).worker_id == "a"


def test_prefix_aware_remembers_its_own_routing_before_workers_publish(redis_server):  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        config = fast_config(redis_server.url)
        async with WorkerRegistration(config, make_record("a")):
            async with WorkerRegistration(config, make_record("b")):
                async with RegistryView(config) as view:
                    policy = make_policy("prefix_aware", PolicyContext(view, Counter()))
                    workers = view.workers("prefill")
                    system = list(range(500, 500 + 16 * 10))
                    first = await policy.choose(workers, RouteRequest(system + [1, 2, 3]))
                    # Nothing is published yet; the same system prompt follows the first one.
                    for tail in ([4, 5], [6], [7, 8, 9, 10]):
                        chosen = await policy.choose(workers, RouteRequest(system + tail))
                        assert chosen.worker_id == first.worker_id
                    # A prompt shorter than a block has no prefix to follow: least loaded.
                    assert (await policy.choose(workers, RouteRequest([1, 2]))) in workers

    run(scenario())
