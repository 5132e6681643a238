"""Requests drawn at random, as users send them: the official ``openai`` client, a real router,
prefill, decode and colocated workers. Hypothesis draws the endpoint, the route (always
disaggregated, every prompt computed on the decode worker, or a colocated worker), the prompts
and their lengths, ``n``, greedy or a seeded draw (top-p, top-k, min-p), ``max_tokens``,
``min_tokens``, ``ignore_eos``, stop strings (kept in the output or not) and stop token ids,
penalties, logprobs, a structured output (a choice, a regex, any JSON object) and streaming.
Each answer, choice by choice, must be the offline engine's for the same prompt and sampling
parameters: the same text, finish reason, token count and (to float noise) logprobs.

``PDSERVE_PROPERTY_EXAMPLES`` sets how many requests (default 16, to keep ``make test`` short).
The examples change every hour (the seed is the hour, as in test_openai_api's residue sample), so
successive runs sample the space instead of repeating one corner of it; a failure prints the
request (``Drawn``), and ``PDSERVE_PROPERTY_SEED`` (the hour's number) draws the same again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from common.sampling_params import StructuredOutput
from pdserve import SamplingParams
from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    cluster,
    own_routers,
    wait_until,
)

EXAMPLES = int(os.environ.get("PDSERVE_PROPERTY_EXAMPLES", "16"))
SEED = int(os.environ.get("PDSERVE_PROPERTY_SEED", int(time.time()) // 3600))
WORDS = ["the", "cat", "sat", "on", "a", "mat", ".", "Paris", "is", "code", "1", "2", "\n", "é"]
STOPS = [" the", ".", ",", "\n", "e", " a"]
STOP_IDS = [28, 30, 198, 253, 260]  # SmolLM2's ",", ".", "\n", " a", " the"
# Structured outputs, as the request's ``structured_outputs`` field and the engine's spec.
STRUCTURED: list[tuple[dict[str, Any], StructuredOutput]] = [
    (
        {"choice": ["yes", "no", "maybe so"]},
        StructuredOutput("choice", '["yes", "no", "maybe so"]'),
    ),
    (
        {"regex": "[a-z]{1,6}( [a-z]{1,6}){0,2}"},
        StructuredOutput("regex", "[a-z]{1,6}( [a-z]{1,6}){0,2}"),
    ),
    ({"json_object": True}, StructuredOutput("json_object")),
]


@dataclass
class Drawn:
    """One request: its endpoint, route, prompt and sampling fields."""

    endpoint: str  # "completions" (1-3 prompts as token ids) or "chat" (a user message)
    route: str  # "disaggregated", "local" (on the decode worker) or "colocated"
    prompt: list[list[int]] | str
    n: int
    temperature: float
    seed: int | None
    max_tokens: int
    stream: bool
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    structured: int | None = None  # an index into STRUCTURED

    def params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=self.logprobs,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=None if self.structured is None else STRUCTURED[self.structured][1],
        )

    def vllm_fields(self) -> dict[str, Any]:
        """The fields beyond OpenAI's, as vLLM takes them (the client's ``extra_body``)."""
        fields: dict[str, Any] = {
            "repetition_penalty": self.repetition_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        if self.structured is not None:
            fields["structured_outputs"] = STRUCTURED[self.structured][0]
        return fields


@st.composite
def requests(draw: st.DrawFn) -> Drawn:
    endpoint = draw(st.sampled_from(["completions", "chat"]))
    prompt: list[list[int]] | str
    if endpoint == "completions":
        lengths = st.integers(1, 64) | st.integers(65, 600)  # short, or past a prefill chunk
        prompt = [
            draw(st.lists(st.integers(100, 40_000), min_size=length, max_size=length))
            for length in draw(st.lists(lengths, min_size=1, max_size=3))
        ]
    else:
        prompt = " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=40)))
    temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
    max_tokens = draw(st.integers(1, 10))
    structured = draw(st.sampled_from([None, None, 0, 1, 2]))
    free = structured is None  # a grammar ends the output: no min_tokens, no ignore_eos
    return Drawn(
        endpoint=endpoint,
        route=draw(st.sampled_from(["disaggregated", "local", "colocated"])),
        prompt=prompt,
        n=draw(st.integers(1, 3)),
        temperature=temperature,
        seed=None if temperature == 0 else draw(st.integers(0, 2**31 - 1)),
        max_tokens=max_tokens,
        stream=draw(st.booleans()),
        stop=draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True)),
        presence_penalty=draw(st.sampled_from([0.0, 0.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
        logprobs=draw(st.sampled_from([None, 0, 2])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        top_k=draw(st.sampled_from([0, 5])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        min_tokens=min(draw(st.sampled_from([0, 0, 3])), max_tokens) if free else 0,
        ignore_eos=draw(st.booleans()) and free,
        stop_token_ids=draw(st.lists(st.sampled_from(STOP_IDS), max_size=2)),
        include_stop_str_in_output=draw(st.booleans()),
        structured=structured,
    )


@pytest.fixture(scope="module")
def routers(pd_pair: Cluster, redis_server) -> Iterator[dict[str, Router]]:  # type: ignore[no-untyped-def]
    """Three routes: a router that always disaggregates and one that computes every prompt on
    the decode worker, both in front of the shared pair, and a router in front of a colocated
    worker of its own; every block back at the end."""
    with own_routers(pd_pair) as c:
        remote = c.add_router()
        local = c.add_router("--disaggregation", "conditional", "--local-prefill-tokens", "4096")
        with cluster(redis_server.url, ("colocated",)) as (own, colocated):
            remote.wait_ready(num_workers=2)
            local.wait_ready(num_workers=2)
            yield {"disaggregated": remote, "local": local, "colocated": colocated}
            assert wait_until(lambda: blocks_in_use(own.workers[0]) == 0)


@dataclass
class Answer:
    """One choice: its text, finish reason, and its tokens' logprobs (when asked)."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)


