"""The engine end to end on the real default model: scheduling variants give identical outputs,
sampling options behave, bad input gets a clear error, and no KV block leaks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import PROMPTS, assert_no_leaks

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of the shared engine, batched: what every variant must reproduce."""
    outs = llm.generate(PROMPTS, GREEDY)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def token_ids(outputs):  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"num_blocks": 14}, id="recompute-preemption"),
        pytest.param(
            {"num_blocks": 14, "preemption_mode": "swap", "num_swap_blocks": 64}, id="swap"
        ),
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill"),
        pytest.param({"enable_chunked_prefill": False}, id="no-chunked-prefill"),
        pytest.param({"max_num_seqs": 3, "enable_prefix_caching": False}, id="few-seqs-no-cache"),
    ],
)
def test_scheduling_variants_give_identical_outputs(options, reference):
    options.setdefault("num_blocks", 256)
    llm = LLM(num_threads=2, **options)
    outs = llm.generate(PROMPTS, GREEDY)
    assert token_ids(outs) == reference
    sched = llm.engine.scheduler
    if options["num_blocks"] == 14:
        assert sched.num_preemptions > 0, "the tiny pool was meant to force preemption"
    if options.get("preemption_mode") == "swap":
        assert sched.num_swapped_out > 0
    assert_no_leaks(llm.engine)


def test_prefix_cache_hits_are_counted_and_do_not_change_outputs(engine_llm):
    pool = engine_llm.engine.pool
    system = "You are a careful assistant. Answer in one short sentence. " * 4
    first, second = system + "What is a cat?", system + "What is a dog?"
    pool.reset_prefix_cache()
    [cold] = engine_llm.generate(second, GREEDY)
    assert cold.num_cached_tokens == 0
    pool.reset_prefix_cache()
    engine_llm.generate(first, GREEDY)
    hits_before = pool.num_prefix_hit_tokens
    [warm] = engine_llm.generate(second, GREEDY)
    shared_blocks = len(engine_llm.get_tokenizer().encode(system)) // pool.block_size
    assert warm.num_cached_tokens >= (shared_blocks - 1) * pool.block_size > 0
    assert pool.num_prefix_hit_tokens - hits_before == warm.num_cached_tokens
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_n_greedy_sequences_share_the_prompt_and_agree(engine_llm, reference):
    [out] = engine_llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=24))
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == reference[0] for o in out.outputs)


def test_seeded_sampling_is_reproducible_and_n_outputs_differ(engine_llm):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    [a] = engine_llm.generate(PROMPTS[2], params)
    # Same seed, now batched with other requests: the same tokens.
    outs = engine_llm.generate([PROMPTS[2], PROMPTS[3]], [params, SamplingParams(temperature=1)])
    assert [o.token_ids for o in outs[0].outputs] == [o.token_ids for o in a.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_each_sequence_finishes_once_in_the_deltas(engine_llm):
    """n > 1, the sequences ending at different steps: each one's finish reason (and stop
    reason) is in exactly one delta, the one where it ends. (A sequence that had ended was
    finished again in each later delta of its siblings: a stream said "stop" twice.)"""
    engine = engine_llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, stop=["e"])
    engine.add_request("finish-once", engine.tokenizer.encode(PROMPTS[0]), params)
    finishes: dict[int, list[tuple[int, str | None]]] = {0: [], 1: [], 2: []}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            for o in out.outputs:
                if o.finish_reason is not None:
                    finishes[o.index].append((step, o.finish_reason))
                else:
                    assert o.stop_reason is None
    assert all(len(f) == 1 for f in finishes.values()), finishes
    assert len({f[0][0] for f in finishes.values()}) > 1, "the sequences ended in one step"
    assert_no_leaks(engine)


def test_stop_string_truncates_text(engine_llm, reference):
    tokenizer = engine_llm.get_tokenizer()
    full = tokenizer.decode(reference[0])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "pick a stop string with visible characters"
    [out] = engine_llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full[: full.index(stop)]


