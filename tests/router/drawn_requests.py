"""Requests drawn at random (hypothesis), and what the offline engine answers to each: the half of
test_request_properties that needs no cluster.

A drawn request is what a user sends through the ``openai`` client: the endpoint, the route it
should take, its prompts (token ids or text; a chat with or without a system message) and every
sampling and output field pdserve takes. ``expected`` computes its answer with the offline engine
(``pdserve.LLM``) on the same prompt tokens and ``SamplingParams``, shaped as the gateway shows it
(echo, legacy or chat logprobs, vLLM's ``prompt_logprobs``), so the test only has to compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from common.sampling_params import StructuredOutput
from pdserve import SamplingParams
from router.tool_calls import ToolPlan
from router.tool_output import ToolOutput
from router.tool_parsers import parser_for

WORDS = ["the", "cat", "sat", "on", "a", "mat", ".", "Paris", "is", "code", "1", "2", "\n", "é"]
STOPS = [" the", ".", ",", "\n", "e", " a"]
STOP_IDS = [28, 30, 198, 253, 260]  # SmolLM2's ",", ".", "\n", " a", " the"
BIASED = [*STOP_IDS, 2, 0, 1000, 12345]  # "EOS" (2) and special tokens (0) among them
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
Prompt = list[int] | str
# Tools a chat may carry, small enough for a call to fit in a few dozen tokens.
TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in {
        "get_time": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "add": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    }.items()
)
TOOL_CHOICES = [None, "none", "auto", "required", "get_time", "add"]  # None: no tools


@dataclass
class Drawn:
    """One request: its endpoint, route, prompts and sampling and output fields."""

    endpoint: str  # "completions" (1-3 prompts, token ids or text) or "chat"
    route: str  # "disaggregated" (KV streamed), "whole" (pulled once computed), "local" (on the
    # decode worker) or "colocated"
    prompt: list[Prompt] | str  # completions: the prompts; chat: the user's message
    n: int
    temperature: float
    seed: int | None
    max_tokens: int  # 0 only with echo: the prompt alone
    stream: bool
    system: str | None = None  # chat: a system message before the user's
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
    logit_bias: dict[int, float] = field(default_factory=dict)
    echo: bool = False  # completions: the prompt before the output (its logprobs too)
    prompt_logprobs: int | None = None  # vLLM's; never streamed
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: exact top alternatives
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and the choices' token ids
    tool_choice: str | None = None  # chat: one of TOOL_CHOICES (a name: that function)
    parallel_tool_calls: bool | None = None
    skip_special_tokens: bool = True  # False: special tokens (forced by logit_bias) in the text
    cache_salt: str | None = None  # vLLM's prefix-cache tenant: the answer must not change
    continuous_usage: bool = False  # streamed: the usage so far on every chunk

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    @property
    def num_prompts(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else 1

    def tool_plan(self) -> ToolPlan | None:
        """What the router makes of the tools (None: no tools, or ``none``)."""
        if self.tool_choice in (None, "none"):
            return None
        named = self.tool_choice not in ("auto", "required")
        mode: Any = "named" if named else self.tool_choice
        function = self.tool_choice if named else None
        return ToolPlan(mode, TOOLS, function, self.parallel_tool_calls is not False)

    def structured_output(self) -> StructuredOutput | None:
        plan = self.tool_plan()
        if plan is not None and plan.mode in ("required", "named"):
            return plan.structured_output()
        return None if self.structured is None else STRUCTURED[self.structured][1]

    def num_prompt_logprobs(self) -> int | None:
        """vLLM's rule: echo with logprobs returns the prompt's logprobs too."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)

    def params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            seed=self.seed,
            max_tokens=max(self.max_tokens, 1),  # echo alone: one token, dropped
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
            structured=self.structured_output(),
            logit_bias=dict(self.logit_bias),
            prompt_logprobs=self.num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
        )

    def messages(self) -> list[dict[str, str]]:
        assert isinstance(self.prompt, str)
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": self.prompt}]

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
            "return_tokens_as_token_ids": self.tokens_as_ids,
            "return_token_ids": self.token_ids,
            "skip_special_tokens": self.skip_special_tokens,
        }
        if self.cache_salt is not None:
            fields["cache_salt"] = self.cache_salt
        if self.structured is not None:
            fields["structured_outputs"] = STRUCTURED[self.structured][0]
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.prompt_logprobs
        return fields

    def openai_arguments(self, model: str) -> dict[str, Any]:
        """The request as the ``openai`` client's arguments (vLLM's in ``extra_body``)."""
        body: dict[str, Any] = {
            "model": model,
            "n": self.n,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_p": self.top_p,
            "extra_body": self.vllm_fields(),
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = self.stop
        if self.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {
                "include_usage": True,
                "continuous_usage_stats": self.continuous_usage,
            }
        if self.chat:
            body["messages"] = self.messages()
            if self.tool_choice is not None:
                body["tools"] = list(TOOLS)
                named = self.tool_choice not in ("none", "auto", "required")
                function = {"type": "function", "function": {"name": self.tool_choice}}
                body["tool_choice"] = function if named else self.tool_choice
                if self.parallel_tool_calls is not None:
                    body["parallel_tool_calls"] = self.parallel_tool_calls
            if self.logprobs is not None:
                body["logprobs"] = True
                body["top_logprobs"] = self.logprobs
        else:
            body["prompt"] = self.prompt
            body["echo"] = self.echo
            if self.logprobs is not None:
                body["logprobs"] = self.logprobs
        return body

    def json_body(self, model: str) -> dict[str, Any]:
        """The request as JSON on the wire: what the ``openai`` client sends for it."""
        arguments = self.openai_arguments(model)
        extra = arguments.pop("extra_body")
        return {**arguments, **extra}


def _text(draw: st.DrawFn, max_words: int) -> str:
    return " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=max_words)))


def _completion_prompt(draw: st.DrawFn, text: bool) -> Prompt:
    if text:
        return _text(draw, 60)
    length = draw(st.integers(1, 64) | st.integers(65, 600))  # short, or past a prefill chunk
    return draw(st.lists(st.integers(100, 40_000), min_size=length, max_size=length))


@st.composite
def requests(draw: st.DrawFn) -> Drawn:
    endpoint = draw(st.sampled_from(["completions", "chat"]))
    chat = endpoint == "chat"
    tool_choice = draw(st.sampled_from(TOOL_CHOICES)) if chat else None
    forced = tool_choice not in (None, "none", "auto")  # a grammar makes the call
    prompt: list[Prompt] | str
    if chat:
        prompt = _text(draw, 40)
    else:
        text = draw(st.booleans())  # the API takes texts or token lists, not a mix
        prompt = [_completion_prompt(draw, text) for _ in range(draw(st.integers(1, 3)))]
    echo = not chat and draw(st.booleans())
    stream = draw(st.booleans())
    temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
    short = st.integers(0 if echo else 1, 10)
    max_tokens = draw(short | st.integers(24, 40) if forced else short)  # a whole call, or not
    structured = None if forced else draw(st.sampled_from([None, None, 0, 1, 2]))
    free = structured is None and not forced  # a grammar ends it: no min_tokens, ignore_eos
    bias = st.sampled_from([-100.0, -3.0, 3.0, 100.0])
    return Drawn(
        endpoint=endpoint,
        route=draw(st.sampled_from(["disaggregated", "whole", "local", "colocated"])),
        prompt=prompt,
        n=draw(st.integers(1, 3)),
        temperature=temperature,
        seed=None if temperature == 0 else draw(st.integers(0, 2**31 - 1)),
        max_tokens=max_tokens,
        stream=stream,
        system=draw(st.none() | st.just("Answer in one word.")) if chat else None,
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
        logit_bias=draw(st.dictionaries(st.sampled_from(BIASED), bias, max_size=2)),
        echo=echo,
        prompt_logprobs=None if stream else draw(st.sampled_from([None, None, 0, 3])),
        tokens_as_ids=draw(st.booleans()),
        token_ids=draw(st.booleans()),
        tool_choice=tool_choice,
        parallel_tool_calls=draw(st.sampled_from([None, True, False])) if tool_choice else None,
        skip_special_tokens=draw(st.booleans()),
        cache_salt=draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
        continuous_usage=stream and draw(st.booleans()),
    )


@dataclass
class Answer:
    """One choice as the gateway shows it. ``logprobs`` and ``top`` are per shown token
    (echo: the prompt's first, ``None`` for its first token); ``tokens`` are the shown tokens'
    ids, known with ``tokens_as_ids``; ``prompt_logprobs`` is vLLM's list, per prompt token
    ``None`` or {token id: logprob}."""

    text: str = ""  # chat: the message's content
    finish_reason: str | None = None
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[dict[int, float] | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id matched
    token_ids: list[int] | None = None  # with return_token_ids: the generated tokens
    prompt_token_ids: list[int] | None = None  # and the prompt's


def prompt_ids(llm: Any, drawn: Drawn) -> list[list[int]]:
    """The prompts' tokens as the gateway makes them (vLLM's conventions: no special tokens
    added to a rendered chat, the tokenizer's own to a completion's text)."""
    tokenizer = llm.get_tokenizer()
    if drawn.chat:
        plan = drawn.tool_plan()
        tools = None if plan is None else plan.template_tools
        text = tokenizer.apply_chat_template(drawn.messages(), tools=tools)
        return [tokenizer.encode(text, add_special_tokens=False)]
    assert isinstance(drawn.prompt, list)
    return [p if isinstance(p, list) else tokenizer.encode(p) for p in drawn.prompt]


def _top(entry: dict[int, float], k: int, chosen: int | None = None) -> dict[int, float]:
    """The k most likely alternatives; with ``chosen`` (completions) that token too, as
    OpenAI's legacy API and vLLM show it. -inf (a token a grammar forbids) as JSON's -9999."""
    top = dict(sorted(entry.items(), key=lambda item: -item[1])[:k])
    if chosen is not None:
        top[chosen] = entry[chosen]
    return {t: max(lp, -9999.0) for t, lp in top.items()}


Usage = tuple[int, int]  # (prompt tokens, completion tokens)


def expected(llm: Any, drawn: Drawn) -> tuple[list[Answer], Usage]:
    """The offline engine's choices (choice p * n + i: prompt p's i-th) and its usage (each
    prompt counted once, whatever ``n``, as vLLM counts it)."""
    tokenizer = llm.get_tokenizer()
    prompts = prompt_ids(llm, drawn)
    shown = [
        "" if not drawn.echo else p if isinstance(p, str) else tokenizer.decode(p, False)
        for p in (drawn.prompt if isinstance(drawn.prompt, list) else [""])
    ]
    answers, num_tokens = [], 0
    k = drawn.logprobs or 0
    for ids, text, out in zip(prompts, shown, llm.generate(prompts, drawn.params())):
        for o in out.outputs:
            answer = Answer(text, o.finish_reason, stop_reason=o.stop_reason)
            if drawn.token_ids:
                answer.prompt_token_ids = ids
                answer.token_ids = list(o.token_ids) if drawn.max_tokens > 0 else []
            if drawn.num_prompt_logprobs() is not None:
                answer.prompt_logprobs = out.prompt_logprobs
            if drawn.echo and drawn.logprobs is not None:
                entries = out.prompt_logprobs or [None] * len(ids)
                answer.logprobs += [None if e is None else e[t] for t, e in zip(ids, entries)]
                answer.top += [None if e is None else _top(e, k, t) for t, e in zip(ids, entries)]
                answer.tokens += ids
            if drawn.max_tokens > 0:
                answer.text += o.text
                num_tokens += len(o.token_ids)
                generated = o.logprobs or []
                answer.logprobs += [e[t] for t, e in zip(o.token_ids, generated)]
                chosen = [None if drawn.chat else t for t in o.token_ids]
                answer.top += [_top(e, k, t) for t, e in zip(chosen, generated)]
                answer.tokens += o.token_ids if generated else []
            answers.append(_as_calls(answer, drawn, tokenizer.chat_template))
    return answers, (sum(len(ids) for ids in prompts), num_tokens)


def _as_calls(answer: Answer, drawn: Drawn, chat_template: str | None) -> Answer:
    """The answer with its text read as tool calls, as the router reads it (router.tool_output,
    whose parsing test_tool_parsers checks; here the text it reads is what is checked)."""
    plan = drawn.tool_plan()
    if plan is None:
        return answer
    output = ToolOutput(plan, parser_for("auto", chat_template))  # the router's default parser
    message, finish = output.message(answer.text, answer.finish_reason)
    answer.text, answer.finish_reason = message.get("content") or "", finish
    calls = message.get("tool_calls", [])
    answer.tool_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return answer
