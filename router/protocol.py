"""The OpenAI request bodies the gateway accepts, validated at the edge (pydantic).

Fields OpenAI defines but pdserve cannot honour (suffix, best_of != n, non-text content)
are refused with a 400 naming them rather than silently ignored, and so are vLLM's
(``_VLLM_NOT_HONOURED``); other unknown fields are ignored, as OpenAI's own server does.
vLLM's sampling extensions (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
skip_special_tokens, prompt_logprobs, include_stop_str_in_output), its chat-template fields
(add_generation_prompt, continue_final_message, chat_template_kwargs, add_special_tokens) are
accepted too, and so is its ``cache_salt``: a request's prefix-cache hits (and
``cached_tokens``) are only blocks computed under the same salt. ``echo`` with ``logprobs``
asks for the prompt's logprobs (as vLLM: ``prompt_logprobs`` = ``logprobs``); ``max_tokens: 0``
is allowed with ``echo`` (the prompt alone comes back).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, field_validator

from common.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput
from router.chat_template import ChatTemplateOptions
from router.errors import APIError
from router.tool_calls import (
    MessageToolCall,
    ToolDefinition,
    ToolPlan,
    message_tool_fields,
    plan_tools,
)
from services.engine.hashing import MAX_CACHE_SALT_CHARS

# Structural caps: what the proto and the engine can hold. The configurable limits (n, prompts,
# stop strings, ... see router.limits) are checked against the parsed body, below these.
MAX_N = 1024
MAX_STOP = 1024
MAX_LOGPROBS = 20  # OpenAI's own bound
INT64 = 2**63


def _encodable(text: str) -> str:
    """JSON may carry lone surrogates (``"\\ud800"``); no tokenizer or protobuf takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("must be valid Unicode text (it has a lone surrogate)") from exc
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


# vLLM's request fields that pdserve does not honour, with the values that ask nothing of it;
# any other value is refused with a 400 naming the field (ignored, the output would differ
# from what the client asked for).
_VLLM_NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty belongs to beam search, which is not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported; logit_bias is"),
    "bad_words": ((), "bad_words is not supported; logit_bias is"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens is not supported"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens is not supported"),
    "logits_processors": ((), "logits_processors are not supported"),
    "prompt_embeds": ((), "prompt_embeds are not supported"),
    "priority": ((0,), "priority scheduling is not supported"),
    "kv_transfer_params": (
        (),
        "kv_transfer_params is not taken: pdserve's router decides "
        "where each prompt is computed (--disaggregation)",
    ),
    "vllm_xargs": ((), "vllm_xargs are not supported"),
    "logprob_token_ids": (([],), "logprob_token_ids is not supported; top_logprobs is"),
    "repetition_detection": ((), "repetition_detection is not supported"),
    "watermarking": ((False,), "watermarking is not supported"),
    "thinking_token_budget": ((), "thinking_token_budget is not supported (no reasoning parser)"),
    "ec_transfer_params": (({},), "ec_transfer_params is not taken: only text models are served"),
    **{
        f"guided_{kind}": ((), f"guided_{kind} was removed in vLLM v0.12; use structured_outputs")
        for kind in ("json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")
    },
}
_VLLM_CHAT_NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((False,), "echo is not supported on chat completions"),
    "chat_template": (
        (),
        "a request's own chat template is not taken; start the router with --chat-template",
    ),
    "documents": ((), "documents are not supported"),
    "mm_processor_kwargs": ((), "mm_processor_kwargs: only text models are served"),
    "return_prompt_text": (
        (False,),
        "return_prompt_text is not supported; POST /tokenize with the messages gives the "
        "prompt's tokens",
    ),
}
# Variables the router gives every chat template: chat_template_kwargs cannot replace them.
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _refuse_not_honoured(
    extra: dict[str, Any] | None, table: dict[str, tuple[tuple[Any, ...], str]]
) -> None:
    for name, value in (extra or {}).items():
        if name in table and value is not None and value not in table[name][0]:
            raise APIError(400, table[name][1], param=name)


def _is_token_id(key: str) -> bool:
    """A logit_bias key: a token id in decimal (what the proto's int32 can carry)."""
    return key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < 2**31


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in
    # every chunk too


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema is enforced whatever ``strict`` says."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` (what replaced its ``guided_*`` fields): exactly one of
    ``json``, ``regex``, ``choice``, ``grammar`` (EBNF) or ``json_object``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused: not supported
    whitespace_pattern: Any = None  # refused: not supported


