"""Admission's parts in-process: `FairSlots` (fair order, bounded wait, bounded line, nothing
held by a refused or cancelled request), `LoadEstimator` (on a fake clock), `ClientKeys` (the
keys file, constant-time lookup, 401s) and the cheap text bound. The whole step against real
processes under hostile load: tests/router/test_hostile_load.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.admission import Admission, LoadEstimator
from router.clients import Client, ClientKeys
from router.config import RouterConfig
from router.errors import APIError
from router.fair_slots import FairSlots, Refused
from router.metrics import RouterMetrics

A, B, C = Client("key:a"), Client("key:b"), Client("key:c")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def settle() -> None:
    """Lets the tasks granted run to their end (a few turns of the loop)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def pending(slots: FairSlots, client: Client, n: int, timeout: float = 30.0) -> asyncio.Task:
    task = asyncio.create_task(slots.acquire(client, n, timeout))
    await asyncio.sleep(0)  # it reaches its line
    return task


def test_free_slots_are_granted_at_once_and_come_back() -> None:
    async def main() -> None:
        slots = FairSlots(4, max_waiting=8)
        await slots.acquire(A, 3, timeout=0)
        assert slots.in_use == 3 and slots.held(A) == 3
        slots.release(A, 3)
        assert slots.in_use == 0 and slots.held(A) == 0

    run(main())


def test_no_wait_refuses_at_once_when_full() -> None:
    async def main() -> None:
        slots = FairSlots(2, max_waiting=8)
        await slots.acquire(A, 2, timeout=0)
        with pytest.raises(Refused) as refused:
            await slots.acquire(B, 1, timeout=0)
        assert refused.value.reason == "full"
        assert slots.num_waiting == 0 and slots.in_use == 2

    run(main())


def test_the_client_holding_least_goes_first() -> None:
    """A holds 3 of 4 slots and waits with two more requests; B comes later but holds nothing:
    each freed slot goes to B's line first, then back to A's, oldest first."""

    async def main() -> None:
        slots = FairSlots(4, max_waiting=8)
        await slots.acquire(A, 4, timeout=0)
        a1 = await pending(slots, A, 1)
        a2 = await pending(slots, A, 1)
        b1 = await pending(slots, B, 1)
        slots.release(A, 1)
        await settle()
        assert b1.done() and not a1.done() and not a2.done()
        slots.release(A, 1)
        await settle()
        assert a1.done() and not a2.done()
        assert slots.held(A) == 3 and slots.held(B) == 1

    run(main())


def test_weights_give_a_bigger_share() -> None:
    """Weight 2 against 1: while both wait, A gets two slots for each of B's."""

    async def main() -> None:
        heavy, light = Client("key:heavy", weight=2), Client("key:light", weight=1)
        slots = FairSlots(6, max_waiting=32)
        await slots.acquire(C, 6, timeout=0)
        tasks = [await pending(slots, c, 1) for c in (heavy, light) * 6]
        for _ in range(6):
            slots.release(C, 1)
        await settle()
        assert (slots.held(heavy), slots.held(light)) == (4, 2)
        for t in tasks:
            t.cancel()

    run(main())


def test_a_big_request_is_not_starved_by_small_ones() -> None:
    """The neediest client's head keeps the freed slots for itself until it fits."""

    async def main() -> None:
        slots = FairSlots(4, max_waiting=8)
        await slots.acquire(A, 4, timeout=0)
        big = await pending(slots, B, 3)
        slots.release(A, 2)
        small = await pending(slots, C, 1)  # C holds 0 too, but came later
        await settle()
        assert not big.done() and not small.done() and slots.in_use == 2
        slots.release(A, 1)
        await settle()
        assert big.done() and not small.done()
        small.cancel()

    run(main())


