"""The gateway as users see it: the official ``openai`` client over real HTTP, a real router
process, real prefill and decode workers over real gRPC and a real KV transport, real Redis.

Texts are compared with the offline engine on the same model (greedy), so a token lost, doubled
or reordered anywhere between prefill, transfer, decode and SSE fails a test.
"""

from __future__ import annotations

import random
import time
from importlib.metadata import version as package_version
from typing import Any

import httpx
import pytest

from pdserve import SamplingParams
from tests.router.cluster import MODEL, blocks_in_use, cluster, own_routers, wait_until

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def disagg(pd_pair):  # type: ignore[no-untyped-def]
    with own_routers(pd_pair) as c:
        router = c.add_router()
        router.wait_ready(num_workers=2)
        yield c, router


@pytest.fixture(scope="module")
def client(disagg):  # type: ignore[no-untyped-def]
    return disagg[1].client()


def offline(llm, prompts, **kwargs):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, **kwargs)
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def chat_prompt(llm) -> str:  # type: ignore[no-untyped-def]
    return llm.get_tokenizer().apply_chat_template(CHAT)


def test_completions_match_the_offline_engine(client, llm):  # type: ignore[no-untyped-def]
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    expected = offline(llm, PROMPTS, max_tokens=12)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in response.choices] == ["length", "length"]
    tokenizer = llm.get_tokenizer()
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    assert response.object == "text_completion" and response.model == MODEL
    assert response.id.startswith("cmpl-")


def test_streamed_completion_is_the_same_text(client, llm):  # type: ignore[no-untyped-def]
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                assert finishes[choice.index] is None, "finish_reason sent twice"
                finishes[choice.index] = choice.finish_reason
    assert texts == [e.text for e in offline(llm, PROMPTS, max_tokens=12)]
    assert finishes == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 24


def test_continuous_usage_stats_count_the_tokens_so_far(client):  # type: ignore[no-untyped-def]
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far,
    its completion tokens growing to the final count."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [(chunk.usage.prompt_tokens, chunk.usage.completion_tokens) for chunk in stream]
    assert len({prompt for prompt, _ in counts}) == 1  # the prompt is counted in each
    completions = [c for _, c in counts]
    assert completions == sorted(completions) and completions[-1] == 6 and completions[0] < 6


def test_chat_completion(client, llm):  # type: ignore[no-untyped-def]
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0
    )
    (expected,) = offline(llm, [chat_prompt(llm)], max_tokens=20)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == expected.finish_reason
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode(chat_prompt(llm), add_special_tokens=False)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_streamed_chat_completion(client, llm):  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    # As OpenAI streams: the role alone, content deltas, an empty delta with the finish reason.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    (last,) = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].delta.content is None and last.choices[0].delta.role is None
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (expected,) = offline(llm, [chat_prompt(llm)], max_tokens=20)
    assert text == expected.text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [expected.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_stop_string_ends_the_text_before_it(client, llm):  # type: ignore[no-untyped-def]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=["."]
    )
    (expected,) = offline(llm, PROMPTS[:1], max_tokens=30, stop=["."])
    assert response.choices[0].text == expected.text
    assert "." not in response.choices[0].text
    assert response.choices[0].finish_reason == "stop"


def test_n_choices_with_a_seed_are_reproducible(client):  # type: ignore[no-untyped-def]
    def ask() -> list[str]:
        response = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=3, seed=11
        )
        assert sorted(c.index for c in response.choices) == [0, 1, 2]
        assert 3 <= response.usage.completion_tokens <= 30
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1, "three samples at temperature 1 were identical"


def test_logprobs(client):  # type: ignore[no-untyped-def]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3
    )
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == response.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert top[token] == pytest.approx(logprob)  # greedy: the sampled token is the top one
        assert max(top.values()) == pytest.approx(logprob)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content)


def test_logprob_bytes_join_to_the_answer_inside_characters(client):  # type: ignore[no-untyped-def]
    """A choice of characters that tokens split (an emoji of four bytes, CJK of three), through
    prefill, hand-off and decode: the answer is the choice, and the tokens' logprob ``bytes``,
    joined, are its UTF-8 (a token inside a character reads U+FFFD; its bytes are its own)."""
    choice = "日本語と🤖"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"structured_outputs": {"choice": [choice]}},
    )
    assert chat.choices[0].message.content == choice
    content = chat.choices[0].logprobs.content
    assert "\ufffd" in [e.token for e in content]  # the case this test is about did occur
    assert b"".join(bytes(e.bytes) for e in content) == f"{choice}<|im_end|>".encode()


