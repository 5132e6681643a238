"""Tool calls through the gateway, as users make them: the official ``openai`` client, a real
router, prefill and decode workers. The tool-calling flow (call -> tool result -> final answer)
runs streamed and not, on the disaggregated route (prefill worker then decode worker) and the
local one (the decode worker computes the prompt):

- ``required`` and a named function: the workers constrain the output, so the small test model
  makes a call whose arguments validate against the tool's schema every time;
- ``auto``: the model's text read by the Hermes parser. The test model writes no tool calls of
  its own, so its answers are steered with a regex (a structured output of the request, which
  ``auto`` allows): a well-formed ``<tool_call>`` block becomes a call, a malformed one and
  plain text stay text.

Bad ``tools`` / ``tool_choice`` are 400s naming the field; no KV block is left behind. The chat
template's rendering of tools, calls and tool results is compared with transformers'.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from services.engine.tokenizer import Tokenizer
from tests.router.cluster import MODEL, Cluster, Router, own_routers

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} somewhere", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
QUESTION: Any = {"role": "user", "content": "What is the weather in Paris?"}
MAX_TOKENS = 64
HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", '
    r'"arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def routers(
    pd_pair: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Router]]:
    """One prefill and one decode worker (the shared pair); a router that always disaggregates
    ("pulled", the model's own template: no tools shown) and one that computes every prompt on
    the decode worker ("local", a template that shows tools, calls and results: TEMPLATE)."""
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    with own_routers(pd_pair) as c:
        remote = c.add_router()
        local = c.add_router(
            "--disaggregation",
            "conditional",
            "--local-prefill-tokens",
            "4096",
            "--chat-template",
            str(template),
        )
        remote.wait_ready(num_workers=2)
        local.wait_ready(num_workers=2)
        yield {"pulled": remote, "local": local}


def ask(router: Router, route: str, stream: bool, **kwargs: Any) -> tuple[dict[str, Any], str]:
    """One chat completion, streamed or not, as (message dict, finish reason), checking that it
    went the ``route`` way."""
    client = router.client()
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 1.0, **kwargs}
    if not stream:
        response = client.chat.completions.create(**body)
        [timing] = response.usage.model_extra["pdserve_timings"]
        assert timing["kv_source"] == route
        [choice] = response.choices
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    chunks = list(
        client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    )
    [timing] = chunks[-1].usage.model_extra["pdserve_timings"]
    assert timing["kv_source"] == route
    return accumulate(chunks)


def accumulate(chunks: list[Any]) -> tuple[dict[str, Any], str]:
    """A stream's deltas added up into a message, as applications do."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    reasons = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in calls:  # the first delta of a call has its id and name
                    assert call.id.startswith("call_") and call.type == "function"
                    calls[call.index] = {"id": call.id, "type": "function", "name": "", "args": ""}
                calls[call.index]["name"] += call.function.name or ""
                calls[call.index]["args"] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert len(reasons) == 1
    message: dict[str, Any] = {"role": "assistant"}
    if content is not None:
        message["content"] = content
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["args"]},
            }
            for _, c in sorted(calls.items())
        ]
    return message, reasons[0]


def check_calls(
    message: dict[str, Any],
    reason: str,
    names: set[str],
    content: str | None = None,
    finish_reason: str = "tool_calls",
) -> list[dict[str, Any]]:
    """Calls of tools in ``names`` whose arguments validate against the tool's schema, after
    ``content``; the choice ended with ``finish_reason``."""
    assert reason == finish_reason, message
    assert message.get("content") == content and message["tool_calls"], message
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
    return list(message["tool_calls"])


def tool_results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": "sunny, 21"})}
        for c in calls
    ]


