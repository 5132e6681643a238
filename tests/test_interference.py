"""benchmarks/interference.py against a real router and colocated worker: the gaps of the
background streams are split by the long prompts' windows, and the streams it cancels at the
end leave no KV blocks behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.router.cluster import blocks_in_use, cluster, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import interference  # noqa: E402


def test_gaps_are_split_by_long_prompt_windows():
    result = interference.InterferenceResult(
        token_times=[[0.0, 1.0, 2.0, 3.0, 4.0]], long_windows=[(1.5, 2.5)]
    )
    quiet, loaded = result.gaps()
    assert quiet == [1000.0, 1000.0] and loaded == [1000.0, 1000.0]
    assert result.summary()["num_gaps"] == {"quiet": 2, "loaded": 2}


def test_measure_against_a_real_router(redis_server, tmp_path):  # type: ignore[no-untyped-def]
    cfg = interference.InterferenceConfig(
        num_streams=2, num_long=2, long_prompt_tokens=200, warmup_s=0.5, gap_s=0.3
    )
    with cluster(redis_server.url, ("colocated",)) as (c, router):
        result = asyncio.run(interference.measure(router.url, cfg))
        assert len(result.long_windows) == 2
        assert all(end > start for start, end in result.long_windows)
        assert all(len(times) > 3 for times in result.token_times), "streams decoded"
        quiet, loaded = result.gaps()
        assert quiet and loaded
        summary = result.summary()
        assert summary["itl_quiet_p99_ms"] > 0 and len(summary["long_prompt_ttft_ms"]) == 2
        assert interference.save_plot(tmp_path / "hol.png", {"coloc": result}, "test")
        assert (tmp_path / "hol.png").stat().st_size > 0
        assert wait_until(lambda: blocks_in_use(c.workers[0]) == 0), "cancelled streams leaked"
