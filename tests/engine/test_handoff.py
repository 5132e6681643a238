"""Prefill/decode handoff inside one process: a prefill-only engine pins the prompt's blocks, a
decode engine reserves blocks, takes the copied KV and continues; tokens equal a single engine's.
(The services tests do the same across processes, over the real transports.)"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from services.engine.sequence import SequenceStatus
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
    """The request's merged output once it finishes (steps return deltas)."""
    merged = None
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if merged is None:
                merged = out
            else:
                merged.merge(out)
            if out.finished:
                return merged


def admit(engine, request_id):  # type: ignore[no-untyped-def]
    """Step until the scheduler admits ``request_id`` for its pull; its plan."""
    for _ in range(100):
        engine.step()
        plans = {p.request_id: p for p in engine.take_pull_plans()}
        if request_id in plans:
            return plans[request_id]
    raise AssertionError(f"{request_id} was never admitted")


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
    assert d_engine.stats().num_pulling == 1 and d_engine.stats().num_waiting == 1
    plan = admit(d_engine, request_id)
    assert d_engine.stats().num_pulling == 1  # counted as waiting until it joins the batch
    assert d_engine.stats().num_waiting == 1 and d_engine.stats().num_running == 0
    if pull:
        source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
        d_engine.commit_pull(plan, p_engine.runner.kv_cache[source].clone())
    else:
        d_engine.recompute_pull(request_id)
    assert d_engine.stats().num_pulling == 0
    assert p_engine.release_pinned(request_id)
    assert not p_engine.release_pinned(request_id)
    return first, run_until_done(d_engine, request_id), plan


@pytest.mark.parametrize("pull", [True, False], ids=["pulled", "recomputed"])
def test_handoff_matches_one_engine(llm, pair, pull):
    p_engine, d_engine = pair
    expected = llm.generate(PROMPTS[:4], GREEDY)
    for i, (prompt, want) in enumerate(zip(PROMPTS[:4], expected)):
        first, out, _ = handoff(p_engine, d_engine, f"h{pull}{i}", prompt, GREEDY, pull)
        # The decode side streams what comes after the prefill worker's first token.
        assert [first, *out.outputs[0].token_ids] == want.outputs[0].token_ids
        first_text = p_engine.tokenizer.decode([first])
        assert first_text + out.outputs[0].text == want.outputs[0].text


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
    first, out, _ = handoff(p_engine, d_engine, "n3", PROMPTS[1], params)
    # Sequence 0's first token was streamed by the prefill worker; the others draw their own.
    tokens = [[first, *out.outputs[0].token_ids]] + [o.token_ids for o in out.outputs[1:]]
    assert tokens == [want.outputs[0].token_ids] * 3


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
    admit(d_engine, "ab")
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
    assert p_engine.stats().num_pinned == 1 and p_engine.pool.num_used_blocks > 0
    assert p_engine.abort_request("late-abort") is None
    assert p_engine.stats().num_pinned == 0 and p_engine.pool.num_used_blocks == 0


def test_pulled_requests_respect_max_num_seqs():
    """Admission for a pull is the scheduler's one rule: no more than max_num_seqs sequences
    are running or pulling at once, whatever arrives."""
    engine = LLM(num_blocks=128, num_threads=2, max_num_seqs=2).engine
    ids = engine.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=4)
    for i in range(5):
        assert engine.add_prefilled_request(f"m{i}", ids, 42, params) is None
    engine.step()
    plans = engine.take_pull_plans()
    assert [p.request_id for p in plans] == ["m0", "m1"]
    assert engine.stats().num_pulling == 5 and engine.scheduler.num_admitted == 2
    for plan in plans:
        engine.recompute_pull(plan.request_id)  # back in the queue: room for the next two
    for i in range(2, 5):
        engine.recompute_pull(f"m{i}")
    done = 0
    while engine.has_unfinished_requests():
        assert engine.scheduler.num_admitted <= 2
        done += sum(out.finished for out in engine.step())
    assert done == 5
    assert_no_leaks(engine)


