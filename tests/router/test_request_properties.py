"""Requests drawn at random, as users send them: the official ``openai`` client, a real router,
prefill, decode and colocated workers. Hypothesis draws (tests/router/drawn_requests.py):

- the endpoint and route: completions (1-3 prompts, token ids or text) or chat (with or without
  a system message); always disaggregated (the KV streamed as the prompt computes, or pulled
  whole once it has), every prompt computed on the decode worker, or a colocated worker;
- sampling: ``n``, greedy or a seeded draw (top-p, top-k, min-p), ``max_tokens``,
  ``min_tokens``, ``ignore_eos``, stop strings (kept in the output or not) and stop token ids,
  penalties, ``logit_bias``;
- output: logprobs and their top alternatives (named by id or by text), ``echo`` (also with
  ``max_tokens`` 0), vLLM's ``prompt_logprobs``, ``return_token_ids`` and
  ``skip_special_tokens``, a structured output (a choice, a regex, any JSON object), tools
  (``none``, ``auto``, ``required``, a named function), streaming (with the usage at the end or
  on every chunk);
- vLLM's ``cache_salt`` (a tenant's own prefix cache), which must not change an answer.

Each answer, choice by choice, must be the offline engine's for the same prompt tokens and
sampling parameters: the same text, tool calls, finish and stop reason, usage, token ids
and (to float noise) logprobs of the output and of the prompt. The requests go one at a time,
and in batches of 2-4 sent at once (a quarter as many), so that different requests share the
workers' steps.

``PDSERVE_PROPERTY_EXAMPLES`` sets how many requests (default 16, to keep ``make test`` short).
The examples change every hour (the seed is the hour, as in test_openai_api's residue sample), so
successive runs sample the space instead of repeating one corner of it; a failure prints the
request (``Drawn``), and ``PDSERVE_PROPERTY_SEED`` (the hour's number) draws the same again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st

from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    cluster,
    own_routers,
    wait_until,
)
from tests.router.drawn_requests import Answer, Drawn, Usage, expected, requests

EXAMPLES = int(os.environ.get("PDSERVE_PROPERTY_EXAMPLES", "16"))
SEED = int(os.environ.get("PDSERVE_PROPERTY_SEED", int(time.time()) // 3600))


@pytest.fixture(scope="module")
def routers(pd_pair: Cluster, redis_server) -> Iterator[dict[str, Router]]:  # type: ignore[no-untyped-def]
    """Four routes: routers that always disaggregate (the KV streamed as the prompt computes,
    or pulled whole once it has) and one that computes every prompt on the decode worker, in
    front of the shared pair, and a router in front of a colocated worker of its own; every
    block back at the end."""
    local = ["--disaggregation", "conditional", "--local-prefill-tokens", "4096"]
    with own_routers(pd_pair) as c:
        routes = {
            "disaggregated": c.add_router(),
            "whole": c.add_router("--no-stream-kv"),
            "local": c.add_router(*local),
        }
        with cluster(redis_server.url, ("colocated",)) as (own, colocated):
            for router in routes.values():
                router.wait_ready(num_workers=2)
            yield {**routes, "colocated": colocated}
            assert wait_until(lambda: blocks_in_use(own.workers[0]) == 0)


def _id(name: str) -> int:
    """A token's id from its ``token_id:<id>`` name (-1 for a name that is its text)."""
    return int(name.split(":", 1)[1]) if name.startswith("token_id:") else -1


def _read_logprobs(answer: Answer, logprobs: Any, chat: bool) -> None:
    """Append a choice's (or a chunk's) logprobs to the answer."""
    if logprobs is None:
        return
    if chat:
        for entry in logprobs.content or []:
            answer.logprobs.append(entry.logprob)
            answer.tokens.append(_id(entry.token))
            answer.top.append({_id(t.token): t.logprob for t in entry.top_logprobs})
        return
    answer.logprobs += logprobs.token_logprobs or []
    answer.tokens += [_id(t) for t in logprobs.tokens or []]
    for top in logprobs.top_logprobs or []:
        answer.top.append(None if top is None else {_id(t): lp for t, lp in top.items()})


def _add_call_delta(answer: Answer, call: Any) -> None:
    """A streamed tool-call delta: it opens call ``index`` (with its name) or extends it."""
    if call.index == len(answer.tool_calls):
        assert call.function.name, "a call opens with its name"
        answer.tool_calls.append((call.function.name, ""))
    name, arguments = answer.tool_calls[call.index]
    answer.tool_calls[call.index] = (name, arguments + (call.function.arguments or ""))


def _read_prompt_logprobs(entries: list[Any] | None) -> list[dict[int, float] | None] | None:
    if entries is None:
        return None
    return [None if e is None else {int(t): v["logprob"] for t, v in e.items()} for e in entries]