def test_no_client_holds_more_than_its_cap() -> None:
    """With a share of 0.5, A may hold 2 of 4 slots (4 with weight 2) even when alone: its
    third waits with slots free, and B, coming later, gets them."""

    async def main() -> None:
        slots = FairSlots(4, max_waiting=8, share=0.5)
        assert slots.cap(A) == 2 and slots.cap(Client("key:w", weight=2)) == 4
        await slots.acquire(A, 2, timeout=0)
        with pytest.raises(Refused) as refused:
            await slots.acquire(A, 1, timeout=0)
        assert refused.value.reason == "client_share"
        third = await pending(slots, A, 1)
        await slots.acquire(B, 2, timeout=0)
        await settle()
        assert not third.done() and slots.in_use == 4
        slots.release(A, 1)
        await settle()
        assert third.done() and slots.held(A) == 2
        with pytest.raises(ValueError):  # wider than its cap: the handler's 400 comes first
            await slots.acquire(A, 3, timeout=1)

    run(main())


def test_a_full_line_displaces_the_longest_lines_newest() -> None:
    async def main() -> None:
        slots = FairSlots(1, max_waiting=2)
        await slots.acquire(A, 1, timeout=0)
        a1 = await pending(slots, A, 1)
        a2 = await pending(slots, A, 1)
        b1 = await pending(slots, B, 1)  # the line is full: A's newest gives way
        await settle()
        assert a2.done() and isinstance(a2.exception(), Refused)
        assert a2.exception().reason == "queue_full"  # type: ignore[union-attr]
        assert not a1.done() and not b1.done() and slots.num_waiting == 2
        with pytest.raises(Refused) as refused:  # A holds the longest line: it may not grow
            await slots.acquire(A, 1, timeout=5)
        assert refused.value.reason == "queue_full"
        slots.release(A, 1)  # A and B hold nothing now: the older request goes first
        await settle()
        assert a1.done() and a1.exception() is None and not b1.done()
        slots.release(A, 1)
        await settle()
        assert b1.done() and b1.exception() is None and slots.held(B) == 1

    run(main())


def test_a_wait_ends_at_its_timeout_holding_nothing() -> None:
    async def main() -> None:
        slots = FairSlots(1, max_waiting=4)
        await slots.acquire(A, 1, timeout=0)
        with pytest.raises(Refused) as refused:
            await slots.acquire(B, 1, timeout=0.05)
        assert refused.value.reason == "queue_timeout"
        assert slots.num_waiting == 0 and slots.held(B) == 0

    run(main())


def test_cancelled_waiters_hold_nothing_and_a_granted_one_gives_back() -> None:
    async def main() -> None:
        slots = FairSlots(1, max_waiting=4)
        await slots.acquire(A, 1, timeout=0)
        waiting = await pending(slots, B, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert slots.num_waiting == 0 and slots.held(B) == 0
        granted = await pending(slots, C, 1)
        slots.release(A, 1)  # C's future is granted, then its task is cancelled before it runs
        granted.cancel()
        await asyncio.gather(granted, return_exceptions=True)
        assert slots.in_use == 0 and slots.held(C) == 0

    run(main())


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_load_estimate_is_the_queue_over_the_start_rate() -> None:
    clock = FakeClock()
    load = LoadEstimator(clock)
    assert load.predicted_wait(ahead=10) == 0.0  # no rate yet: nobody is refused on a guess
    load.admitted(20)
    for _ in range(10):  # 2 sub-requests start each second while some wait
        clock.now += 1.0
        load.left(2, started=True)
    assert load.rate() == pytest.approx(2.0)
    assert load.not_started == 0
    load.admitted(8)
    assert load.predicted_wait(ahead=2) == pytest.approx((8 + 2) / 2.0)
    clock.now += 100.0  # idle time (nothing waiting) does not count against the rate ...
    load.left(8, started=False)  # ... nor do sub-requests that ended without starting
    assert load.rate() == pytest.approx(2.0, rel=0.01)


def test_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    keys = [
        {"name": "team-a", "key": "sk-aaaaaaaaaaaa", "weight": 2},
        {"name": "team-b", "key": "sk-bbbbbbbbbbbb", "cache_salt": ""},
    ]
    path.write_text(json.dumps(keys))
    loaded = ClientKeys.load("sk-single-key", str(path))
    header = [(b"authorization", b"Bearer sk-aaaaaaaaaaaa")]
    a = loaded.client(header, "10.0.0.1")
    assert a.id == "key:team-a" and a.weight == 2 and a.cache_salt and len(a.cache_salt) == 64
    b = loaded.client([(b"authorization", b"Bearer sk-bbbbbbbbbbbb")], None)
    assert b.id == "key:team-b" and b.cache_salt is None  # opted out
    single = loaded.client([(b"authorization", b"bearer sk-single-key")], None)
    assert single == Client("key:default")
    with pytest.raises(APIError) as missing:
        loaded.client([], "10.0.0.1")
    assert (missing.value.status, missing.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError) as wrong:
        loaded.client([(b"authorization", b"Bearer sk-aaaaaaaaaaab")], None)
    assert wrong.value.message == "incorrect API key"
    assert ClientKeys.load(None, None).client([], "10.0.0.9") == Client("addr:10.0.0.9")


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("not json", "Expecting value"),
        ("[]", "non-empty JSON list"),
        ('[{"name": "a", "key": "short"}]', "at least 8 characters"),
        ('[{"name": "a", "key": "sk-aaaaaaaa", "weight": 0}]', "greater than 0"),
        ('[{"name": "a", "key": "sk-aaaaaaaa", "extra": 1}]', "Extra inputs"),
        ('[{"name": "a", "key": "sk-aaaaaaaa"}, {"name": "a", "key": "sk-bbbbbbbb"}]', "unique"),
    ],
)
def test_a_bad_keys_file_is_refused_at_start(tmp_path: Path, content: str, error: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=error):
        ClientKeys.load(None, str(path))


