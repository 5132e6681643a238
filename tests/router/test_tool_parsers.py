"""Tool calls read back from text: each chat format's parser on outputs as the models write them
(Hermes 2 Pro / Qwen 2.5's ``<tool_call>`` blocks, Llama 3.1/3.2's JSON), malformed ones
returned as text, and the streamed deltas of every tool_choice adding up to the whole answer
whatever the pieces the text arrives in."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from router.errors import APIError
from router.tool_calls import ToolDefinition, plan_tools
from router.tool_output import ToolOutput
from router.tool_parsers import PARSERS, HermesParser, Llama3JsonParser, ParsedCall, parser_for

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    ToolDefinition.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    ),
    ToolDefinition.model_validate({"type": "function", "function": {"name": "get_time"}}),
]

# ----- recorded outputs -----------------------------------------------------------------------
QWEN_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)
QWEN_TWO = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {}}\n</tool_call>'
)
HERMES_UNCLOSED = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_TAGGED = '<|python_tag|>{"name": "get_time", "parameters": {}}'
LLAMA_TWO = (
    '{"name": "get_time", "parameters": {}}; '
    '{"name": "get_weather", "parameters": {"city": "Rome"}}'
)


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (HermesParser(), QWEN_ONE, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        (
            HermesParser(),
            QWEN_TWO,
            "Let me check both.\n",
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
        (HermesParser(), HERMES_UNCLOSED, None, [("get_weather", {"city": "Oslo"})]),
        (
            HermesParser(),  # arguments written as JSON text
            '<tool_call>{"name": "get_weather", '
            '"arguments": "{\\"city\\": \\"Nice\\"}"}</tool_call>',
            None,
            [("get_weather", {"city": "Nice"})],
        ),
        (
            Llama3JsonParser(),
            LLAMA_ONE,
            None,
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
        ),
        (Llama3JsonParser(), LLAMA_TAGGED, None, [("get_time", {})]),
        (
            Llama3JsonParser(),
            "  " + LLAMA_TWO,
            None,
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
    ],
)
def test_recorded_calls_parse(parser, text, content, calls):  # type: ignore[no-untyped-def]
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), "The weather in Paris is sunny."),
        (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
        (HermesParser(), '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>'),  # no name
        (HermesParser(), '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'),
        (HermesParser(), QWEN_ONE + '<tool_call>{"name": get_time}</tool_call>'),  # one is bad
        (HermesParser(), "<tool_call></tool_call>"),
        (Llama3JsonParser(), "Paris is sunny today."),
        (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": '),
        (Llama3JsonParser(), '{"city": "Paris"}'),  # JSON, not a call
        (Llama3JsonParser(), LLAMA_ONE + " and then some words"),
        (Llama3JsonParser(), "<|python_tag|>print('hi')"),
        (HermesParser(), "<tool_call>" + "[" * 100_000),  # deeper than json reads
        (Llama3JsonParser(), "{" + '"a":{' * 100_000),
    ],
)
def test_malformed_output_is_text(parser, text):  # type: ignore[no-untyped-def]
    parsed = parser.parse(text)
    assert parsed.content == text and parsed.calls == []


def test_the_default_parser_follows_the_chat_template():  # type: ignore[no-untyped-def]
    assert parser_for("auto", None).name == "hermes"
    assert parser_for("auto", "{{ '<tool_call>' }}{{ tools | tojson }}").name == "hermes"
    llama = 'Respond in the format {"name": function name, "parameters": dictionary}'
    assert parser_for("auto", llama).name == "llama3_json"
    assert parser_for("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for("hermes", llama).name == "hermes"


# ----- whole and streamed answers -------------------------------------------------------------
def streamed(
    output: ToolOutput, text: str, size: int, finish: str = "stop"
) -> tuple[dict[str, Any], str | None]:
    """``text`` streamed in pieces of ``size`` characters, its deltas added up as the openai
    client does; ``finish``: the workers' finish reason."""
    stream = output.stream()
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i : i + size])
    last, reason = stream.finish(finish)
    content, calls = None, {}  # type: ignore[var-annotated]
    for delta in deltas + last:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            assert ("id" in call) == (call["index"] not in calls)  # the first delta opens it
            into = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            into["name"] += call["function"].get("name", "")
            into["arguments"] += call["function"].get("arguments", "")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, reason