def test_include_stop_str_in_output_keeps_the_stop_string(client, llm):  # type: ignore[no-untyped-def]
    """vLLM's include_stop_str_in_output, streamed and not, through the hand-off: the text ends
    with the stop string, where without it the text ends before it; both the offline engine's."""
    (free,) = offline(llm, PROMPTS[:1], max_tokens=12)
    stop = free.text[4:7]  # a stop string the greedy answer runs into
    cut = free.text[: free.text.index(stop)]
    (kept,) = offline(llm, PROMPTS[:1], max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == cut + stop
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"include_stop_str_in_output": True},
        )
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut + stop
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_continue_final_message_goes_on_with_the_assistants_text(client, llm):  # type: ignore[no-untyped-def]
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (no end of
    turn, no new turn), so the answer goes on with it; the offline engine's on that prompt."""
    messages = [*CHAT, {"role": "assistant", "content": "The capital of France"}]
    text = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nThe capital of France")
    (expected,) = offline(llm, [text], max_tokens=8)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.prompt_tokens == len(llm.get_tokenizer().encode(text, False))


def test_tokenize_gives_the_prompt_a_completion_is_computed_from(disagg, client, llm):  # type: ignore[no-untyped-def]
    """vLLM's /tokenize: a conversation's tokens are the prompt the chat completion counts (the
    same template, options and tokenizer), a text's the offline tokenizer's; /detokenize turns
    them back."""
    router = disagg[1]
    messages = [*CHAT, {"role": "assistant", "content": "The capital"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    tokenized = httpx.post(f"{router.url}/tokenize", json={"messages": messages, **options})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body=options
    )
    assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert body["tokens"] == tokenizer.encode(text, False)
    assert body["max_model_len"] == client.models.list().data[0].max_model_len
    plain = {"model": MODEL, "prompt": PROMPTS[1], "return_token_strs": True}
    body = httpx.post(f"{router.url}/tokenize", json=plain).json()
    assert body["tokens"] == tokenizer.encode(PROMPTS[1])
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    back = httpx.post(f"{router.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": PROMPTS[1]}


def test_return_tokens_as_token_ids_names_the_offline_engines_tokens(client, llm):  # type: ignore[no-untyped-def]
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>", the ids
    the offline engine generates; the text and its offsets are unchanged."""
    (expected,) = offline(llm, PROMPTS[:1], max_tokens=5, logprobs=2)
    ids = [f"token_id:{t}" for t in expected.token_ids]
    extra = {"return_tokens_as_token_ids": True}
    named = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2, extra_body=extra
    ).choices[0]
    plain = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2
    ).choices[0]
    assert named.logprobs.tokens == ids and named.text == plain.text == expected.text
    assert named.logprobs.text_offset == plain.logprobs.text_offset
    assert all(ids[i] in top for i, top in enumerate(named.logprobs.top_logprobs))
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, extra_body=extra
    )
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_stop_reason_names_the_stop_string_or_token_that_ended_each_choice(client, llm):  # type: ignore[no-untyped-def]
    """vLLM's ``stop_reason``, streamed (on the chunk with the finish) and not: the stop string
    that matched, or the stop token id; None for the length limit. The token id also when the
    prefill worker's first token ends the request (its answer carries it: no decode call)."""
    (free,) = offline(llm, PROMPTS[:1], max_tokens=12)
    stop = free.text[4:7]  # a stop string the greedy answer runs into
    first, fifth = free.token_ids[0], free.token_ids[4]
    cases = [  # (request fields, finish_reason, stop_reason)
        ({"stop": [stop, "never here"]}, "stop", stop),
        ({"extra_body": {"stop_token_ids": [fifth]}}, "stop", fifth),
        ({"extra_body": {"stop_token_ids": [first]}}, "stop", first),  # ended by P's token
        ({}, "length", None),
    ]
    for fields, finish_reason, stop_reason in cases:
        extra = fields.get("extra_body", {})
        (want,) = offline(llm, PROMPTS[:1], max_tokens=12, stop=fields.get("stop", []), **extra)
        assert (want.finish_reason, want.stop_reason) == (finish_reason, stop_reason)
        for stream in (False, True):
            response = client.completions.create(
                model=MODEL,
                prompt=PROMPTS[0],
                max_tokens=12,
                temperature=0,
                stream=stream,
                **fields,
            )
            chunks = list(response) if stream else [response]
            ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(ends) == 1, chunks
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
            assert ends[0].finish_reason == finish_reason
            assert (ends[0].model_extra or {})["stop_reason"] == stop_reason, (fields, stream)
    for stream in (False, True):  # chat too: the answer names Paris within 20 tokens
        (want,) = offline(llm, [chat_prompt(llm)], max_tokens=20, stop=["Paris"])
        assert (want.finish_reason, want.stop_reason) == ("stop", "Paris")
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stop=["Paris"], stream=stream
        )
        chunks = list(response) if stream else [response]
        ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [(e.finish_reason, (e.model_extra or {})["stop_reason"]) for e in ends] == [
            ("stop", "Paris")
        ]