def test_text_bound() -> None:
    """With 81 bytes for the longest token and a 100-token context, 99 x 81 characters may
    fit; one more cannot; several prompts are bounded by --max-request-prompt-tokens."""
    config = RouterConfig(max_request_prompt_tokens=150)
    admission = Admission(config, 81, RouterMetrics())
    try:
        admission.check_text([99 * 81], 100, "prompt")
        with pytest.raises(APIError) as raised:
            admission.check_text([99 * 81 + 1], 100, "prompt")
        assert raised.value.status == 400 and raised.value.code == "context_length_exceeded"
        assert raised.value.message == (
            "the prompt text has 8020 characters; no text over 8019 characters fits 99 tokens "
            "(the model's context length) at 81 characters for this model's longest token"
        )
        with pytest.raises(APIError) as many:
            admission.check_text([80 * 81, 80 * 81], 100, "prompt")
        assert "--max-request-prompt-tokens" in many.value.message
    finally:
        admission.close()


def test_a_predicted_wait_over_the_limit_is_a_503_at_once() -> None:
    """2 sub-requests start per second and 20 wait: a request that would wait ~10.5 s for its
    first token is refused at once when --max-queue-wait is 5 (counted), admitted when it is
    30; admitted requests are counted until their first token."""

    async def main() -> None:
        metrics = RouterMetrics()
        strict = Admission(RouterConfig(max_queue_wait_seconds=5), 1, metrics)
        clock = FakeClock()
        strict.load = LoadEstimator(clock)
        strict.load.admitted(40)
        for _ in range(10):
            clock.now += 1.0
            strict.load.left(2, started=True)
        with pytest.raises(APIError) as refused:
            async with strict.admitted(A, 1, deadline=1e18):
                pass
        error = refused.value
        assert (error.status, error.retry_after) == (503, 6)
        assert error.message == (
            "the router predicts a wait of 10 s before this request starts, over its limit "
            "of 5 s (--max-queue-wait): retry later"
        )
        assert metrics.rejected.labels(reason="predicted_wait")._value.get() == 1
        assert strict.slots.in_use == 0
        strict.close()

        patient = Admission(RouterConfig(max_queue_wait_seconds=30), 1, metrics)
        patient.load = strict.load
        async with patient.admitted(A, 1, deadline=1e18) as ticket:
            assert patient.load.not_started == 21 and patient.slots.in_use == 1
            ticket.start()
            assert patient.load.not_started == 20
        assert patient.slots.in_use == 0 and patient.load.not_started == 20
        patient.close()

    run(main())
