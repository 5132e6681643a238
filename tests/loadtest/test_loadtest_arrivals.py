"""Arrival processes, workloads, SLO parsing, and the max-rate-under-SLO search."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from loadtest.arrivals import (
    Schedule,
    gaps,
    offsets,
    parse_rates,
    ramp_rate,
    scheduled_rate_note,
)
from loadtest.client import ClientConfig, RequestResult, rate_check
from loadtest.datasets import PRESETS, DatasetConfig, approx_tokens, describe, load
from loadtest.metrics import meets, parse_goodput, percentile_name
from loadtest.slo import RunSpec, search
from tests.loadtest.standin import standin


@pytest.mark.parametrize(
    ("burstiness", "cv"),
    [(1.0, 1.0), (0.5, math.sqrt(2)), (4.0, 0.5), (math.inf, 0.0)],
)
def test_gaps_have_the_mean_and_cv_of_their_process(burstiness: float, cv: float) -> None:
    rate = 8.0
    g = gaps(rate, burstiness, 200_000, np.random.default_rng(1))
    assert g.mean() == pytest.approx(1 / rate, rel=0.01)
    assert g.std() / g.mean() == pytest.approx(cv, abs=0.02)


def test_the_offset_generator_matches_too() -> None:
    """The generator the run loop uses (one gap at a time) has the same statistics."""
    rng = np.random.default_rng(2)
    t = np.fromiter(offsets(Schedule(rate=5.0, burstiness=0.5), 50_000, rng), float)
    g = np.diff(t)
    assert t[0] == 0.0
    assert g.mean() == pytest.approx(0.2, rel=0.02)
    assert g.std() / g.mean() == pytest.approx(math.sqrt(2), abs=0.04)


def test_all_at_once_and_seeded_reproducibility() -> None:
    assert list(offsets(Schedule(rate=math.inf), 5, np.random.default_rng(0))) == [0.0] * 5
    a = list(offsets(Schedule(rate=3.0), 100, np.random.default_rng(7)))
    b = list(offsets(Schedule(rate=3.0), 100, np.random.default_rng(7)))
    assert a == b


def test_linear_ramp() -> None:
    s = Schedule(ramp_start_rate=2.0, ramp_end_rate=10.0, burstiness=math.inf)
    assert ramp_rate(s, 0, 5, 0.0) == 2.0
    assert ramp_rate(s, 2, 5, 0.0) == 6.0
    assert ramp_rate(s, 4, 5, 0.0) == 10.0
    t = list(offsets(s, 5, np.random.default_rng(0)))
    assert np.allclose(np.diff(t), [1 / 4, 1 / 6, 1 / 8, 1 / 10])
    # Over time when there is no request count.
    timed = Schedule(ramp_start_rate=1.0, ramp_end_rate=3.0, ramp_duration=10.0)
    assert ramp_rate(timed, 0, None, 5.0) == 2.0


def test_rates_and_slo_parsing() -> None:
    assert parse_rates("1,2, 4,inf") == [1.0, 2.0, 4.0, math.inf]
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:2000,ttft:100"]) == {"e2el": 2000.0, "ttft": 100.0}
    assert parse_goodput(["itl_p99:200"]) == {"itl_p99": 200.0}
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    assert percentile_name(99) == "p99" and percentile_name(99.9) == "p99.9"


def test_the_self_check_warns_when_arrivals_fall_short() -> None:
    assert rate_check(100.0, 85.0, 100)
    assert not rate_check(100.0, 95.0, 100)
    assert not rate_check(math.inf, 5.0, 100)


def test_random_lengths_are_in_range_and_seeded() -> None:
    cfg = DatasetConfig(num_prompts=200, input_len=100, output_len=50, range_ratio=0.2, seed=3)
    samples = load(cfg)
    assert all(80 <= s.prompt_len <= 120 and 40 <= s.max_tokens <= 60 for s in samples)
    # One word is about one token: the estimate agrees with the requested length.
    assert all(abs(approx_tokens(s.prompt) - s.prompt_len) <= 1 for s in samples)
    assert [s.prompt for s in load(cfg)] == [s.prompt for s in samples]
    other = load(DatasetConfig(num_prompts=200, input_len=100, seed=4))
    assert other[0].prompt != samples[0].prompt


def test_presets_and_mixed() -> None:
    for name, ((ilo, ihi), (olo, ohi)) in PRESETS.items():
        samples = load(DatasetConfig(name=name, num_prompts=30))
        assert all(ilo <= s.prompt_len <= ihi and olo <= s.max_tokens <= ohi for s in samples)
    mixed = load(DatasetConfig(name="mixed", num_prompts=60))
    assert {s.kind for s in mixed} == set(PRESETS)


def test_shared_prefix_and_random_prefix() -> None:
    samples = load(DatasetConfig(name="prefix", num_prompts=8, prefix_len=50, num_prefixes=2))
    assert len({s.system for s in samples}) == 2
    assert all(s.prompt_len == 50 + approx_tokens(s.prompt) for s in samples)
    rnd = load(DatasetConfig(num_prompts=4, input_len=10, prefix_len=20))
    heads = {" ".join(s.prompt.split()[:20]) for s in rnd}
    assert len(heads) == 1 and all(s.prompt_len == 30 for s in rnd)


def test_sharegpt_and_custom_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    convs = [
        {"conversations": [{"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "hi , how are you"},
                           {"from": "human", "value": "fine"},
                           {"from": "gpt", "value": "good"}]},
        {"conversations": [{"from": "gpt", "value": "no human first"}]},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    samples = load(DatasetConfig(name="sharegpt", path=str(path), num_prompts=10))
    assert len(samples) == 1
    assert (samples[0].prompt, samples[0].prompt_len, samples[0].max_tokens) == (
        "hello there",
        2,
        5,
    )
    multi = load(DatasetConfig(name="sharegpt", path=str(path), num_prompts=10, multi_turn=True))
    assert multi[0].turns == [("fine", 1)]
    custom = tmp_path / "c.jsonl"
    custom.write_text('{"prompt": "a b c", "max_tokens": 7}\n{"prompt": "d", "max_tokens": 2}\n')
    samples = load(DatasetConfig(name="custom", path=str(custom), num_prompts=10))
    assert [(s.prompt, s.max_tokens) for s in samples] == [("a b c", 7), ("d", 2)]


def test_slo_search_finds_the_capacity_of_the_server() -> None:
    """Capacity K = 4 concurrent, service S = 50 + 7 * 20 = 190 ms: with constant arrivals
    nothing queues below K / S = 21 req/s, and above it each request waits longer than the one
    before, so the TTFT limit (50 ms of slack over the server's TTFT) breaks just past 21.

    The test machine is shared; a stall of the whole machine can fail one probe that should
    pass, so the search gets a second chance before the test fails."""
    capacity = 4 / (0.05 + 7 * 0.02)
    with standin(ttft=0.05, itl=0.02, capacity=4) as url:
        cfg = ClientConfig(base_url=url, model="m", disable_tqdm=True, num_warmups=4)
        samples = load(DatasetConfig(num_prompts=24, input_len=10, output_len=8))
        spec = RunSpec(cfg, samples, Schedule(burstiness=math.inf), 24,
                       slos={"ttft": 100.0, "tpot": 30.0})  # fmt: skip
        for _ in range(2):
            result = asyncio.run(search(spec, 0.95, start_rate=16.0, tolerance=0.15, max_probes=8))
            if 0.8 * capacity <= result.max_rate <= 1.15 * capacity:
                break
    probes = [(round(p.rate, 1), round(p.attainment, 2)) for p in result.probes]
    assert 0.8 * capacity <= result.max_rate <= 1.15 * capacity, probes
    assert result.converged, probes
    assert min(p.attainment for p in result.probes) < 0.95, probes  # a probe above failed


def test_loadtest_imports_nothing_from_pdserve() -> None:
    code = (
        "import sys, loadtest, loadtest.cli, loadtest.slo, loadtest.plots, loadtest.report\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'services', 'router', 'pdserve', 'kernels', 'kvtransfer', 'matplotlib'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_tokenizer_file_counts_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    custom = tmp_path / "c.jsonl"
    custom.write_text('{"prompt": "hello world hello, x", "max_tokens": 3}\n')
    cfg = DatasetConfig(name="custom", path=str(custom), tokenizer=str(path))
    assert load(cfg)[0].prompt_len == 5  # hello world hello , x
    in_directory = DatasetConfig(name="custom", path=str(custom), tokenizer=str(tmp_path))
    assert load(in_directory)[0].prompt_len == 5  # a model directory, as vLLM's flag takes


def test_the_itl_p99_slo_bounds_each_requests_own_stalls() -> None:
    timing = {"ok": True, "output_len": 101, "ttft": 0.1, "e2el": 2.1}
    steady = RequestResult(0, itls=[0.02] * 100, **timing)  # type: ignore[arg-type]
    stalled = RequestResult(1, itls=[0.01] * 98 + [0.5] * 2, **timing)  # type: ignore[arg-type]
    assert steady.tpot == pytest.approx(stalled.tpot)  # same mean: TPOT cannot tell them apart
    assert meets(steady, {"itl_p99": 100}) and not meets(stalled, {"itl_p99": 100})
    assert meets(stalled, {"tpot": 100})


@pytest.mark.parametrize(
    "name", ["random", "prefix", "multiturn", "chatbot", "summarization", "codegen", "mixed"]
)
def test_the_recorded_ranges_hold_every_sample_drawn(name: str) -> None:
    """describe() (the saved config's dataset) names ranges that every drawn sample is in, per
    preset for mixed, and records the --random-* settings only where they were read."""
    cfg = DatasetConfig(name=name, num_prompts=60, input_len=40, output_len=12, range_ratio=0.5)
    recorded = describe(cfg)
    for sample in load(cfg):
        ranges = recorded["lengths"][sample.kind]
        (ilo, ihi), (olo, ohi) = ranges["input_tokens"], ranges["output_tokens"]
        assert ilo <= sample.prompt_len <= ihi and olo <= sample.max_tokens <= ohi, sample.kind
    assert ("input_len" in recorded) == (name in ("random", "prefix", "multiturn"))
    if name == "mixed":
        assert set(recorded["lengths"]) == {"chatbot", "summarization", "codegen"}


def test_the_scheduled_rate_note_is_chance_for_random_gaps_only() -> None:
    poisson = Schedule(0.25)
    assert scheduled_rate_note(poisson, 0.25, 30) == ""  # within 1%: nothing to explain
    note = scheduled_rate_note(poisson, 0.19, 30)
    assert note.startswith("30 Poisson arrivals") and "±19% of 0.25" in note
    assert "±9% of 0.25" in scheduled_rate_note(Schedule(0.25, burstiness=4.0), 0.2, 30)
    assert "a ramp from 1 to 4 req/s" in scheduled_rate_note(
        Schedule(ramp_start_rate=1, ramp_end_rate=4), 2.0, 30
    )
    assert scheduled_rate_note(Schedule(math.inf), math.inf, 30) == ""
