"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt to token ids (a text, or a conversation
rendered by the chat template exactly as ``/v1/chat/completions`` renders it), and token ids
back to text. The API keys, size limits and tokenizer turns of the OpenAI endpoints apply;
nothing reaches a worker."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag

from router.chat_template import chat_text_length
from router.clients import Client
from router.edge import arrival
from router.errors import APIError
from router.gateway import Gateway
from router.protocol import ChatCompletionRequest, ChatMessage, Text, TokenId
from router.tool_calls import ToolDefinition

MAX_DETOKENIZE_TOKENS = 1 << 20  # far over any context length; bounds the work of one call


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def as_chat_request(self, model: str) -> ChatCompletionRequest:
        """The chat completion request whose prompt this is (its checks and rendering)."""
        fields = self.model_dump(exclude={"model", "return_token_strs"}, exclude_none=True)
        return ChatCompletionRequest.model_validate({**fields, "model": model})


def _kind(body: Any) -> str:
    return "(chat)" if isinstance(body, dict) and "messages" in body else "(prompt)"


# A body with messages is a conversation, else a prompt; the tags (in parentheses) are left out
# of an error's param (router.errors), so it names the field itself.
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("(chat)")]
    | Annotated[TokenizeCompletionRequest, Tag("(prompt)")],
    Discriminator(_kind),
]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


def add_tokenize_routes(app: FastAPI, gateway: Gateway) -> None:
    admission = gateway.admission

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        client, deadline = _client_and_deadline(gateway, request)
        model = gateway.model
        gateway.check_model(body.model or model.name)
        if isinstance(body, TokenizeChatRequest):
            chat = body.as_chat_request(model.name)
            chat.check_supported()
            messages, tools = chat.template_messages(), chat.tool_plan().template_tools
            num_chars = chat_text_length(messages, tools)
            admission.check_text([num_chars], model.max_model_len, "messages")
            options = chat.template_options()
            tokens = await admission.run_tokenizer(
                client, deadline, gateway.chat_prompt, messages, tools, options
            )
        else:
            admission.check_text([len(body.prompt)], model.max_model_len, "prompt")
            special = body.add_special_tokens
            tokens = await admission.run_tokenizer(  # chat=False
                client, deadline, gateway.tokenize, body.prompt, False, special
            )
        strs = [model.tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": model.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        client, deadline = _client_and_deadline(gateway, request)
        tokenizer = gateway.model.tokenizer
        gateway.check_model(body.model or gateway.model.name)
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            msg = f"tokens has ids outside the vocabulary (size {tokenizer.vocab_size})"
            raise APIError(400, msg, param="tokens")
        text = await admission.run_tokenizer(client, deadline, tokenizer.decode, body.tokens)
        return {"prompt": text}


def _client_and_deadline(gateway: Gateway, request: Request) -> tuple[Client, float]:
    _, client, deadline = arrival(request.scope, gateway.admission_wait_seconds)
    return client, deadline
