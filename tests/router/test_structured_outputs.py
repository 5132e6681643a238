"""Structured outputs through the gateway, as users call them: the official ``openai`` client,
a real router, prefill and decode workers. Hypothesis generates JSON schemas (nested objects,
arrays, enums, bounded numbers, required fields) and regexes; each is sampled at temperature 1
on the disaggregated route (the prefill worker samples the first token under the mask, the
decode worker rebuilds the grammar's state and continues) and on the local route (the decode
worker computes the prompt). Every answer validates, and the same seed gives the same answer
on both routes.

``PDSERVE_STRUCTURED_EXAMPLES`` sets how many examples each property runs (default 12, to keep
``make test`` short; the figure of a longer run is in docs/structured_outputs.md).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.cluster import MODEL, Cluster, Router, own_routers

EXAMPLES = int(os.environ.get("PDSERVE_STRUCTURED_EXAMPLES", "12"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: make test is repeatable
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAX_TOKENS = 96  # the schemas below are bounded well within it


@pytest.fixture(scope="module")
def routers(pd_pair: Cluster) -> Iterator[tuple[Router, Router]]:
    """One prefill and one decode worker (the shared pair); a router that always disaggregates
    and one that computes every prompt on the decode worker."""
    with own_routers(pd_pair) as c:
        remote = c.add_router()
        local = c.add_router("--disaggregation", "conditional", "--local-prefill-tokens", "4096")
        remote.wait_ready(num_workers=2)
        local.wait_ready(num_workers=2)
        yield remote, local


# ----- generated schemas ----------------------------------------------------------------------
NAMES = st.sampled_from(["id", "name", "tags", "size", "kind", "ok", "price", "items"])
WORDS = st.text("abcxyz", min_size=1, max_size=4)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    number = st.tuples(st.integers(-10, 10), st.integers(1, 20)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    string = st.integers(1, 6).map(lambda k: {"type": "string", "maxLength": k})
    enum = st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda e: {"enum": e})
    boolean = st.just({"type": "boolean"})
    return st.one_of(integer, number, string, enum, boolean)


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    array = st.tuples(children, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
    )
    return st.one_of(array, _object(children))


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(NAMES, children, min_size=1, max_size=3)
    return props.flatmap(
        lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
            lambda req: {
                "type": "object",
                "properties": p,
                "required": req,
                "additionalProperties": False,
            }
        )
    )


SCHEMAS = _object(st.recursive(_leaf(), _extend, max_leaves=5))

# ----- generated regexes ----------------------------------------------------------------------
ATOMS = st.one_of(
    st.sampled_from(list("abcxyz019-")),
    st.sampled_from([r"[a-f]", r"[0-9]", r"\d", r"[A-Z]", r"(yes|no)", r"(ab|cd|ef)"]),
)
QUANTIFIED = st.tuples(ATOMS, st.sampled_from(["", "?", "{1,3}", "{2}", "{0,2}"])).map(
    lambda t: t[0] + t[1]
)
REGEXES = st.lists(QUANTIFIED, min_size=1, max_size=6).map("".join)


def timing(response: Any) -> str:
    [entry] = response.usage.model_extra["pdserve_timings"]
    return str(entry["kv_source"])


def chat_json(router: Router, schema: dict[str, Any], seed: int) -> Any:
    return router.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        temperature=1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
    )


@PROPERTY
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_generated_schemas_validate_and_a_seed_gives_one_answer_on_both_routes(  # type: ignore[no-untyped-def]
    routers, schema, seed
):
    remote, local = routers
    answers = []
    for router, source in ((remote, "pulled"), (local, "local")):
        response = chat_json(router, schema, seed)
        assert timing(response) == source
        [choice] = response.choices
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        answers.append(choice.message.content)
    assert answers[0] == answers[1]


@PROPERTY
@given(pattern=REGEXES, seed=st.integers(0, 2**31))
def test_generated_regexes_match_and_a_seed_gives_one_answer_on_both_routes(  # type: ignore[no-untyped-def]
    routers, pattern, seed
):
    remote, local = routers
    answers = []
    for router in routers:
        response = router.client().completions.create(
            model=MODEL,
            prompt="A code:",
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        [choice] = response.choices
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.text), choice.text
        answers.append(choice.text)
    assert answers[0] == answers[1]


def test_json_object_choice_and_grammar_streamed(routers):  # type: ignore[no-untyped-def]
    remote, _ = routers
    client = remote.client()
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": '{"name": "Bob"} is JSON. Another one:'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    for extra, allowed in (
        ({"choice": ["left", "right"]}, {"left", "right"}),
        ({"grammar": 'root ::= ("yes" | "no") "!"'}, {"yes!", "no!"}),
    ):
        response = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            n=4,
            seed=3,
            max_tokens=8,
            extra_body={"structured_outputs": extra},
        )
        assert {c.text for c in response.choices} <= allowed


@pytest.mark.parametrize("route", ["remote", "local"])
def test_logprobs_under_a_choice_are_over_what_it_allows(routers, route):  # type: ignore[no-untyped-def]
    """vLLM's logprobs under a grammar: the model's, over the tokens the grammar allows. Every
    alternative shown continues a choice (or is EOS after a whole one), the others show as
    JSON's -9999.0 (not -inf, which JSON cannot carry), and EOS after a whole choice, the only
    token allowed there, has logprob 0; on the prefill worker's first token and the decode
    worker's later ones alike."""
    choices, eos = [" yes", " no"], "<|im_end|>"
    client = routers[0 if route == "remote" else 1].client()
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL,
            prompt="Is Paris in France? Answer:",
            max_tokens=8,
            temperature=0,
            logprobs=4,
            stream=stream,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        chunks = list(response) if stream else [response]
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        tops = [top for c in chunks for top in c.choices[0].logprobs.top_logprobs]
        assert "".join(tokens[:-1]) in choices and tokens[-1] == eos, tokens
        text = ""
        for token, top in zip(tokens, tops):
            for alternative, logprob in top.items():
                if logprob > -9999.0:
                    allowed = alternative == eos and text in choices
                    assert allowed or any(c.startswith(text + alternative) for c in choices)
            text += token
        assert tops[-1][eos] == 0.0 and set(tops[-1].values()) == {0.0, -9999.0}, tops[-1]


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        {"structured_outputs": {"structural_tag": {}}},
        {"structured_outputs": {"regex": "[a-"}},  # refused by the worker's compiler
        {"structured_outputs": {"grammar": "root ::= nowhere"}},
    ],
)
def test_a_bad_spec_is_a_400(routers, body):  # type: ignore[no-untyped-def]
    remote, _ = routers
    with pytest.raises(openai.BadRequestError):
        remote.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body=body,
        )