def offline(llm: Any, drawn: Drawn) -> tuple[list[Answer], int]:
    """The offline engine's choices and completion tokens for the same request."""
    prompts: list[Any] = [drawn.prompt]
    if isinstance(drawn.prompt, str):
        messages = [{"role": "user", "content": drawn.prompt}]
        prompts = [llm.get_tokenizer().apply_chat_template(messages)]
    else:
        prompts = list(drawn.prompt)
    answers, num_tokens = [], 0
    for out in llm.generate(prompts, drawn.params()):  # choice p * n + i: prompt p's i-th
        for o in out.outputs:
            logprobs = [lp[t] for t, lp in zip(o.token_ids, o.logprobs or [])]
            answers.append(Answer(o.text, o.finish_reason, logprobs))
            num_tokens += len(o.token_ids)
    return answers, num_tokens


def _body(drawn: Drawn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "n": drawn.n,
        "temperature": drawn.temperature,
        "max_tokens": drawn.max_tokens,
        "presence_penalty": drawn.presence_penalty,
        "frequency_penalty": drawn.frequency_penalty,
        "top_p": drawn.top_p,
        "extra_body": drawn.vllm_fields(),
    }
    if drawn.seed is not None:
        body["seed"] = drawn.seed
    if drawn.stop:
        body["stop"] = drawn.stop
    if drawn.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if drawn.endpoint == "completions":
        body["prompt"] = drawn.prompt
        if drawn.logprobs is not None:
            body["logprobs"] = drawn.logprobs
    else:
        body["messages"] = [{"role": "user", "content": drawn.prompt}]
        if drawn.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = drawn.logprobs
    return body


def _logprobs(choice: Any, chat: bool) -> list[float]:
    if choice.logprobs is None:
        return []
    if chat:
        return [entry.logprob for entry in choice.logprobs.content or []]
    return list(choice.logprobs.token_logprobs or [])


def asked(router: Router, drawn: Drawn) -> tuple[list[Answer], int]:
    """The gateway's choices (in index order) and its usage's completion tokens."""
    client = router.client()
    chat = drawn.endpoint == "chat"
    create = client.chat.completions.create if chat else client.completions.create
    response = create(**_body(drawn))
    answers = [Answer() for _ in range(drawn.n * (1 if chat else len(drawn.prompt)))]
    if not drawn.stream:
        for choice in response.choices:
            text = choice.message.content if chat else choice.text
            answers[choice.index] = Answer(
                text or "", choice.finish_reason, _logprobs(choice, chat)
            )
        return answers, response.usage.completion_tokens
    completion_tokens = -1
    for chunk in response:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            answer = answers[choice.index]
            answer.text += (choice.delta.content or "") if chat else choice.text
            answer.logprobs += _logprobs(choice, chat)
            if choice.finish_reason:
                assert answer.finish_reason is None, "finish_reason sent twice"
                answer.finish_reason = choice.finish_reason
    return answers, completion_tokens


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@seed(SEED)
@given(drawn=requests())
def test_a_drawn_request_gets_the_offline_engines_answer(routers, llm, drawn: Drawn) -> None:  # type: ignore[no-untyped-def]
    note(repr(drawn))
    want, want_tokens = offline(llm, drawn)
    got, got_tokens = asked(routers[drawn.route], drawn)
    assert [(a.text, a.finish_reason) for a in got] == [(a.text, a.finish_reason) for a in want]
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-3)