def final_answer(router: Router, route: str, stream: bool, history: list[Any]) -> None:
    """The answer after the tool results: text, from a prompt that holds them."""
    message, reason = ask(  # greedy: a sampled end-of-text as the first token is no answer
        router,
        route,
        stream,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert reason in ("stop", "length") and isinstance(message.get("content"), str)
    assert "tool_calls" not in message


NAMED = {"type": "function", "function": {"name": "get_time"}}
STEER_CALL = {"structured_outputs": {"regex": "Let me look\\. " + HERMES_CALL}}
FLOWS = [  # each tool_choice on both routes, whole and streamed
    ("required", "pulled", False),
    ("required", "pulled", True),
    ("required", "local", False),
    ("required", "local", True),
    ("named", "pulled", True),
    ("named", "local", False),
    ("auto", "pulled", False),
    ("auto", "local", True),
]


@pytest.mark.parametrize(("choice", "route", "stream"), FLOWS)
def test_call_then_tool_result_then_answer(routers, choice, route, stream):  # type: ignore[no-untyped-def]
    router = routers[route]
    asked: dict[str, Any] = {  # type: ignore[assignment]
        "required": {"tool_choice": "required", "parallel_tool_calls": False},
        "named": {"tool_choice": NAMED},
        "auto": {"extra_body": STEER_CALL, "max_tokens": 160, "temperature": 0},  # the default
    }[choice]
    message, reason = ask(router, route, stream, messages=[QUESTION], tools=TOOLS, seed=3, **asked)
    names = {"get_time"} if choice == "named" else set(SCHEMAS)
    # auto: the Hermes parser read the call the model wrote, after its words
    content = "Let me look. " if choice == "auto" else None
    # OpenAI's API ends a forced (named) function's call with "stop", as vllm serve does
    finish_reason = "stop" if choice == "named" else "tool_calls"
    calls = check_calls(message, reason, names, content, finish_reason)
    assert len(calls) == 1
    final_answer(router, route, stream, [QUESTION, message, *tool_results(calls)])


def test_one_required_call_per_choice_of_n(routers):  # type: ignore[no-untyped-def]
    """``parallel_tool_calls: false``: one call each (left on, a model as small as this one
    repeats calls until max_tokens: the array's length is its choice)."""
    response = (
        routers["local"]
        .client()
        .chat.completions.create(
            model=MODEL,
            messages=[QUESTION],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            n=3,
            seed=7,
            max_tokens=MAX_TOKENS,
        )
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        message = choice.message.model_dump(exclude_none=True)
        assert len(check_calls(message, choice.finish_reason, set(SCHEMAS))) == 1


@pytest.mark.parametrize(
    ("regex", "stream"),
    [
        (r"It is sunny( today)?\.", False),  # no call: plain text
        (r'<tool_call>\{"name": get_weather\}</tool_call>', False),  # malformed: text, no 500
        (r'<tool_call>\{"name": get_weather\}</tool_call>', True),
        (r'<tool_call>\{"name": "launch", "arguments": \{\}\}</tool_call>', True),  # unknown
    ],
)
def test_auto_returns_text_that_is_no_call_as_content(routers, regex, stream):  # type: ignore[no-untyped-def]
    message, reason = ask(
        routers["pulled"],
        "pulled",
        stream,
        messages=[QUESTION],
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert reason == "stop" and "tool_calls" not in message
    assert re.fullmatch(regex, message["content"]), message


def test_auto_without_steering_answers_well_formed(routers):  # type: ignore[no-untyped-def]
    """The test model's own answer (text, as it knows no tools), through the parser."""
    message, reason = ask(
        routers["local"], "local", True, messages=[QUESTION], tools=TOOLS, max_tokens=16
    )
    assert reason in ("stop", "length") and isinstance(message["content"], str)


BAD = [
    ({"tools": []}, "tools", "empty array"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools.0.function.name",
        "letters, digits",
    ),
    ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "duplicate"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools.0.function.parameters",
        "Invalid schema for function 'f'",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}
            ]
        },
        "tools.0.function.parameters",
        "'required' must be an array",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
        "tools",
        "lone surrogate",
    ),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "no function named 'nope'",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "tool_choice.function.name",
        "required",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "cannot be combined",
    ),
    (
        {"messages": [QUESTION, {"role": "tool", "content": "21"}]},
        "messages.1.tool_call_id",
        "required",
    ),
    (
        {"messages": [QUESTION, {"role": "tool", "tool_call_id": "\udfff", "content": "21"}]},
        "messages.1.tool_call_id",
        "lone surrogate",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ]
        },
        "messages.0.tool_calls",
        "only assistant",
    ),
    (  # a schema the workers' grammar compiler refuses, found when it is used
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        None,
        "",
    ),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD)