def whole(output: ToolOutput, text: str, finish: str = "stop") -> tuple[dict[str, Any], str | None]:
    message, reason = output.message(text, finish)
    calls = [c["function"] for c in message.get("tool_calls", [])]
    assert all(c["id"].startswith("call_") for c in message.get("tool_calls", []))
    return {"content": message["content"], "calls": calls}, reason


CASES = [
    ("auto", "hermes", QWEN_TWO, 2),
    ("auto", "hermes", "No tool needed: 4 < 5, and <tool is not a tag.", 0),
    ("auto", "hermes", "Checking.<tool_call>{bad json}</tool_call>", 0),
    ("auto", "hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', 0),  # unknown
    ("auto", "llama3_json", LLAMA_TWO, 2),
    ("auto", "llama3_json", "Sure: " + LLAMA_TAGGED, 1),
    ("auto", "llama3_json", "<|python", 0),
    ("required", "hermes", '[{"name": "get_time", "arguments": {}}]', 1),
    ("required", "hermes", '[{"name": "get_time", "argu', 0),  # cut by max_tokens
    ("named", "hermes", '{"city": "Paris"}', 1),
    ("named", "hermes", '{"city": "Par', 1),  # cut: still the call, as it was streamed
]


@pytest.mark.parametrize(("choice", "parser", "text", "num_calls"), CASES)
def test_streamed_deltas_add_up_to_the_whole_answer(choice, parser, text, num_calls):  # type: ignore[no-untyped-def]
    tool_choice = (
        choice if choice != "named" else {"type": "function", "function": {"name": "get_weather"}}
    )
    plan = plan_tools(TOOLS, tool_choice, None, None)
    output = ToolOutput(plan, PARSERS[parser])
    expected, reason = whole(output, text)
    assert len(expected["calls"]) == num_calls
    # OpenAI's finish reasons: a forced (named) function ends with "stop", as vllm serve's
    assert reason == ("tool_calls" if num_calls and choice != "named" else "stop")
    if choice == "named":  # the text is the arguments, whole or cut
        assert expected == {"content": None, "calls": [{"name": "get_weather", "arguments": text}]}
    elif num_calls:
        assert all(isinstance(json.loads(c["arguments"]), dict) for c in expected["calls"])
    else:
        assert expected["content"] == text  # not a call: the text as it came
    for size in (1, 2, 3, 7, len(text)):
        got, got_reason = streamed(output, text, size)
        assert got == {
            "content": expected["content"],
            "calls": [{"name": c["name"], "arguments": c["arguments"]} for c in expected["calls"]],
        }, size
        assert got_reason == reason


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_named_call_keeps_the_workers_finish_reason(finish):  # type: ignore[no-untyped-def]
    """Cut by ``max_tokens`` ("length") or not, whole or streamed: the call, and the reason the
    workers gave (OpenAI's API answers a forced function with "stop", not "tool_calls")."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    output = ToolOutput(plan_tools(TOOLS, named, None, None), PARSERS["hermes"])
    text = '{"city": "Paris"}' if finish == "stop" else '{"city": "Pa'
    call = [{"name": "get_weather", "arguments": text}]
    assert whole(output, text, finish) == ({"content": None, "calls": call}, finish)
    assert streamed(output, text, 3, finish) == ({"content": None, "calls": call}, finish)
    assert whole(output, "", finish) == ({"content": "", "calls": []}, finish)  # no text: none


def test_required_and_named_grammars_accept_valid_calls_only():  # type: ignore[no-untyped-def]
    required = plan_tools(TOOLS, "required", False, None).structured_output()
    assert required is not None
    schema = json.loads(required.spec)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}], schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {}}],  # city is required
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}],  # one call
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = plan_tools(TOOLS, named, None, None).structured_output()
    assert spec is not None and json.loads(spec.spec) == WEATHER
    assert plan_tools(TOOLS, "auto", None, None).structured_output() is None


def test_a_grammar_of_the_request_cannot_join_a_forced_call():  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as error:
        plan_tools(TOOLS, "required", None, "response_format")
    assert error.value.param == "response_format"
    assert plan_tools(TOOLS, "auto", None, "response_format").mode == "auto"


def test_parsed_call_arguments_are_json_text():  # type: ignore[no-untyped-def]
    [call] = HermesParser().parse(QWEN_ONE).calls
    assert call == ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