def test_return_token_ids_gives_the_prompts_and_the_offline_engines_tokens(client, llm):  # type: ignore[no-untyped-def]
    """vLLM's ``return_token_ids``, streamed and not: each completion choice's
    ``prompt_token_ids`` (streamed: on its first chunk) and ``token_ids`` (streamed: each chunk's
    own, adding up); on chat the prompt's at the top level. Not asked for, none of them."""
    tokenizer = llm.get_tokenizer()
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    asked["extra_body"] = {"return_token_ids": True}
    expected = offline(llm, PROMPTS, max_tokens=8)
    for stream in (False, True):
        response = client.completions.create(prompt=PROMPTS, stream=stream, **asked)
        chunks = list(response) if stream else [response]
        got: dict[int, list[int]] = {}
        prompts: dict[int, list[list[int]]] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                extra = choice.model_extra or {}
                got[choice.index] = got.get(choice.index, []) + extra["token_ids"]
                if "prompt_token_ids" in extra:
                    prompts.setdefault(choice.index, []).append(extra["prompt_token_ids"])
        assert got == {i: list(e.token_ids) for i, e in enumerate(expected)}, stream
        assert prompts == {i: [tokenizer.encode(p)] for i, p in enumerate(PROMPTS)}, stream
    prompt_ids = tokenizer.encode(chat_prompt(llm), add_special_tokens=False)
    (want,) = offline(llm, [chat_prompt(llm)], max_tokens=8)
    for stream in (False, True):
        response = client.chat.completions.create(messages=CHAT, stream=stream, **asked)
        chunks = list(response) if stream else [response]
        tops = [
            c.model_extra["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c.model_extra
        ]
        assert tops == [prompt_ids], stream
        tokens = [
            t
            for c in chunks
            for choice in c.choices
            for t in choice.model_extra.get("token_ids", [])
        ]
        assert tokens == list(want.token_ids), stream
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert not {"token_ids", "prompt_token_ids"} & set(plain.choices[0].model_extra or {})


def test_a_one_token_request_never_calls_the_decode_worker(disagg, client, llm):  # type: ignore[no-untyped-def]
    # The prefill worker's first token is the whole answer: a decode worker called early (the
    # streamed hand-off calls it while the prompt computes) would pull the KV for nothing and
    # be cancelled. The decode worker logs a line for every call it gets, by request id.
    decode = disagg[0].workers[1]
    ids = []
    for prompt in PROMPTS:
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
        )
        assert response.choices[0].text == prompt + offline(llm, [prompt], max_tokens=1)[0].text
        assert response.choices[0].finish_reason == "length"
        ids.append(response.id)
    time.sleep(1.0)  # a stray call would have ended and logged by now
    log = decode.output_tail(400)
    assert not [i for i in ids if i in log], f"the decode worker was called:\n{log[-2000:]}"


