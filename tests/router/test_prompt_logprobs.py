"""Prompt logprobs (``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``) and ``logit_bias``
through the gateway, with the official ``openai`` client, on every route a prompt can take:
computed on a prefill worker (KV streamed, or whole), on the decode worker itself (local
prefill), on a colocated worker. The prompt's log-probabilities must equal transformers' on the
same weights in float32, also when part of the prompt sits in a prefix cache (cached blocks hold
KV, not logits: those tokens are computed again); a bias of +100 makes greedy pick its token
both where the first token is sampled (the prefill worker) and where the rest are (the decode
worker), -100 bans one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from services.worker.launcher import WorkerProcess
from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    spawn_router,
    wait_until,
)
from tests.services.workers import SMALL

TOLERANCE = 1e-4  # float32 on both sides
CHUNK = 16  # --max-num-batched-tokens: every prompt here is computed in several steps
ROUTES = ["pulled", "pulled-whole", "local", "colocated"]
TEXT = (
    "Paged attention stores the KV cache in fixed-size blocks so that memory is not wasted on "
    "padding, and a prefix shared by many requests is computed once and reused by all of them "
    "until it is evicted"
)


def chunking(c: Cluster, *roles: str) -> list[WorkerProcess]:
    """Workers that compute a prompt in chunks of 16 tokens (the prompts here take several)."""
    args = [*SMALL, *c.worker_args("--max-num-batched-tokens", str(CHUNK))]
    started = [WorkerProcess(role, args) for role in roles]
    for worker in started:
        worker.spawn()
        c.workers.append(worker)
    return started


@pytest.fixture(scope="module")
def routers(redis_server) -> Iterator[dict[str, Router]]:  # type: ignore[no-untyped-def]
    """One prefill and one decode worker behind three routers (always disaggregated, KV
    streamed or whole; local prefill for every prompt), and a colocated worker behind a
    fourth: one router per route. Every block is back in its pool afterwards."""
    pd, solo = Cluster(redis_server.url), Cluster(redis_server.url)
    try:
        workers = [*chunking(pd, "prefill", "decode"), *chunking(solo, "colocated")]
        local = ["--disaggregation", "conditional", "--local-prefill-tokens", "100000"]
        routes = {
            "pulled": spawn_router(pd),
            "pulled-whole": spawn_router(pd, "--no-stream-kv"),
            "local": spawn_router(pd, *local),
            "colocated": spawn_router(solo),
        }
        for worker in workers:
            worker.wait_ready()
        for router in routes.values():
            router.process.wait_ready()
            router.wait_ready()
        yield routes
        assert wait_until(lambda: all(blocks_in_use(w) == 0 for w in workers)), [
            blocks_in_use(w) for w in workers
        ]
    except BaseException:
        pd.dump()
        solo.dump()
        raise
    finally:
        pd.stop()
        solo.stop()


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    """transformers' model and tokenizer on the weights the workers load, in float32."""
    transformers = pytest.importorskip("transformers")
    from services.engine.config import EngineConfig
    from services.engine.model.source import resolve_model_dir

    config = EngineConfig()
    path = str(resolve_model_dir(config.model, config.cache_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model


def hf_logprobs(hf, ids: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    """log p(ids[i] | ids[:i]) for i >= 1, by transformers."""
    with torch.inference_mode():
        logits = hf[1](torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def hf_rank_bounds(hf, ids: list[int]) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Per prompt token from the second: the lowest and highest rank vLLM's count (tokens at
    least as likely, itself included) can give it within float32's ``TOLERANCE``."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf[1](torch.tensor([ids])).logits[0].float(), dim=-1)
    bounds = []
    for i in range(1, len(ids)):
        row, own = logprobs[i - 1], logprobs[i - 1, ids[i]]
        lowest = int((row > own + TOLERANCE).sum()) + 1
        bounds.append((lowest, int((row >= own - TOLERANCE).sum())))
    return bounds


def prompt_ids(hf, route: str) -> list[int]:  # type: ignore[no-untyped-def]
    """A prompt no other test sends (its own prefix-cache blocks)."""
    return hf[0](f"[{route}] {TEXT}").input_ids


def echo(router: Router, prompt: list[int], **kwargs):  # type: ignore[no-untyped-def]
    return router.client().completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, temperature=0, **kwargs
    )


def kv_source(response) -> str:  # type: ignore[no-untyped-def]
    return response.usage.model_extra["pdserve_timings"][0]["kv_source"]


def assert_close(got: list[float | None], expected: list[float]) -> None:
    assert got[0] is None  # the first prompt token has nothing to be predicted from
    assert len(got) == len(expected) + 1
    worst = max(abs(g - e) for g, e in zip(got[1:], expected))  # type: ignore[operator]
    assert worst < TOLERANCE, worst


@pytest.mark.parametrize("route", ["pulled", "colocated"])
def test_echo_alone_returns_the_prompts_logprobs(routers, hf, route: str) -> None:  # type: ignore[no-untyped-def]
    """max_tokens 0 with echo: the prompt and its logprobs, nothing generated."""
    ids = prompt_ids(hf, route)[:24]
    response = echo(routers[route], ids, max_tokens=0)
    [choice] = response.choices
    assert kv_source(response) == route.split("-")[0]
    assert choice.text == hf[0].decode(ids)
    assert choice.logprobs.tokens == [hf[0].decode([t]) for t in ids]
    assert_close(choice.logprobs.token_logprobs, hf_logprobs(hf, ids))
    assert choice.logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(
        choice.logprobs.tokens[1:],
        choice.logprobs.token_logprobs[1:],
        choice.logprobs.top_logprobs[1:],
    ):  # the prompt's token and the most likely one (logprobs=1): one entry when they are one
        assert top[token] == logprob and len(top) == (1 if max(top.values()) == logprob else 2)
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0


@pytest.mark.parametrize("route", ROUTES)
def test_a_partly_cached_prompt_is_computed_again(routers, hf, route: str) -> None:  # type: ignore[no-untyped-def]
    """The prompt's first blocks are in the prefix cache of the worker that computes it (a
    request sent them first): they are computed again for their logits, not taken."""
    ids = prompt_ids(hf, route)
    router = routers[route]
    client = router.client()
    client.completions.create(model=MODEL, prompt=ids[:-5], max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids[:-3], max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is cached there
    response = echo(router, ids, max_tokens=3)
    [choice] = response.choices
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # the cost: no hits taken
    assert_close(choice.logprobs.token_logprobs[: len(ids)], hf_logprobs(hf, ids))
    # The generated tokens follow the prompt's, in text and in logprobs.
    assert len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.text.startswith(hf[0].decode(ids)) and len(choice.text) > len(hf[0].decode(ids))
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[len(ids) :])
    offsets = choice.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("route", ROUTES)
def test_prompt_logprobs_extra_on_chat(routers, hf, route: str) -> None:  # type: ignore[no-untyped-def]
    """vLLM's prompt_logprobs: per prompt token None or {token id: {logprob, rank, decoded}};
    the prompt's token is ranked in the whole vocabulary also when it is not among the top
    ones, as transformers' logits rank it."""
    messages = [{"role": "user", "content": f"Say something about {route} prefills."}]
    response = (
        routers[route]
        .client()
        .chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            temperature=0,
            # vLLM names prompt tokens by their text also when logprobs name them by id
            extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": route == "local"},
        )
    )
    entries = response.model_extra["prompt_logprobs"]
    text = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf[0](text).input_ids
    assert len(entries) == len(ids) == response.usage.prompt_tokens
    assert entries[0] is None
    got = [None] + [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])]
    assert_close(got, hf_logprobs(hf, ids))
    outside = 0
    for entry, token, (lowest, highest) in zip(entries[1:], ids[1:], hf_rank_bounds(hf, ids)):
        assert all(v["decoded_token"] == hf[0].decode([int(t)]) for t, v in entry.items())
        rank = entry[str(token)]["rank"]
        assert lowest <= rank <= highest, (token, rank, lowest, highest)
        by_likelihood = sorted(entry.values(), key=lambda v: -v["logprob"])
        assert [v["rank"] for v in by_likelihood][:2] == [1, 2]  # the two most likely
        if len(entry) == 3:  # the prompt's token is not among them: ranked in the vocabulary
            outside += 1
            assert rank > 2
    assert outside > len(ids) // 4  # the case this test is about is common in a chat prompt


