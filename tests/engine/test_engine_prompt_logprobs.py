"""Prompt logprobs in the engine: computed in slices and chunks alike, once per request (n > 1
forks share them), handed out in the first output only, and a request that asks for them
takes no prefix-cache hit it has no logits for (transformers parity: the gateway tests)."""

from __future__ import annotations

import pytest

import services.engine.prompt_logprobs as prompt_logprobs
from pdserve import SamplingParams

PROMPT = "Paged attention stores the KV cache in fixed-size blocks so that memory is not wasted"


def scored(llm, **kwargs):  # type: ignore[no-untyped-def]
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=3, **kwargs))
    return out


def test_slices_give_the_same_logprobs(engine_llm, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    whole = scored(engine_llm)
    monkeypatch.setattr(prompt_logprobs, "SLICE", 5)
    sliced = scored(engine_llm)
    assert whole.prompt_logprobs is not None and sliced.prompt_logprobs is not None
    assert len(whole.prompt_logprobs) == len(whole.prompt_token_ids)
    assert whole.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], sliced.prompt_logprobs[1:]):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert max(abs(a[t] - b[t]) for t in a) < 1e-5
    # Each entry: the prompt's token first, then the 3 most likely (4 entries at most).
    tokens = whole.prompt_token_ids
    for i, entry in enumerate(whole.prompt_logprobs[1:], start=1):
        assert entry is not None and next(iter(entry)) == tokens[i] and 3 <= len(entry) <= 4


def test_each_prompt_token_is_ranked_in_the_whole_vocabulary(
    engine_llm, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Beside each entry its token's rank (vLLM's count: tokens at least as likely): its place
    among the top 3 when it is there, past them when it is not; slices rank alike."""
    whole = scored(engine_llm)
    ranks = whole.prompt_logprob_ranks
    assert ranks is not None and len(ranks) == len(whole.prompt_token_ids) and ranks[0] is None
    outside = 0
    for token, entry, rank in zip(whole.prompt_token_ids[1:], whole.prompt_logprobs[1:], ranks[1:]):
        top = sorted(entry.values(), reverse=True)[:3]
        if entry[token] in top:
            assert rank == top.index(entry[token]) + 1
        else:
            outside += 1
            assert rank > 3
    assert outside > 0
    monkeypatch.setattr(prompt_logprobs, "SLICE", 5)
    assert scored(engine_llm).prompt_logprob_ranks == ranks


def test_n_sequences_share_one_computation(engine_llm) -> None:  # type: ignore[no-untyped-def]
    one = scored(engine_llm)
    several = scored(engine_llm, n=3, temperature=1.0, seed=1)
    assert len(several.outputs) == 3
    assert several.prompt_logprobs is not None and one.prompt_logprobs is not None
    assert [e and list(e) for e in several.prompt_logprobs] == [
        e and list(e) for e in one.prompt_logprobs
    ]


def test_no_prefix_cache_hit_without_logits(engine_llm) -> None:  # type: ignore[no-untyped-def]
    plain = engine_llm.generate(PROMPT, SamplingParams(max_tokens=1))
    again = engine_llm.generate(PROMPT, SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0  # the prompt is cached
    scored_out = scored(engine_llm)
    assert scored_out.num_cached_tokens == 0  # computed again: cached blocks have no logits
    assert plain[0].prompt_logprobs is None  # not asked: none computed


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_keep_their_prompt_logprobs(engine_llm, preemption_mode: str) -> None:  # type: ignore[no-untyped-def]
    """A tiny pool preempts: a recomputed prompt is not scored twice, a swapped one keeps its
    scores; both equal the roomy engine's."""
    from pdserve import LLM
    from tests.conftest import PROMPTS, assert_no_leaks

    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1)
    expected = engine_llm.generate(PROMPTS, params)
    swap = {"num_swap_blocks": 64} if preemption_mode == "swap" else {}
    tiny = LLM(num_threads=2, num_blocks=14, preemption_mode=preemption_mode, **swap)
    outs = tiny.generate(PROMPTS, params)
    assert tiny.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, expected):
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(out.prompt_token_ids)
        for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    assert_no_leaks(tiny.engine)