def asked(router: Router, drawn: Drawn) -> tuple[list[Answer], Usage]:
    """The gateway's choices (in index order) and its usage (streamed: the final one, after
    checking that a continuous usage never goes down)."""
    client = router.client()
    create = client.chat.completions.create if drawn.chat else client.completions.create
    response = create(**drawn.openai_arguments(MODEL))
    answers = [Answer() for _ in range(drawn.n * drawn.num_prompts)]
    if not drawn.stream:
        shared = (response.model_extra or {}).get("prompt_logprobs")  # chat: top level
        prompt_ids = (response.model_extra or {}).get("prompt_token_ids")  # chat: top level
        for choice in response.choices:
            answer = answers[choice.index]
            extra = choice.model_extra or {}
            answer.token_ids = extra.get("token_ids")
            answer.prompt_token_ids = prompt_ids if drawn.chat else extra.get("prompt_token_ids")
            answer.text = (choice.message.content if drawn.chat else choice.text) or ""
            answer.finish_reason = choice.finish_reason
            assert "stop_reason" in (choice.model_extra or {}), choice
            answer.stop_reason = choice.model_extra["stop_reason"]
            calls = (choice.message.tool_calls or []) if drawn.chat else []
            answer.tool_calls = [(c.function.name, c.function.arguments) for c in calls]
            _read_logprobs(answer, choice.logprobs, drawn.chat)
            own = (choice.model_extra or {}).get("prompt_logprobs")
            answer.prompt_logprobs = _read_prompt_logprobs(shared if drawn.chat else own)
        return answers, (response.usage.prompt_tokens, response.usage.completion_tokens)
    usage, usages = (-1, -1), 0
    for chunk in response:
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens >= usage[1], "the usage went down"
            usage, usages = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens), usages + 1
        for choice in chunk.choices:
            answer = answers[choice.index]
            extra = {**(chunk.model_extra or {}), **(choice.model_extra or {})}
            if "token_ids" in extra:
                answer.token_ids = (answer.token_ids or []) + extra["token_ids"]
            if "prompt_token_ids" in extra:
                assert answer.prompt_token_ids is None, "prompt_token_ids sent twice"
                answer.prompt_token_ids = extra["prompt_token_ids"]
            answer.text += (choice.delta.content or "") if drawn.chat else choice.text
            for call in (choice.delta.tool_calls or []) if drawn.chat else []:
                _add_call_delta(answer, call)
            _read_logprobs(answer, choice.logprobs, drawn.chat)
            if choice.finish_reason:
                assert answer.finish_reason is None, "finish_reason sent twice"
                answer.finish_reason = choice.finish_reason
                answer.stop_reason = (choice.model_extra or {}).get("stop_reason", "missing")
    assert drawn.continuous_usage or usages == 1, f"{usages} usages without continuous stats"
    return answers, usage


def same_entries(got: dict[int, float] | None, want: dict[int, float] | None) -> None:
    """One token's alternatives: the same tokens with the same logprobs, but for a near tie
    at the top-k cut (served and offline batches round differently)."""
    assert (got is None) == (want is None), (got, want)
    if got is None or want is None:
        return
    assert len(got) == len(want), (got, want)
    for t in got.keys() & want.keys():
        assert got[t] == pytest.approx(want[t], abs=1e-3), (t, got, want)
    for t in got.keys() ^ want.keys():  # swapped at the cut: as likely as what it replaced
        mine, other = (got, want) if t in got else (want, got)
        assert any(abs(mine[t] - lp) < 1e-3 for u, lp in other.items() if u not in mine), (
            got,
            want,
        )


def compare(got: Answer, want: Answer, drawn: Drawn) -> None:
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert [lp is None for lp in got.logprobs] == [lp is None for lp in want.logprobs]
    assert [lp for lp in got.logprobs if lp is not None] == pytest.approx(
        [lp for lp in want.logprobs if lp is not None], abs=1e-3
    )
    if drawn.tokens_as_ids:
        assert got.tokens == want.tokens
        assert len(got.top) == len(want.top)
        for g, w in zip(got.top, want.top):
            same_entries(g, w)
    if not drawn.stream and drawn.num_prompt_logprobs() is not None:
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for g, w in zip(got.prompt_logprobs, want.prompt_logprobs):
            same_entries(g, w)


def check(drawn: Drawn, got: tuple[list[Answer], Usage], want: tuple[list[Answer], Usage]) -> None:
    """The gateway's answer (choices, usage) against the offline engine's."""
    assert [(a.text, a.finish_reason, a.stop_reason, a.tool_calls) for a in got[0]] == [
        (a.text, a.finish_reason, a.stop_reason, a.tool_calls) for a in want[0]
    ]
    assert [(a.token_ids, a.prompt_token_ids) for a in got[0]] == [
        (a.token_ids, a.prompt_token_ids) for a in want[0]
    ]
    assert got[1] == want[1]
    for g, w in zip(got[0], want[0]):
        compare(g, w, drawn)


def property_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@property_settings(EXAMPLES)
@seed(SEED)
@given(drawn=requests())
def test_a_drawn_request_gets_the_offline_engines_answer(routers, llm, drawn: Drawn) -> None:  # type: ignore[no-untyped-def]
    note(repr(drawn))
    check(drawn, asked(routers[drawn.route], drawn), expected(llm, drawn))


@property_settings(max(EXAMPLES // 4, 1))
@seed(SEED)
@given(batch=st.lists(requests(), min_size=2, max_size=4))
def test_drawn_requests_sent_together_get_the_offline_engines_answers(routers, llm, batch) -> None:  # type: ignore[no-untyped-def]
    """Requests in flight together share the workers' steps: rows with different sampling,
    penalties, biases, grammars and logprobs in one batch; each must still get the answer the
    offline engine gives it alone."""
    note(repr(batch))
    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda drawn: asked(routers[drawn.route], drawn), batch))
    for drawn, got in zip(batch, answers):
        check(drawn, got, expected(llm, drawn))