def test_a_duplicate_request_id_is_refused_and_harms_nothing(pair):
    p_engine, d_engine = pair
    out = prefill(p_engine, "dup", PROMPTS[2], GREEDY)
    blocks = p_engine.pool.num_used_blocks
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        p_engine.add_request("dup", PROMPTS[3], GREEDY, pin_blocks=True)
    assert p_engine.stats().num_pinned == 1 and p_engine.pool.num_used_blocks == blocks
    ids = d_engine.tokenizer.encode(PROMPTS[2])
    first = out.outputs[0].token_ids[0]
    assert d_engine.add_prefilled_request("dup", ids, first, GREEDY) is None
    with pytest.raises(ValueError, match="already in use"):
        d_engine.add_prefilled_request("dup", ids, first, GREEDY)
    plan = admit(d_engine, "dup")
    source = torch.tensor([out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
    d_engine.commit_pull(plan, p_engine.runner.kv_cache[source].clone())
    assert p_engine.release_pinned("dup")
    assert run_until_done(d_engine, "dup").outputs[0].finish_reason == "length"


def test_a_stop_string_starting_in_the_first_token_is_held_back_as_colocated(llm, pair):
    """The prefill worker shows the first token's text minus what could start a stop string;
    the decode worker shows the rest once it is clear (same text as one engine)."""
    p_engine, d_engine = pair
    [whole] = llm.generate(PROMPTS[0], GREEDY)
    text = whole.outputs[0].text  # " Paris. ..." for this prompt
    stop = text[: len(text.split()[0]) + 2]  # starts in the first token's text, ends later
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    [colocated] = llm.generate(PROMPTS[0], params)
    ids = p_engine.tokenizer.encode(PROMPTS[0])
    p_out = prefill(p_engine, "held", ids, params)
    shown_by_prefill = p_out.outputs[0].text
    assert len(shown_by_prefill) < len(p_engine.tokenizer.decode(p_out.outputs[0].token_ids))
    first = p_out.outputs[0].token_ids[0]
    d_engine.add_prefilled_request("held", ids, first, params)
    plan = admit(d_engine, "held")
    source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
    d_engine.commit_pull(plan, p_engine.runner.kv_cache[source].clone())
    assert p_engine.release_pinned("held")
    d_out = run_until_done(d_engine, "held")
    assert shown_by_prefill + d_out.outputs[0].text == colocated.outputs[0].text
    assert d_out.outputs[0].finish_reason == colocated.outputs[0].finish_reason == "stop"


def test_the_sequence_status_is_the_handoff_state(pair):
    """Pinned, queued for a pull, pulling, running: each is the sequence's status (with
    ``kv_from_remote`` while queued), and the counts in the stats follow from it."""
    p_engine, d_engine = pair
    ids = p_engine.tokenizer.encode(PROMPTS[4])
    p_out = prefill(p_engine, "st", ids, GREEDY)
    assert p_engine.handoff.pinned["st"].status == SequenceStatus.PINNED
    first = p_out.outputs[0].token_ids[0]
    assert d_engine.add_prefilled_request("st", ids, first, GREEDY) is None
    [seq] = d_engine.sequences("st")
    assert seq.status == SequenceStatus.WAITING and seq.kv_from_remote
    assert d_engine.stats().num_pulling == 1
    plan = admit(d_engine, "st")
    assert seq.status == SequenceStatus.PULLING and d_engine.stats().num_pulling == 1
    source = torch.tensor([p_out.kv_block_ids[i] for i in plan.block_indices], dtype=torch.long)
    d_engine.commit_pull(plan, p_engine.kv_cache[source].clone())
    assert seq.status == SequenceStatus.RUNNING and not seq.kv_from_remote
    assert d_engine.stats().num_pulling == 0
    pinned = p_engine.handoff.pinned["st"]
    assert p_engine.release_pinned("st") and pinned.status == SequenceStatus.FINISHED
    run_until_done(d_engine, "st")


def test_commit_or_recompute_of_a_request_not_pulling_is_a_key_error(pair):
    """As before the pull states lived in the sequences: a second recompute, a commit after a
    recompute, or either for an unknown request, raises KeyError and changes nothing."""
    _, d_engine = pair
    ids = d_engine.tokenizer.encode(PROMPTS[5])
    d_engine.add_prefilled_request("kx", ids, 42, SamplingParams(max_tokens=3))
    plan = admit(d_engine, "kx")
    d_engine.recompute_pull("kx")
    with pytest.raises(KeyError):
        d_engine.recompute_pull("kx")
    with pytest.raises(KeyError):
        d_engine.commit_pull(plan, torch.zeros(0))
    with pytest.raises(KeyError):
        d_engine.recompute_pull("unknown")
    assert run_until_done(d_engine, "kx").finished


def test_read_only_accessors_show_the_parts(pair):
    """What the services read goes through these, not through the engine's parts."""
    p_engine, _ = pair
    assert p_engine.model_config is p_engine.model.config
    assert p_engine.kv_cache is p_engine.runner.kv_cache
    assert p_engine.num_blocks == p_engine.pool.num_blocks == p_engine.kv_cache.shape[0]
    assert p_engine.cached_block_hashes() == p_engine.pool.cached_block_hashes
    assert not p_engine.has_work() and p_engine.num_running == 0
    p_engine.add_request("acc", PROMPTS[0], SamplingParams(max_tokens=2))
    assert p_engine.has_work()
    p_engine.step()
    assert p_engine.running_request_ids() == {"acc"} and p_engine.num_running == 1
    run_until_done(p_engine, "acc")
    assert not p_engine.has_work() and not p_engine.running_request_ids()