# ----- a grammar the vocabulary cannot write ---------------------------------------------------
DEAD_END_MESSAGE = "the structured output cannot be completed with this model's vocabulary"


@pytest.mark.parametrize("route", ["disaggregated", "local"])
def test_a_dead_end_at_the_first_token_is_a_400(routers, route):  # type: ignore[no-untyped-def]
    """The choice starts with a character no token can write (U+0004): nothing is generated, and
    the client gets a 400 naming why, streamed or not; on the disaggregated route the prefill
    worker found it, and nothing stays pinned."""
    remote, local = routers
    client = (remote if route == "disaggregated" else local).client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=DEAD_END_MESSAGE) as raised:
            client.completions.create(
                model=MODEL,
                prompt="Say it:",
                max_tokens=8,
                stream=stream,
                extra_body={"structured_outputs": {"choice": ["\x04!"]}},
            )
        assert raised.value.code == "grammar_dead_end"


@pytest.mark.parametrize("route", ["disaggregated", "local"])
def test_a_dead_end_after_some_output_ends_the_request_with_an_error(routers, route):  # type: ignore[no-untyped-def]
    """What can be written comes first ('ab cd'), then no token can go on (U+0006): not
    streamed, a 400; streamed, the text so far and then an error event. (Before, the mask was
    dropped there and free text followed, with finish_reason "length".)"""
    remote, local = routers
    client = (remote if route == "disaggregated" else local).client()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say it:"}],
        "max_tokens": 12,
        "extra_body": {"structured_outputs": {"choice": ["ab cd\x06!"]}},
    }
    with pytest.raises(openai.BadRequestError, match=DEAD_END_MESSAGE):
        client.chat.completions.create(**body)
    text = ""
    with pytest.raises(openai.APIError, match=DEAD_END_MESSAGE):
        for chunk in client.chat.completions.create(**body, stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == "ab cd"
