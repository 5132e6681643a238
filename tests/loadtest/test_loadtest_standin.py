"""The tool against a stand-in server whose timings are known: every metric must come out as
the server's configuration implies."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from loadtest.arrivals import Schedule
from loadtest.client import CHAT, COMPLETIONS, ClientConfig, RunOutput, run
from loadtest.datasets import DatasetConfig, load
from loadtest.metrics import Metrics, compute
from tests.loadtest.standin import standin, timing_sensitive

TTFT, ITL = 0.1, 0.01  # seconds, the stand-in's fixed timings
MS = 1000.0
# What the client and the OS may add to a latency: a few ms on an idle machine, tens of ms when
# the test machine's two cores are shared with other work. A measured latency below the server's
# own delay would be a bug, so the lower bounds are exact.
SLACK = 45.0


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with standin(ttft=TTFT, itl=ITL, capacity=1000) as url:
        yield url


def go(
    url: str,
    n: int,
    rate: float = math.inf,
    out_len: int = 9,
    slos: dict[str, float] | None = None,
    dataset: str = "random",
    duration: float | None = None,
    **cfg_kwargs,  # type: ignore[no-untyped-def]
) -> tuple[RunOutput, Metrics]:
    cfg = ClientConfig(base_url=url, model="m", disable_tqdm=True, num_warmups=2, **cfg_kwargs)
    samples = load(DatasetConfig(name=dataset, num_prompts=n, input_len=20, output_len=out_len))
    schedule = Schedule(rate=rate, burstiness=math.inf)
    out = asyncio.run(run(cfg, samples, schedule, None if duration else n, duration))
    return out, compute(out, slos or {}, (50.0, 99.0))


@timing_sensitive
def test_streamed_timings_match_the_server(server) -> None:  # type: ignore[no-untyped-def]
    n, out_len, rate = 30, 9, 30.0
    out, m = go(server, n, rate=rate, out_len=out_len, slos={"ttft": 500, "tpot": 50})
    assert (m.completed, m.failed) == (n, 0)
    s = m.stats
    assert TTFT * MS <= s["median_ttft_ms"] <= TTFT * MS + SLACK
    assert abs(s["median_tpot_ms"] - ITL * MS) < 1.5
    assert abs(s["mean_tpot_ms"] - ITL * MS) < 1.5
    assert abs(s["median_itl_ms"] - ITL * MS) < 2.0
    e2el = (TTFT + (out_len - 1) * ITL) * MS
    assert e2el <= s["median_e2el_ms"] <= e2el + SLACK
    assert len(np.concatenate([r.itls for r in out.results])) == n * (out_len - 1)
    # Token counts come from the server's usage.
    assert m.total_output_tokens == n * out_len
    assert all(r.usage_reported for r in out.results)
    assert m.total_input_tokens == sum(r.prompt_len for r in out.results) > 0
    # Constant arrivals: n requests over (n - 1) / rate seconds, then one service time.
    duration = (n - 1) / rate + e2el / MS
    assert m.duration == pytest.approx(duration, rel=0.1)
    assert out.achieved_rate == pytest.approx(rate, rel=0.05)
    assert m.request_throughput == pytest.approx(n / duration, rel=0.1)
    assert m.output_throughput == pytest.approx(n * out_len / m.duration, rel=1e-9)
    assert m.total_token_throughput == pytest.approx(
        (m.total_input_tokens + m.total_output_tokens) / m.duration
    )
    # Each request is in flight for e2el, one arrives every 1/rate: about e2el * rate at once.
    assert m.max_concurrent_requests in range(5, 10)
    # Generous SLOs: everything is good; goodput equals throughput.
    assert m.slo_attainment == 1.0
    assert m.request_goodput == pytest.approx(m.request_throughput)
    # Peak tokens/s over 1-s buckets: about rate * out_len.
    assert m.max_output_tokens_per_s == pytest.approx(rate * out_len, rel=0.25)


@timing_sensitive
def test_slo_limits_decide_goodput(server) -> None:  # type: ignore[no-untyped-def]
    # A TTFT limit below the server's fixed TTFT: nothing is good.
    _, m = go(server, 10, rate=20, slos={"ttft": TTFT * MS * 0.5})
    assert m.slo_attainment == 0.0 and m.request_goodput == 0.0
    # A TPOT limit below the fixed inter-token delay: nothing is good either. The rate is one the
    # client keeps up with on a busy machine: a client that falls behind reads a stream's tokens in
    # one burst, and a burst measures a TPOT below the server's.
    _, m = go(server, 10, rate=20, slos={"ttft": 1000, "tpot": ITL * MS * 0.5})
    assert m.slo_attainment == 0.0


@timing_sensitive
def test_capacity_makes_requests_queue() -> None:
    # Capacity 2, 8 requests at once, service 100 + 4 * 10 = 140 ms: four waves of two.
    with standin(ttft=TTFT, itl=ITL, capacity=2) as url:
        out, m = go(url, 8, out_len=5)
    service = (TTFT + 4 * ITL) * MS
    ttfts = np.sort([r.ttft * MS for r in out.results])
    expected = np.repeat([TTFT * MS + k * service for k in range(4)], 2)
    assert np.all(ttfts >= expected - 1) and np.all(ttfts <= expected + SLACK), (ttfts, expected)
    # The spacing of the waves is the service time, whatever constant overhead there is.
    assert np.allclose(np.diff(ttfts[::2]), service, atol=15), ttfts
    assert m.max_concurrent_requests == 8  # the client keeps them all in flight
    assert 4 * service <= m.stats["p99_e2el_ms"] <= 4 * service + SLACK


def test_failed_requests_count_against_attainment() -> None:
    with standin(ttft=0.005, itl=0.002, capacity=100, fail_every=4) as url:
        cfg = ClientConfig(base_url=url, model="m", disable_tqdm=True)
        samples = load(DatasetConfig(num_prompts=20, input_len=5, output_len=4))
        out = asyncio.run(run(cfg, samples, Schedule(rate=200, burstiness=math.inf), 20))
    m = compute(out, {"ttft": 1000})
    assert (m.completed, m.failed) == (15, 5)
    assert m.errors == {"http_500": 5}
    assert m.slo_attainment == pytest.approx(15 / 20)
    assert m.request_goodput == pytest.approx(m.request_throughput)


@timing_sensitive
def test_max_concurrency_caps_requests_in_flight(server) -> None:  # type: ignore[no-untyped-def]
    out, m = go(server, 12, out_len=3, max_concurrency=3)
    assert m.completed == 12 and m.max_concurrent_requests == 3
    # TTFT is timed from the send, after the client's own queue (as vLLM does).
    assert m.stats["median_ttft_ms"] < TTFT * MS + SLACK


@timing_sensitive
def test_chat_stream_ignores_the_role_only_chunk(server) -> None:  # type: ignore[no-untyped-def]
    _, m = go(server, 6, rate=100, out_len=4, endpoint=CHAT)
    assert m.completed == 6 and m.total_output_tokens == 24
    assert TTFT * MS <= m.stats["median_ttft_ms"] <= TTFT * MS + SLACK


@timing_sensitive
def test_non_streaming_requests(server) -> None:  # type: ignore[no-untyped-def]
    out, m = go(server, 6, rate=100, out_len=5, stream=False)
    assert m.completed == 6 and m.total_output_tokens == 30
    e2el = (TTFT + 4 * ITL) * MS
    assert e2el <= m.stats["median_e2el_ms"] <= e2el + SLACK
    assert all(r.tpot is None and not r.itls for r in out.results)  # not observable


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_multi_turn_conversations_grow(server, endpoint) -> None:  # type: ignore[no-untyped-def]
    out, m = go(server, 4, rate=100, out_len=3, dataset="multiturn", endpoint=endpoint)
    assert m.completed == 4 * 3  # three turns each
    for index in range(4):
        turns = [r for r in out.results if r.index == index]
        assert [r.turn for r in turns] == [0, 1, 2]
        lens = [r.prompt_len for r in turns]
        assert lens[0] < lens[1] < lens[2]  # each turn carries the earlier ones and answers


@timing_sensitive
def test_duration_stops_the_run(server) -> None:  # type: ignore[no-untyped-def]
    out, m = go(server, 1000, rate=40, out_len=2, duration=0.5)
    # 0.5 s at 40 req/s: the 21st arrival would be at 0.5 s, the deadline.
    assert 15 <= len(out.send_times) <= 22
    assert m.completed == len(out.send_times) and m.duration < 0.5 + 0.11 + SLACK / MS
