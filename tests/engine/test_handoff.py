"""Prefill/decode handoff inside one process: a prefill-only engine pins the prompt's blocks, a
decode engine reserves blocks, takes the copied KV and continues; tokens equal a single engine's.
(The services tests do the same across processes, over the real transports.)"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_no_leaks

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def pair():
    prefill = LLM(num_blocks=128, num_threads=2)
    decode = LLM(num_blocks=128, num_threads=2)
    yield prefill.engine, decode.engine
    assert_no_leaks(prefill.engine)
    assert_no_leaks(decode.engine)


def run_until_done(engine, request_id):  # type: ignore[no-untyped-def]
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def prefill(engine, request_id, prompt, params):  # type: ignore[no-untyped-def]
    engine.add_request(request_id, prompt, params, pin_blocks=True)
    out = run_until_done(engine, request_id)
    assert out.kv_block_ids is not None and out.outputs[0].finish_reason is None
    return out


def handoff(p_engine, d_engine, request_id, prompt, params, pull=True):  # type: ignore[no-untyped-def]
    ids = p_engine.tokenizer.encode(prompt)
    p_out = prefill(p_engine, request_id, ids, SamplingParams(**{**vars(params), "n": 1}))
    first = p_out.outputs[0].token_ids[0]
    assert d_engine.add_prefilled_request(request_id, ids, first, params) is None
    plan = d_engine.reserve_pull(request_id)
    assert plan is not None
    assert d_engine.num_pulling_requests == 1  # counted as waiting until it joins the batch
    if pull:
        source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
        d_engine.commit_pull(plan, p_engine.runner.kv_cache[source].clone())
    else:
        d_engine.recompute_pull(request_id)
    assert d_engine.num_pulling_requests == 0
    assert p_engine.release_pinned(request_id)
    assert not p_engine.release_pinned(request_id)
    return first, run_until_done(d_engine, request_id), plan


@pytest.mark.parametrize("pull", [True, False], ids=["pulled", "recomputed"])
def test_handoff_matches_one_engine(llm, pair, pull):
    p_engine, d_engine = pair
    expected = llm.generate(PROMPTS[:4], GREEDY)
    for i, (prompt, want) in enumerate(zip(PROMPTS[:4], expected)):
        first, out, _ = handoff(p_engine, d_engine, f"h{pull}{i}", prompt, GREEDY, pull)
        assert [first, *out.outputs[0].token_ids[1:]] == want.outputs[0].token_ids
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].text == want.outputs[0].text


def test_decode_pulls_only_blocks_it_lacks(pair):
    p_engine, d_engine = pair
    system = "You are a helpful assistant who answers briefly and precisely. " * 5
    _, _, cold = handoff(p_engine, d_engine, "pa", system + "Here is a list of fruits:", GREEDY)
    _, _, warm = handoff(p_engine, d_engine, "pb", system + "Here is a list of trees:", GREEDY)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens > 0
    assert len(warm.block_indices) < len(cold.block_indices)
    assert warm.block_indices[0] * d_engine.pool.block_size == warm.num_cached_tokens


def test_handoff_with_n_greedy(llm, pair):
    p_engine, d_engine = pair
    params = SamplingParams(n=3, temperature=0, max_tokens=12)
    [want] = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))
    _, out, _ = handoff(p_engine, d_engine, "n3", PROMPTS[1], params)
    assert [o.token_ids for o in out.outputs] == [want.outputs[0].token_ids] * 3


def test_first_token_that_ends_the_request_needs_no_pull(pair):
    _, d_engine = pair
    ids = d_engine.tokenizer.encode(PROMPTS[0])
    out = d_engine.add_prefilled_request("one", ids, 42, SamplingParams(max_tokens=1))
    assert out is not None and out.finished and out.outputs[0].finish_reason == "length"
    assert not d_engine.has_unfinished_requests()


def test_abort_while_pulling_frees_the_reservation(pair):
    _, d_engine = pair
    ids = d_engine.tokenizer.encode(PROMPTS[7])
    d_engine.add_prefilled_request("ab", ids, 42, SamplingParams(max_tokens=5))
    assert d_engine.reserve_pull("ab") is not None
    assert d_engine.pool.num_used_blocks > 0
    d_engine.abort_request("ab")
    assert d_engine.pool.num_used_blocks == 0


def test_prefill_only_requests_must_have_n_1(pair):
    p_engine, _ = pair
    with pytest.raises(ValueError, match="n must be 1"):
        p_engine.add_request("x", "hi", SamplingParams(n=2), pin_blocks=True)


@pytest.mark.parametrize("first_token", [-1, 49152, 2**31 - 1])
def test_a_first_token_outside_the_vocabulary_is_refused_up_front(pair, first_token):
    """It arrives off the wire; admitted, it would fail the whole batch's next step."""
    _, d = pair
    ids = d.tokenizer.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="first_token must be an integer in"):
        d.add_prefilled_request("bad-first", ids, first_token, GREEDY)
    assert not d.scheduler.has_unfinished


def test_abort_after_the_final_prefill_step_frees_the_pinned_blocks(pair):
    """A caller that goes away just as its prefill finished never gets a lease: the abort that
    follows must free the blocks that step pinned (found by the chaos soak)."""
    p_engine, _ = pair
    prefill(p_engine, "late-abort", PROMPTS[0], GREEDY)
    assert p_engine.num_pinned_requests == 1 and p_engine.pool.num_used_blocks > 0
    assert p_engine.abort_request("late-abort") is None
    assert p_engine.num_pinned_requests == 0 and p_engine.pool.num_used_blocks == 0
