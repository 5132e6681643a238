"""The simulated model inside the real engine: deterministic tokens, KV that carries them, and
the profile's step time (docs/simulation.md)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels import cpu_ops
from services.engine.config import EngineConfig, SchedulerConfig
from services.engine.llm_engine import LLMEngine, PullPlan
from services.engine.simulation_profile import SimulationProfile, StepTimeModel
from tests.conftest import PROMPTS, assert_no_leaks

PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
# Steps of a few milliseconds: the tests wait on them, and time them loosely.
FAST = SimulationProfile(
    name="test",
    step=StepTimeModel(
        base_s=0.004,
        prefill_token_s=2e-5,
        prefill_pair_s=0,
        decode_seq_s=1e-4,
        decode_context_s=0,
    ),
    kv_bytes_per_token=131072,
    kv_pool_tokens=8192,
    transfer_latency_s=0.001,
    transfer_bytes_per_s=40e9,
)


def make_engine(budget: int = 2048, profile: SimulationProfile = FAST) -> LLMEngine:
    sched = SchedulerConfig(max_num_batched_tokens=budget)
    return LLMEngine(EngineConfig(num_threads=1, scheduler=sched), simulation=profile)


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until every request finished: each request's tokens."""
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def run(engine: LLMEngine, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt's tokens, all run together."""
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens = drain(engine)
    return [tokens[rid] for rid in ids]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def test_profiles_in_the_repository_parse_with_a_source_for_every_number() -> None:
    files = sorted(PROFILES.glob("sim-*.json"))
    assert len(files) >= 2
    for path in files:
        raw = json.loads(path.read_text())
        profile = SimulationProfile.from_dict(raw)
        numbers = [f"step.{k}" for k in raw["step"]] + [
            "kv_bytes_per_token",
            "kv_pool_tokens",
            "transfer_latency_s",
            "transfer_bytes_per_s",
        ]
        assert sorted(profile.sources) == sorted(numbers), path.name
        assert 0 < profile.step.seconds([], [1024]) < profile.step.seconds([(0, 2048)], [])


def test_tokens_are_deterministic_never_end_and_run_to_max_tokens(engine: LLMEngine) -> None:
    first = run(engine, PROMPTS[:3])
    assert first == run(engine, PROMPTS[:3])  # again (now from the prefix cache)
    assert all(len(t) == GREEDY.max_tokens for t in first)
    assert len({tuple(t) for t in first}) == 3  # different prompts, different tokens
    eos = set(engine.tokenizer.eos_token_ids)
    assert not eos & {t for ts in first for t in ts}
    assert_no_leaks(engine)


def test_tokens_do_not_depend_on_chunking_or_batching(engine: LLMEngine) -> None:
    long_prompt = " ".join(PROMPTS) * 3
    alone = [run(engine, [p])[0] for p in [long_prompt, PROMPTS[0]]]
    chunked = make_engine(budget=64)  # the long prompt in many chunks, beside the short one
    assert run(chunked, [long_prompt, PROMPTS[0]]) == alone
    assert_no_leaks(chunked)


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
def test_pulled_kv_carries_the_tokens(corrupt: bool) -> None:
    """Prefill on one engine, pull its (tiny) blocks into another: the decode side continues
    with the tokens one engine gives; blocks that arrive wrong give other tokens."""
    p_engine, d_engine = make_engine(), make_engine()
    ids = p_engine.tokenizer.encode(PROMPTS[1] * 4)
    want = run(make_engine(), [ids])[0]
    p_engine.add_request("h", ids, dataclasses.replace(GREEDY, max_tokens=1), pin_blocks=True)
    outs = [o for _ in range(50) for o in p_engine.step()]
    first, block_ids = outs[-1].outputs[0].token_ids[0], outs[-1].kv_block_ids
    assert first == want[0] and block_ids
    assert d_engine.add_prefilled_request("h", ids, first, GREEDY) is None
    plans: list[PullPlan] = []
    while not plans:
        d_engine.step()
        plans = d_engine.take_pull_plans()
    source = torch.tensor([block_ids[i] for i in plans[0].block_indices])
    blocks = p_engine.kv_cache[source].clone()
    if corrupt:  # one lane of the last computed position's state
        last = (len(ids) - 1) % p_engine.pool.block_size
        blocks[-1, 0, 0, 0, last, 2] = (blocks[-1, 0, 0, 0, last, 2] + 1) % 256
    d_engine.commit_pull(plans[0], blocks)
    assert p_engine.release_pinned("h")
    rest = drain(d_engine)["h"]
    assert ([first, *rest] == want) is not corrupt
    assert_no_leaks(p_engine)
    assert_no_leaks(d_engine)


def test_step_time_follows_the_profile() -> None:
    slow = dataclasses.replace(
        FAST, step=dataclasses.replace(FAST.step, base_s=0.05, prefill_token_s=1e-4)
    )
    engine = make_engine(profile=slow)
    start = time.perf_counter()
    run(engine, [PROMPTS[0]], dataclasses.replace(GREEDY, max_tokens=4))
    wall = time.perf_counter() - start
    model = engine.model
    assert model.num_steps == 4  # the prefill (with token 1), then three decodes
    num_prompt = len(engine.tokenizer.encode(PROMPTS[0]))
    expected = 4 * 0.05 + num_prompt * 1e-4 + 3 * FAST.step.decode_seq_s
    assert model.busy_seconds == pytest.approx(expected)
    assert expected <= wall < expected + 2.0  # it slept at least that; a shared machine adds


def test_the_simulated_model_samples_with_the_compiled_kernels(engine: LLMEngine) -> None:
    """Its logits are sampled on the host like any device's: with the compiled race where a C
    compiler builds it (the PyTorch reference is many times slower at a decode batch), and a
    seeded draw there gives the simulated model's own next token (its logits are one-hot)."""
    if cpu_ops.find_compiler() is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH to build the kernels")
    assert isinstance(getattr(engine.sampler.race, "__self__", None), cpu_ops.CpuKernels)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    assert run(engine, PROMPTS[:2], seeded) == run(engine, PROMPTS[:2])