def test_echo_with_several_prompts_and_n(routers, hf) -> None:  # type: ignore[no-untyped-def]
    """Each choice echoes its own prompt (choice i * n + k is prompt i's k-th sequence); with
    n > 1 on the pulled route the decode worker computes the last prompt token again, and the
    prompt logprobs still come from the prefill worker, once."""
    prompts = [prompt_ids(hf, "n a")[:12], prompt_ids(hf, "n b")[:18]]
    response = (
        routers["pulled"]
        .client()
        .completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            echo=True,
            logprobs=0,
            max_tokens=2,
            temperature=1,
            seed=7,
        )
    )
    assert len(response.choices) == 4
    for choice in response.choices:
        ids = prompts[choice.index // 2]
        assert choice.text.startswith(hf[0].decode(ids))
        assert len(choice.logprobs.tokens) == len(ids) + 2
        assert_close(choice.logprobs.token_logprobs[: len(ids)], hf_logprobs(hf, ids))


def test_streamed_echo_starts_with_the_prompt(routers, hf) -> None:  # type: ignore[no-untyped-def]
    ids = prompt_ids(hf, "stream")[:20]
    stream = (
        routers["pulled"]
        .client()
        .completions.create(
            model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=4, temperature=0, stream=True
        )
    )
    events = list(stream)
    text = "".join(e.choices[0].text for e in events if e.choices)
    tokens = [
        t
        for e in events
        if e.choices and e.choices[0].logprobs
        for t in e.choices[0].logprobs.tokens
    ]
    first = events[0].choices[0].logprobs
    assert text.startswith(hf[0].decode(ids))
    assert len(tokens) == len(ids) + 4
    assert_close(first.token_logprobs[: len(ids)], hf_logprobs(hf, ids))


def token(hf, text: str) -> int:  # type: ignore[no-untyped-def]
    [token_id] = hf[0].encode(text)
    return token_id


@pytest.mark.parametrize("route", ["pulled", "local", "colocated"])
def test_logit_bias_on_every_sampled_token(routers, hf, route: str) -> None:  # type: ignore[no-untyped-def]
    """+100 makes greedy pick the token first (sampled by the prefill worker on a pulled
    route) and after (the decode worker); -100 bans the tokens greedy picked without bias."""
    client = routers[route].client()
    prompt = f"The capital of France is ({route})"
    banana = token(hf, " banana")
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={str(banana): 100}
    )
    assert kv_source(forced) == route.split("-")[0]
    assert forced.choices[0].text == " banana" * 4
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0
    )
    greedy = plain.choices[0].logprobs.tokens  # as text: the first two are single tokens
    bias = {str(token(hf, text)): -100 for text in greedy[:2]}
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0, logit_bias=bias
    )
    assert not set(greedy[:2]) & set(banned.choices[0].logprobs.tokens)


@pytest.mark.parametrize("route", ["pulled", "colocated"])
def test_min_tokens_holds_off_eos(routers, hf, route: str) -> None:  # type: ignore[no-untyped-def]
    """vLLM's min_tokens: EOS (here pushed by +100) cannot come before that many tokens, on
    the prefill worker's first token as on the decode worker's."""
    client = routers[route].client()
    eos = {str(hf[0].eos_token_id): 100}
    at_once = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logit_bias=eos
    )
    assert at_once.choices[0].finish_reason == "stop" and at_once.usage.completion_tokens == 1
    held = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0,
        logit_bias=eos,
        extra_body={"min_tokens": 3},
    )
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"suffix": "!"}, "suffix"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_refused_with_the_field_named(routers, body, param: str) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(
        routers["pulled"].url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", **body},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ],
)
def test_chat_refusals_name_the_field(routers, body, param: str) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Hi"}]
    response = httpx.post(
        routers["pulled"].url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, **body},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_bias_outside_the_vocabulary_is_refused(routers) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(
        routers["pulled"].url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "logit_bias": {str(10**9): 5}},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "logit_bias" in json.loads(response.text)["error"]["message"]
