"""Structured outputs hold on every route a prompt can take, and a seeded request gives the same
constrained tokens on each: local, pulled, streamed, and recomputed after a failed pull (the
decode engine rebuilds the grammar's state from the prefill engine's first token).

The in-process prefill/decode pair of test_seed_routes; temperature 1, so every token is a draw
the mask had to constrain.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams, StructuredOutput
from services.engine.grammar import GrammarError
from services.engine.llm_engine import LLMEngine
from tests.conftest import assert_no_leaks
from tests.engine.test_handoff import run_until_done
from tests.engine.test_seed_routes import ROUTES, disaggregated, local, new_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2,3}"
CHOICES = ["red", "green", "blue"]
CASES = {  # name -> (prompt, structured, n); json_object greedy: free JSON can run past max_tokens
    "schema": ("A person as JSON:", StructuredOutput("json_schema", json.dumps(SCHEMA)), 1),
    "schema-n3": ("Describe a pet owner:", StructuredOutput("json_schema", json.dumps(SCHEMA)), 3),
    "object": ('{"name": "Bob"} is JSON. Another one:', StructuredOutput("json_object"), 1),
    "regex": ("A code:", StructuredOutput("regex", REGEX), 2),
    "choice": ("A colour:", StructuredOutput("choice", json.dumps(CHOICES)), 1),
    "grammar": ("Yes or no?", StructuredOutput("grammar", 'root ::= ("yes" | "no") "!"'), 1),
}


def valid(structured: StructuredOutput, text: str) -> bool:
    if structured.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if structured.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if structured.kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if structured.kind == "choice":
        return text in CHOICES
    return text in ("yes!", "no!")


LOCAL: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    prefill, decode = new_engine(), new_engine()
    yield prefill, decode
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(CASES))
def test_constrained_tokens_are_valid_and_the_same_on_every_route(engines, case, route):  # type: ignore[no-untyped-def]
    prompt, structured, n = CASES[case]
    p_engine, d_engine = engines
    temperature = 0.0 if structured.kind == "json_object" else 1.0
    params = SamplingParams(
        n=n, temperature=temperature, seed=11, max_tokens=40, structured=structured
    )
    ids = d_engine.tokenizer.encode(prompt)
    if case not in LOCAL:  # the local route's answer, once per case
        LOCAL[case] = local(d_engine, f"local-{case}", ids, params)
        for tokens in LOCAL[case]:
            assert valid(structured, d_engine.tokenizer.decode(tokens)), tokens
    want = LOCAL[case]
    got = disaggregated(engines, f"{route}-{case}", ids, params, route)
    assert got == want
    assert_no_leaks(p_engine)
    assert_no_leaks(d_engine)


def test_a_grammar_is_compiled_once_per_spec(engines):  # type: ignore[no-untyped-def]
    _, engine = engines
    spec = StructuredOutput("regex", "[0-9]{4}")
    before = engine.grammars.compiles
    for i in range(3):
        local(
            engine,
            f"once-{i}",
            engine.tokenizer.encode("A year:"),
            SamplingParams(seed=i, max_tokens=8, structured=spec),
        )
    assert engine.grammars.compiles == before + 1


@pytest.mark.parametrize("route", ["local", *ROUTES])
def test_a_stop_token_id_may_close_a_complete_structured_output(engines, route):  # type: ignore[no-untyped-def]
    """As vLLM's: where the grammar may end it allows the request's stop_token_ids beside EOS.
    "\n" (biased up, and no character of the choices) cannot come before a choice is whole;
    after it, it ends the sequence when it is a stop token id, and only EOS can otherwise."""
    _, engine = engines
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)
    spec = StructuredOutput("choice", json.dumps(["yes", "no"]))
    ids = engine.tokenizer.encode("Is it? Answer:")
    [eos] = engine.tokenizer.eos_token_ids
    for stops, last in (([], eos), (newline, newline[0])):
        params = SamplingParams(
            temperature=0,
            max_tokens=8,
            stop_token_ids=stops,
            logit_bias={newline[0]: 10.0},
            structured=spec,
        )
        rid = f"stop-closes-{route}-{len(stops)}"
        if route == "local":
            (tokens,) = local(engine, rid, ids, params)
        else:
            (tokens,) = disaggregated(engines, rid, ids, params, route)
        assert engine.tokenizer.decode(tokens[:-1]) in ("yes", "no") and tokens[-1] == last
    assert_no_leaks(engine)


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput("regex", "[a-"),
        StructuredOutput("grammar", "root ::= undefined_rule"),
        StructuredOutput("choice", "[]"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_nothing_allocated(engines, structured):  # type: ignore[no-untyped-def]
    _, engine = engines
    params = SamplingParams(max_tokens=4, structured=structured)
    with pytest.raises(GrammarError, match=rf"^the {structured.kind} does not compile: \w") as e:
        engine.add_request("bad-spec", engine.tokenizer.encode("x"), params)
    assert ".cc:" not in str(e.value), "the grammar engine's C++ source is no user's business"
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Not: unassigned code points (planes 4-11 start with bytes 0xF1 / 0xF2) and control characters
# (0x04, 0x06, ...): SmolLM2's vocabulary has no token for some of their bytes, so no output can
# hold them; surrogates are not text.
@given(choice=st.text(st.characters(exclude_categories=("Cs", "Cn", "Cc")), min_size=1, max_size=6))
@example(choice="ab🤖c")  # four bytes a character: escaped, a surrogate pair (ED A0 BE ED B4 96)
@example(choice='"\\\n\x00日')
def test_any_single_choice_is_produced_exactly(engines, choice: str) -> None:  # type: ignore[no-untyped-def]
    """A choice is produced as written, whatever its characters: beyond the BMP, quotes,
    backslashes, control characters. (Escaped as JSON with ``ensure_ascii``, a character beyond
    the BMP became two surrogates, and 'ab🤖c' came out as 'ab' + six U+FFFD + 'c'.)"""
    _, engine = engines
    spec = StructuredOutput("choice", json.dumps([choice]))
    params = SamplingParams(seed=3, max_tokens=4 * len(choice) + 2, structured=spec)
    rid = f"choice-{len(choice)}-{abs(hash(choice))}"
    (tokens,) = local(engine, rid, engine.tokenizer.encode("Say it:"), params)
    assert engine.tokenizer.decode(tokens) == choice
    assert_no_leaks(engine)


# Characters SmolLM2's vocabulary cannot write: a control character whose byte no token holds,
# and code points of the unassigned planes 4-11 (their first byte, 0xF1 or 0xF2, is in no token).
UNWRITABLE = ["\x04", "\x06", "\x13", "\U00040000", "\U000a1234"]


def dead_end_choice(prefix: str, tail: str) -> StructuredOutput:
    return StructuredOutput("choice", json.dumps([prefix + tail + "!"]))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefix=st.text(string.ascii_letters + string.digits + " ", max_size=5),
    tail=st.sampled_from(UNWRITABLE),
    n=st.integers(1, 2),
)
@example(prefix="", tail="\x04", n=1)  # a dead end at the first token
@example(prefix="ab", tail="\U00040000", n=2)  # forks: their masks are made at sampling time
def test_a_grammar_the_vocabulary_cannot_write_ends_at_its_dead_end(  # type: ignore[no-untyped-def]
    engines, prefix: str, tail: str, n: int
) -> None:
    """Every token of what can be written comes out, then the sequence ends with
    ``grammar_dead_end`` and nothing after it. (The grammar's mask had allowed no token there:
    the sampler took token 0, the matcher dropped its mask, and the rest of the output came
    out unconstrained, with ``finish_reason: "length"``.)"""
    _, engine = engines
    params = SamplingParams(
        n=n, seed=7, max_tokens=len(prefix) + 8, structured=dead_end_choice(prefix, tail)
    )
    rid = f"dead-end-{n}-{abs(hash(prefix + tail))}"
    engine.add_request(rid, engine.tokenizer.encode("Say it:"), params)
    out = run_until_done(engine, rid)
    assert [(o.text, o.finish_reason) for o in out.outputs] == [(prefix, "grammar_dead_end")] * n
    assert_no_leaks(engine)


def test_a_dead_end_at_the_prefill_workers_first_token_pins_nothing_for_long(engines):  # type: ignore[no-untyped-def]
    """The prefill worker's first token is the dead end: no token, the finish reason, and the
    pinned blocks go when the worker releases them (its service does so at once)."""
    p_engine, _ = engines
    ids = p_engine.tokenizer.encode("Say it:")
    params = SamplingParams(max_tokens=8, structured=dead_end_choice("", "\x04"))
    p_engine.add_request("dead-end-first", ids, params, True)
    out = run_until_done(p_engine, "dead-end-first")
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == ([], "grammar_dead_end")
    assert p_engine.release_pinned("dead-end-first")
    assert_no_leaks(p_engine)


@pytest.mark.parametrize("route", ROUTES)
def test_a_dead_end_on_the_decode_worker_is_the_same_on_every_route(engines, route):  # type: ignore[no-untyped-def]
    """The prefill worker writes the first token; the decode worker, whichever way it got the
    prompt's KV, writes the rest and stops at the same dead end."""
    p_engine, d_engine = engines
    ids = d_engine.tokenizer.encode("Say it:")
    params = SamplingParams(seed=2, max_tokens=12, structured=dead_end_choice("ab cd", "\x06"))
    want = local(d_engine, f"dead-end-local-{route}", ids, params)
    assert d_engine.tokenizer.decode(want[0]) == "ab cd"
    assert disaggregated(engines, f"dead-end-{route}", ids, params, route) == want
    assert_no_leaks(p_engine)
    assert_no_leaks(d_engine)
