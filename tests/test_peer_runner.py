"""``benchmarks/peer_runner.py``'s profile parsing on a real PyTorch profiler table: the table
vLLM's worker writes has this format, and the per-step split in docs/benchmarks.md comes from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peer_runner import categorize, parse_table  # noqa: E402


def test_a_profiler_table_splits_into_gemms_attention_and_the_rest() -> None:
    linear = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("pdserve::paged_attention_decode"):
            torch.softmax(x, dim=-1)
        for _ in range(20):
            linear(x).relu_()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    ops, total = parse_table(table)
    assert any("addmm" in name or "linear" in name for name in ops), ops
    assert "pdserve::paged_attention_decode" in ops and "aten::relu_" in ops
    assert total == pytest.approx(sum(ops.values()), rel=0.02)  # every row was read
    parts = categorize(ops, total, wall=2 * total)
    assert parts["GEMMs (linear layers)"] > 0 and parts["attention + KV write"] > 0
    assert parts["other torch ops"] >= ops["aten::relu_"]
    assert parts["outside torch ops (Python, scheduling)"] == pytest.approx(total)
    assert parts["step total"] == 2 * total