def test_models_workers_and_metrics(disagg, client):  # type: ignore[no-untyped-def]
    c, router = disagg
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)  # counted below
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = router.get("/v1/workers")
    assert status == 200
    rows = {w["role"]: w for w in body["data"]}
    assert set(rows) == {"prefill", "decode"}
    for role, worker in zip(("prefill", "decode"), c.workers):
        row = rows[role]
        assert row["pid"] == worker.pid and row["healthy"] is True
        assert row["grpc_address"] == worker.info["grpc_address"]
        assert row["kv_blocks_total"] == worker.info["num_blocks"]
        for key in ("host", "fingerprint", "kv_blocks_used", "kv_blocks_cached", "num_running"):
            assert key in row
    assert rows["prefill"]["fingerprint"]["key"] == rows["decode"]["fingerprint"]["key"]
    assert router.get("/health") == (200, {"status": "ok"})
    assert router.get("/ping") == (200, {"status": "ok"})  # vLLM's probes
    assert router.get("/version") == (200, {"version": package_version("pdserve")})
    assert router.get("/ready") == (200, {"status": "ready"})
    labels = 'endpoint="/v1/completions",status="200"'
    assert router.metric("pdserve_router_requests_total", labels) >= 1
    assert router.metric("pdserve_router_ttft_seconds_count") >= 1
    assert (
        router.metric(
            "pdserve_router_routing_decisions_total", 'policy="least_loaded",pool="decode"'
        )
        >= 1
    )
    assert router.metric("pdserve_router_workers", 'pool="prefill"') == 1


def test_client_disconnect_mid_stream_frees_the_decode_blocks(disagg):  # type: ignore[no-untyped-def]
    c, router = disagg
    prefill, decode = c.workers
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    made_before = router.metric("pdserve_router_generation_tokens_total")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", router.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 5:
                    break
            held = blocks_in_use(decode)
            assert held > 0, "the decode worker held no blocks mid-stream"
    # The client is gone; the router must cancel the stream and the decode worker abort it.
    start = time.monotonic()
    assert wait_until(lambda: blocks_in_use(decode) == 0, timeout=10), "decode blocks leaked"
    assert time.monotonic() - start < 10
    assert wait_until(lambda: blocks_in_use(prefill) == 0, timeout=10), "prefill blocks leaked"
    # and the generation did stop: far fewer than 400 tokens were made
    made = router.metric("pdserve_router_generation_tokens_total") - made_before
    assert 5 <= made < 400


def test_colocated_worker_serves_the_same_text(redis_server, llm):  # type: ignore[no-untyped-def]
    with cluster(redis_server.url, ("colocated",)) as (c, router):
        response = router.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, temperature=0
        )
        (expected,) = offline(llm, [chat_prompt(llm)], max_tokens=20)
        assert response.choices[0].message.content == expected.text
        assert wait_until(lambda: blocks_in_use(c.workers[0]) == 0)


def _lengths_across_residues(rng: random.Random) -> list[int]:
    """Prompt lengths for the hand-off through the router: each residue that was ever special
    to the block size (16): 1, 0, 15, and a random sample of the rest, up to ~20 blocks."""
    return sorted({1, 16, 17, 33, 47, 257, *rng.sample(range(2, 320), 4)})


def test_every_residue_of_the_block_size_gives_the_offline_tokens(client, llm):  # type: ignore[no-untyped-def]
    """The default hand-off (KV streamed while the prompt computes, always disaggregated here)
    at lengths across the block size's residues, prompts as token ids, greedy, n 1 and 2:
    every choice's text equals the offline engine's. 16k+1 used to decode from a stale slot."""
    seed = int(time.time()) // 3600  # a new sample every hour, named on failure
    rng = random.Random(seed)
    lengths = _lengths_across_residues(rng)
    prompts = [[rng.randrange(100, 40_000) for _ in range(length)] for length in lengths]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [out.outputs[0].text for out in llm.generate(prompts, params)]
    for n, indices in ((1, range(len(prompts))), (2, [0, 2, len(prompts) - 1])):
        response = client.completions.create(
            model=MODEL,
            prompt=[prompts[i] for i in indices],
            max_tokens=4,
            temperature=0,
            n=n,
            extra_body={"ignore_eos": True},
        )
        assert len(response.choices) == len(indices) * n
        for choice in response.choices:
            i = list(indices)[choice.index // n]
            assert choice.text == expected[i], f"seed {seed}, length {lengths[i]}, n {n}"
        assert response.usage.completion_tokens == 4 * n * len(indices)