def test_bad_tools_and_tool_choice_are_400s_naming_the_field(routers, body, param, words):  # type: ignore[no-untyped-def]
    request = {"model": MODEL, "messages": [QUESTION], "max_tokens": 4, **body}
    response = httpx.post(  # JSON as sent by hand: lone surrogates escaped, as clients may
        routers["pulled"].url + "/v1/chat/completions",
        content=json.dumps(request),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["type"] == "invalid_request_error"
    if param is not None:
        assert body["param"] == param, body
    assert words in body["message"], body


TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>tool
{{ message.tool_call_id }}: {{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def transformers_render(messages: list[Any], tools: list[Any] | None) -> str:
    """What transformers renders with TEMPLATE (the reference for ours)."""
    from transformers import PreTrainedTokenizerFast

    from services.engine.model.source import resolve_model_dir

    source = resolve_model_dir(None, Path.home() / ".cache" / "pdserve", convert_in_child=True)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    return str(
        reference.apply_chat_template(
            messages,
            tools=tools,
            chat_template=TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
        )
    )


def test_tools_calls_and_results_render_as_transformers_renders_them(tmp_path):  # type: ignore[no-untyped-def]
    """A tools-aware template (Hermes-style) gets what transformers gives it: the tools, the
    assistant's calls with their arguments as objects, the tool results with their ids."""
    from router.protocol import ChatCompletionRequest
    from services.engine.model.source import resolve_model_dir

    source = resolve_model_dir(None, Path.home() / ".cache" / "pdserve", convert_in_child=True)
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    arguments = {"city": "Paris <3", "unit": "celsius"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    sent = {**call, "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [QUESTION, {"role": "assistant", "tool_calls": [sent]}, result],
            "tools": TOOLS,
        }
    )
    ours = Tokenizer(tmp_path).apply_chat_template(
        request.template_messages(), tools=request.tool_plan().template_tools
    )
    # transformers takes the arguments as an object (what vLLM hands it too)
    given = {**call, "function": {"name": "get_weather", "arguments": arguments}}
    theirs = transformers_render(
        [QUESTION, {"role": "assistant", "content": "", "tool_calls": [given]}, result], TOOLS
    )
    assert ours == theirs
    assert '"city": "Paris <3"' in ours and '"name": "get_time"' in ours
    assert ours.endswith("call_1: sunny<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_may_refuse_a_conversation_and_read_the_date(tmp_path):  # type: ignore[no-untyped-def]
    """raise_exception and strftime_now, as transformers gives them (Llama 3's templates)."""
    from services.engine.model.source import resolve_model_dir

    source = resolve_model_dir(None, Path.home() / ".cache" / "pdserve", convert_in_child=True)
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ strftime_now('%Y') }}: {{ messages[0].content }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = Tokenizer(tmp_path)
    assert (
        tokenizer.apply_chat_template([QUESTION]) == f"{datetime.now().year}: {QUESTION['content']}"
    )
    with pytest.raises(ValueError, match="one message only"):
        tokenizer.apply_chat_template([QUESTION, QUESTION])


def test_the_prompt_holds_the_tools_where_the_template_shows_them(routers):  # type: ignore[no-untyped-def]
    """The local router's template shows the tools (as many prompt tokens as transformers'
    rendering has), none of them with tool_choice none; the model's own template shows none."""
    from transformers import PreTrainedTokenizerFast

    from services.engine.model.source import resolve_model_dir

    def prompt_tokens(router: Router, **kwargs: Any) -> int:
        response = router.client().chat.completions.create(
            model=MODEL, messages=[QUESTION], max_tokens=1, **kwargs
        )
        assert response.usage is not None
        return response.usage.prompt_tokens

    source = resolve_model_dir(None, Path.home() / ".cache" / "pdserve", convert_in_child=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    expected = len(
        tokenizer.encode(transformers_render([QUESTION], TOOLS), add_special_tokens=False)
    )
    local, pulled = routers["local"], routers["pulled"]
    assert prompt_tokens(local, tools=TOOLS) == expected
    assert prompt_tokens(local, tools=TOOLS, tool_choice="none") < expected
    assert prompt_tokens(pulled, tools=TOOLS) == prompt_tokens(pulled)
