"""The tool against a real pdserve system: Redis, a prefill and a decode worker, the router."""

from __future__ import annotations

import asyncio
import math

from loadtest.arrivals import Schedule
from loadtest.client import CHAT, ClientConfig, run
from loadtest.datasets import DatasetConfig, load
from loadtest.metrics import compute
from loadtest.report import summary_table
from tests.router.cluster import MODEL, cluster


def test_a_small_run_against_pdserve(redis_server) -> None:  # type: ignore[no-untyped-def]
    n, out_len = 8, 8
    samples = load(DatasetConfig(num_prompts=n, input_len=24, output_len=out_len, seed=0))
    with cluster(redis_server.url, ("prefill", "decode")) as (_, router):
        # Streamed chat completions (the stand-in tests cover the completions endpoint and the
        # other modes; one run here keeps the CPU-bound model's share of the test time small).
        cfg = ClientConfig(base_url=router.url, model=MODEL, endpoint=CHAT, ignore_eos=True,
                           disable_tqdm=True)  # fmt: skip
        out = asyncio.run(run(cfg, samples, Schedule(rate=16.0, burstiness=math.inf), n))
        m = compute(out, {"ttft": 60_000}, (50.0, 99.0))
        print(summary_table(cfg, out, m, ("ttft", "tpot", "itl", "e2el")))
    assert (m.completed, m.failed) == (n, 0), m.errors
    # ignore_eos: exactly max_tokens each, as the router's usage reports them.
    assert m.total_output_tokens == n * out_len
    assert all(r.usage_reported and r.output_len == out_len for r in out.results)
    assert m.total_input_tokens >= n * 20  # the router's own token count of the prompts
    assert 0 < m.stats["median_ttft_ms"] < m.stats["median_e2el_ms"]
    assert m.stats["median_tpot_ms"] > 0 and m.stats["median_itl_ms"] > 0
    assert m.slo_attainment == 1.0 and m.request_throughput > 0
    assert all(r.generated_text for r in out.results)
