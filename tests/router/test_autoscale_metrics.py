"""The router's autoscaling metrics: per-pool gauges (requests on the pool's workers, KV use,
routable workers) and SLO attainment, read from a real router's /metrics while real prefill and
decode workers serve a real request; the sliding window and the SLO counters on their own."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics, SlidingShare
from tests.router.cluster import MODEL, Cluster, Router, blocks_in_use, wait_until

POOLS = ("prefill", "decode", "colocated")
PROMPT_TOKENS = 1000  # random ids: a prefill long enough to be seen; 63 of 128 KV blocks
MAX_TOKENS = 128
TINY, HUGE = "0.000001", "1000"


def scrape(router: Router) -> dict[tuple[str, str], float]:
    """One scrape of the router's /metrics: (sample name, its labels as k=v,...) -> value."""
    text = urllib.request.urlopen(router.url + "/metrics", timeout=5).read().decode()
    return {
        (s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass
class Snapshot:
    """The pool gauges at one scrape."""

    requests: dict[str, float]  # pdserve_router_pool_requests_in_flight by pool
    kv_usage: dict[str, float]  # pdserve_router_pool_kv_blocks_used_ratio by pool
    in_flight: float  # pdserve_router_requests_in_flight

    @classmethod
    def take(cls, router: Router) -> Snapshot:
        samples = scrape(router)
        return cls(
            requests={
                p: samples[("pdserve_router_pool_requests_in_flight", f"pool={p}")] for p in POOLS
            },
            kv_usage={
                p: samples[("pdserve_router_pool_kv_blocks_used_ratio", f"pool={p}")] for p in POOLS
            },
            in_flight=samples[("pdserve_router_requests_in_flight", "")],
        )

    @property
    def is_idle(self) -> bool:
        values = [*self.requests.values(), *self.kv_usage.values(), self.in_flight]
        return all(v == 0 for v in values)


@dataclass
class Observed:
    """Pool gauges scraped every 50 ms while one long streaming request ran."""

    before: Snapshot
    during: list[Snapshot] = field(default_factory=list)
    prompt_tokens: int = 0
    num_blocks: int = 0  # the decode worker's KV pool
    block_size: int = 0


@dataclass
class Routers:
    plain: Router  # no SLO set
    tight_ttft: Router  # TTFT SLO no request meets, ITL SLO every request meets
    tight_itl: Router  # the other way round


@pytest.fixture(scope="module")
def disagg(pd_pair: Cluster) -> Iterator[tuple[Cluster, Routers]]:
    c = pd_pair.with_own_routers()  # the shared prefill and decode workers
    try:
        router = c.add_router()
        tight_ttft = c.add_router("--ttft-slo-seconds", TINY, "--itl-slo-seconds", HUGE)
        tight_itl = c.add_router("--ttft-slo-seconds", HUGE, "--itl-slo-seconds", TINY)
        for r in (router, tight_ttft, tight_itl):
            r.wait_ready(num_workers=2)
        yield c, Routers(router, tight_ttft, tight_itl)
        assert wait_until(lambda: all(blocks_in_use(w) == 0 for w in c.workers))
    except BaseException:
        c.dump()
        raise
    finally:
        c.stop()


@pytest.fixture(scope="module")
def observed(disagg) -> Observed:  # type: ignore[no-untyped-def]
    """One streaming completion of a fresh 1000-token prompt (no prefix cache can shorten its
    prefill) and 128 tokens, with the router's pool gauges scraped throughout."""
    _, routers = disagg
    router = routers.plain
    assert wait_until(lambda: Snapshot.take(router).is_idle), Snapshot.take(router)
    _, workers = router.get("/v1/workers")
    (decode,) = [w for w in workers["data"] if w["role"] == "decode"]
    out = Observed(
        before=Snapshot.take(router),
        num_blocks=decode["kv_blocks_total"],
        block_size=decode["fingerprint"]["block_size"],
    )
    rng = random.Random()  # a new prompt each run: no worker caches it
    prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
    failures: list[BaseException] = []

    def run() -> None:
        try:
            stream = router.client(timeout=120).completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.usage is not None:
                    out.prompt_tokens = chunk.usage.prompt_tokens
        except BaseException as exc:  # noqa: BLE001 (reported by the fixture)
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        out.during.append(Snapshot.take(router))
        time.sleep(0.05)
    thread.join()
    assert not failures, failures
    return out


def test_pool_gauges_follow_a_request_through_prefill_then_decode(observed, disagg) -> None:  # type: ignore[no-untyped-def]
    _, routers = disagg
    requests = [s.requests for s in observed.during]
    assert observed.before.requests == dict.fromkeys(POOLS, 0)
    # One request, counted in each pool while the router has a call open there: the prefill
    # call first; the decode stream from the KV handle on, so while the prompt still computes
    # (the streamed hand-off) it is in both; then in decode alone until the end.
    assert max(r["prefill"] for r in requests) == 1
    assert max(r["decode"] for r in requests) == 1
    assert all(r["colocated"] == 0 for r in requests)
    in_prefill = [i for i, r in enumerate(requests) if r["prefill"]]
    in_decode = [i for i, r in enumerate(requests) if r["decode"]]
    assert in_prefill[0] <= in_decode[0], "decode before prefill"
    assert in_prefill == list(range(in_prefill[0], in_prefill[-1] + 1)), "prefill came back"
    assert in_decode[-1] > in_prefill[-1], "the request did not end in decode"
    assert max(s.in_flight for s in observed.during) == 1
    # Nothing stays counted once the response is over (the gauges are read at scrape time).
    assert wait_until(lambda: Snapshot.take(routers.plain).requests == dict.fromkeys(POOLS, 0))
    assert Snapshot.take(routers.plain).in_flight == 0
    # The routable workers per role, from the same registry view.
    for role, count in (("prefill", 1), ("decode", 1), ("colocated", 0)):
        assert routers.plain.metric("pdserve_router_workers", f'pool="{role}"') == count


def test_decode_kv_usage_rises_while_the_request_holds_blocks(observed, disagg) -> None:  # type: ignore[no-untyped-def]
    _, routers = disagg
    assert observed.prompt_tokens == PROMPT_TOKENS
    assert observed.before.kv_usage["decode"] == 0
    # While it runs, the decode worker holds at least the prompt's blocks; the router sees them
    # once the worker's heartbeat has published them and its view has refreshed.
    prompt_blocks = -(-PROMPT_TOKENS // observed.block_size)
    held = prompt_blocks / observed.num_blocks
    peak = max(s.kv_usage["decode"] for s in observed.during)
    assert held <= peak <= 1, (held, peak)
    assert all(s.kv_usage["colocated"] == 0 for s in observed.during)  # no such worker
    # Finished: its blocks are free or merely cached, and the ratio counts only used ones.
    assert wait_until(lambda: Snapshot.take(routers.plain).kv_usage["decode"] == 0, timeout=10)


def complete(router: Router, num_requests: int) -> None:
    client = router.client(timeout=60)
    for i in range(num_requests):
        response = client.completions.create(
            model=MODEL,
            prompt=f"Request {i}: count to ten.",
            max_tokens=8,
            extra_body={"ignore_eos": True},  # 8 tokens: an inter-token latency to judge
        )
        assert response.usage is not None and response.usage.completion_tokens == 8


def test_slo_attainment_and_violations(disagg) -> None:  # type: ignore[no-untyped-def]
    _, routers = disagg
    complete(routers.tight_ttft, 3)
    complete(routers.tight_itl, 3)
    for router, missed, met in (
        (routers.tight_ttft, "ttft", "itl"),
        (routers.tight_itl, "itl", "ttft"),
    ):
        assert router.metric("pdserve_router_slo_attainment", f'slo="{missed}"') == 0
        assert router.metric("pdserve_router_slo_requests_total", f'slo="{missed}"') == 3
        assert router.metric("pdserve_router_slo_violations_total", f'slo="{missed}"') == 3
        assert router.metric("pdserve_router_slo_attainment", f'slo="{met}"') == 1
        assert router.metric("pdserve_router_slo_requests_total", f'slo="{met}"') == 3
        assert router.metric("pdserve_router_slo_violations_total", f'slo="{met}"') == 0
    # Without SLOs there is nothing to judge: no series (an attainment of 1 would be a claim).
    samples = scrape(routers.plain)
    assert not [name for name, _ in samples if name.startswith("pdserve_router_slo_")]


# -- the pieces on their own (no processes) ------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sliding_share_forgets_outcomes_older_than_its_window() -> None:
    clock = FakeClock()
    share = SlidingShare(window_seconds=10, bucket_seconds=1, clock=clock)
    assert share.share() == 1.0  # nothing judged, nothing missed
    share.add(False)
    clock.now += 5
    share.add(True)
    share.add(True)
    share.add(True)
    assert share.share() == 0.75
    clock.now += 5  # the miss is 10 s old: out of the window
    assert share.share() == 1.0
    clock.now += 4.5
    assert share.share() == 1.0
    clock.now += 0.5  # and now the hits too
    assert share.share() == 1.0 and share._num_total == 0
    share.add(False)
    assert share.share() == 0.0


def test_sliding_share_memory_is_bounded_by_the_window() -> None:
    clock = FakeClock()
    share = SlidingShare(window_seconds=60, bucket_seconds=1, clock=clock)
    for i in range(400):  # 4 per second for 100 s, one miss each second
        share.add(i % 4 != 0)
        clock.now += 0.25
    assert len(share._buckets) <= 60
    assert share._num_total == 240  # the last 60 s
    assert share.share() == 0.75


def test_slo_counters_and_requests_that_never_got_a_token() -> None:
    clock = FakeClock()
    metrics = RouterMetrics()
    metrics.track_slos(ttft_seconds=0.5, itl_seconds=None, window_seconds=60, clock=clock)
    metrics.judge("ttft", 0.2)
    metrics.judge("ttft", 0.7)
    metrics.judge("itl", 99.0)  # off: ignored
    metrics.judge_unanswered(0.1)  # failed fast: not judged
    metrics.judge_unanswered(3.0)  # waited past the SLO without a token: a miss
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_router_slo_requests_total{slo="ttft"} 3.0' in text
    assert 'pdserve_router_slo_violations_total{slo="ttft"} 2.0' in text
    assert 'pdserve_router_slo_attainment{slo="ttft"} 0.3333333333333333' in text
    assert 'slo="itl"' not in text
    clock.now += 60
    assert (
        'pdserve_router_slo_attainment{slo="ttft"} 1.0'
        in generate_latest(metrics.registry).decode()
    )