class _SamplingFields(BaseModel):
    """What both endpoints share: the model, sampling, stopping and streaming."""

    model_config = ConfigDict(extra="allow")  # kept to be checked: see _VLLM_NOT_HONOURED

    model: StrictStr
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
        ]
        | None
    ) = None
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids too
    # vLLM's prefix-cache isolation: only requests with the same salt share cached blocks
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # vLLM's: names the request when no X-Request-Id header does (router.access_log checks it)
    request_id: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and any(
            s == "" for s in ([value] if isinstance(value, str) else value)
        ):
            raise ValueError("stop strings must not be empty")
        return value

    def check_supported(self) -> None:
        _refuse_not_honoured(self.model_extra, _VLLM_NOT_HONOURED)
        if not all(_is_token_id(key) for key in self.logit_bias or {}):
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM
            msg = "prompt_logprobs are not available when stream is true"
            raise APIError(400, msg, param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token to return; None: no prompt logprobs."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (OpenAI's defaults where a field is absent). With
        ``max_tokens`` 0 (echo alone) one token is generated and left out of the answer."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                max_tokens=max(max_tokens, 1),
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                prompt_logprobs=self.num_prompt_logprobs,
                min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured=self.structured_output(),
            )
        except ValueError as exc:  # SamplingParams names the field first
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the output must follow, from response_format or structured_outputs. A
        spec the workers cannot compile comes back from them as a 400."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text":
            if so is not None:
                msg = "give response_format or structured_outputs, not both"
                raise APIError(400, msg, param="structured_outputs")
            if fmt.type == "json_object":
                return StructuredOutput("json_object")
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                msg = "response_format json_schema needs json_schema.schema"
                raise APIError(400, msg, param="response_format")
            return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
        return None if so is None else _from_structured_outputs(so)


def _from_structured_outputs(so: StructuredOutputsParams) -> StructuredOutput:
    for name in ("structural_tag", "whitespace_pattern"):
        if getattr(so, name) is not None:
            raise APIError(400, f"structured_outputs.{name} is not supported", param=name)
    json_spec = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
    candidates = [
        (so.json_ is not None, "json_schema", json_spec),
        (so.regex is not None, "regex", so.regex or ""),
        (so.choice is not None, "choice", json.dumps(so.choice)),
        (so.grammar is not None, "grammar", so.grammar or ""),
        (bool(so.json_object), "json_object", ""),
    ]
    given = [StructuredOutput(kind, spec) for present, kind, spec in candidates if present]
    if len(given) != 1:
        msg = "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
        raise APIError(400, msg, param="structured_outputs")
    return given[0]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0: only with echo
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's rule: echo with logprobs returns the prompt's logprobs too."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((k for k in wanted if k is not None), default=None)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                param = f"messages.{index}.content.{j}.type"
                raise APIError(400, f"only text content is supported, got {part.type!r}", param)
            if part.text is None:
                param = f"messages.{index}.content.{j}.text"
                raise APIError(400, "a text part needs 'text'", param)
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # none, auto, required, a function
    parallel_tool_calls: bool | None = None
    # vLLM's: how the conversation is rendered (router.chat_template.ChatTemplateOptions)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # Output kinds a text model cannot produce: refused when asked for (the check below).
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        _refuse_not_honoured(self.model_extra, _VLLM_CHAT_NOT_HONOURED)
        self._check_text_only()
        self._check_template_options()
        self.tool_plan()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def _check_text_only(self) -> None:
        if self.audio is not None or any(m != "text" for m in self.modalities or []):
            param = "audio" if self.audio is not None else "modalities"
            raise APIError(400, "only text output is supported", param=param)
        if self.web_search_options is not None:
            msg = "web search is not supported"
            raise APIError(400, msg, param="web_search_options")

    def _check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            msg = "continue_final_message needs add_generation_prompt: false"
            raise APIError(400, msg, param="continue_final_message")
        taken = sorted(set(self.chat_template_kwargs or {}) & set(_TEMPLATE_VARIABLES))
        if taken:
            msg = f"chat_template_kwargs cannot set {', '.join(taken)} (use the request's fields)"
            raise APIError(400, msg, param="chat_template_kwargs")

    def template_options(self) -> ChatTemplateOptions:
        return ChatTemplateOptions(
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template_kwargs=dict(self.chat_template_kwargs or {}),
            add_special_tokens=self.add_special_tokens,
        )

    def tool_plan(self) -> ToolPlan:
        """What ``tools`` and ``tool_choice`` ask for (router.tool_calls); 400 when invalid."""
        fmt = self.response_format is not None and self.response_format.type != "text"
        grammar = "response_format" if fmt else None
        grammar = "structured_outputs" if self.structured_outputs is not None else grammar
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, grammar)

    def structured_output(self) -> StructuredOutput | None:
        """A required or named tool call's grammar, else the request's own."""
        return self.tool_plan().structured_output() or super().structured_output()

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (developer is the newer system)."""
        return [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(i),
                **message_tool_fields(i, m.role, m.tool_calls, m.tool_call_id),
            }
            for i, m in enumerate(self.messages)
        ]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