def test_stop_token_id_ends_generation(engine_llm, reference):
    stop_id = reference[1][5]
    first = reference[1].index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    [out] = engine_llm.generate(PROMPTS[1], params)
    assert out.outputs[0].token_ids == reference[1][: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_the_token_that_stops_a_sequence_is_text_only_when_asked(
    engine_llm, reference, skip_special_tokens, include_stop_str_in_output
):
    """vLLM's rule (its detokenizer's ``stop_terminated``): the EOS or stop token id that ends a
    sequence stays in its token ids but not in its text, unless include_stop_str_in_output.
    Checked with a stop id that is a plain word and with EOS forced by logit_bias, which only
    shows as text (``<|im_end|>``) when special tokens are not skipped."""
    tokenizer = engine_llm.get_tokenizer()
    [eos] = tokenizer.eos_token_ids
    stop_id = reference[1][5]
    first = reference[1].index(stop_id)
    options = dict(
        temperature=0,
        max_tokens=24,
        skip_special_tokens=skip_special_tokens,
        include_stop_str_in_output=include_stop_str_in_output,
    )
    by_id, by_eos = engine_llm.generate(
        [PROMPTS[1], PROMPTS[2]],
        [
            SamplingParams(stop_token_ids=[stop_id], **options),
            SamplingParams(min_tokens=3, logit_bias={eos: 100.0}, **options),
        ],
    )
    shown = first + 1 if include_stop_str_in_output else first
    assert by_id.outputs[0].token_ids == reference[1][: first + 1]
    assert by_id.outputs[0].text == tokenizer.decode(reference[1][:shown], skip_special_tokens)
    eos_out = by_eos.outputs[0]
    assert eos_out.token_ids[-1] == eos and len(eos_out.token_ids) == 4
    assert (eos_out.finish_reason, eos_out.stop_reason) == ("stop", None)
    shown_ids = eos_out.token_ids if include_stop_str_in_output else eos_out.token_ids[:-1]
    assert eos_out.text == tokenizer.decode(shown_ids, skip_special_tokens)
    assert eos_out.text.endswith("<|im_end|>") == (
        include_stop_str_in_output and not skip_special_tokens
    )


def test_max_tokens_and_ignore_eos(engine_llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [out] = engine_llm.generate(PROMPTS[6], params)
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_logprobs_are_raw_log_softmax_with_alternatives(engine_llm, reference):
    [out] = engine_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    o = out.outputs[0]
    assert len(o.logprobs) == 5
    for token, entry in zip(o.token_ids, o.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token] == max(entry.values()) <= 0.0
        assert sum(torch.tensor(list(entry.values())).exp()) <= 1.0 + 1e-5


def test_token_id_prompts_and_per_prompt_params(engine_llm, reference):
    ids = engine_llm.get_tokenizer().encode(PROMPTS[0])
    outs = engine_llm.generate(
        [ids, PROMPTS[1]], [GREEDY, SamplingParams(temperature=0, max_tokens=3)]
    )
    assert outs[0].outputs[0].token_ids == reference[0]
    assert outs[1].outputs[0].token_ids == reference[1][:3]


def test_abort_mid_decode_frees_blocks_at_once(engine_llm):
    engine = engine_llm.engine
    engine.add_request("abort-me", PROMPTS[7], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used_blocks > 0
    out = engine.abort_request("abort-me")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.pool.num_used_blocks == 0


BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_rejected_and_nothing_is_left_behind(engine_llm):
    engine = engine_llm.engine
    too_long = [1] * engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        engine_llm.generate([PROMPTS[0], too_long], GREEDY)
    assert not engine.has_unfinished_requests()


def test_empty_and_out_of_vocab_prompts_are_rejected(engine_llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine_llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine_llm.generate([[10**9]], GREEDY)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    from services.engine.model.source import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))


def test_corrupt_weights_are_a_clear_error(llm, tmp_path):
    from services.engine.model.source import ModelLoadError

    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((llm.engine.model_dir / name).read_bytes())
    (model_dir / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(model=str(model_dir), num_blocks=8)
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        LLM(model=str(bad_gguf), num_blocks=8, cache_dir=str(tmp_path / "cache"))


def test_bfloat16_is_selectable():
    llm = LLM(dtype="bfloat16", num_blocks=64, num_threads=2)
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    [out] = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    assert "Paris" in out.outputs[0].text
    assert_no_leaks(llm.engine)


def test_engine_sizes_its_thread_pool(llm):
    assert torch.get_num_threads() == llm.engine.config.num_threads == 2


def test_a_dropped_llm_is_freed_at_once_without_the_cyclic_collector() -> None:
    """No reference cycle holds an engine: dropping the last reference to an ``LLM`` frees its
    engine, KV pool and weights at once. (The hand-off held the engine's bound method: a cycle,
    freed only when the cyclic collector ran, which big tensors do not make it do; a dropped
    engine's 1.1 GB stayed.)"""
    gc.disable()
    try:
        llm = LLM(num_blocks=16)
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_min_tokens_holds_off_stop_strings_as_vllm(engine_llm, reference):
    """vLLM's rule: a stop string ends a sequence only when it ends in a token after the first
    ``min_tokens`` (as EOS can only be token ``min_tokens`` + 1); it may start in them."""
    tokenizer = engine_llm.get_tokenizer()
    ids = reference[1]
    texts = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]  # text after token i + 1
    # token k (1-based) is the first whose text is new, at least 2 characters and found nowhere
    # before it, so that a stop string made of it can only match there
    k = next(
        i + 1
        for i in range(2, len(ids))
        if len(texts[i]) - len(texts[i - 1]) >= 2
        and texts[i][len(texts[i - 1]) :] not in texts[i - 1]
    )
    word = texts[k - 1][len(texts[k - 2]) :]
    straddle = texts[k - 2][-1] + word[0]  # the last character of token k - 1, the first of k

    def run(min_tokens: int, stop: str, max_tokens: int = k):  # type: ignore[no-untyped-def]
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, min_tokens=min_tokens, stop=[stop]
        )
        return engine_llm.generate(PROMPTS[1], params)[0].outputs[0]

    held_off = run(min_tokens=k, stop=word)  # it ends in token k, one of the first k
    assert (held_off.finish_reason, held_off.text, held_off.token_ids) == (
        "length",
        texts[k - 1],
        ids[:k],
    )
    ended = run(min_tokens=k - 1, stop=word)  # token k is the first that may end it
    assert (ended.finish_reason, ended.stop_reason, ended.text) == ("stop", word, texts[k - 2])
    across = run(min_tokens=k - 1, stop=straddle)  # begins in token k - 1: matched, and cut
    assert (across.finish_reason, across.text) == ("stop", texts[k - 2][:-1])
