"""The gateway's bad-input table and a fuzz test, over real HTTP against real router processes.

Every error comes back in OpenAI's format, ``{"error": {"message", "type", "param", "code"}}``,
with the right status: 400 naming the bad field, 401 for a missing or wrong key, 404 for an
unknown model or route, 413 for a body or prompt too large, 429/503 with Retry-After. The
official ``openai`` client raises the matching exception classes.

One cluster (1 prefill + 1 decode) serves the whole module, with four routers on its prefix
(the table's, one with ``--api-key``, one with ``--max-concurrency 1``, one with
``--max-concurrency 4``) and one router on a
prefix without workers (503s, and the fuzz test, whose valid bodies end in a cheap 503). A
second, smaller fuzz test sends valid one-token requests with fuzzed sampling fields to the real
workers. Afterwards the workers must hold no KV blocks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.protocol import _VLLM_CHAT_NOT_HONOURED, _VLLM_NOT_HONOURED
from tests.router.cluster import (
    MODEL,
    Cluster,
    Router,
    blocks_in_use,
    spawn_router,
    wait_until,
)

MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 4096
API_KEY = "sk-test-errors"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
NO_WAIT = ("--max-queue-wait", "0", "--max-client-share", "1")
TABLE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES))


@dataclass
class Stack:
    cluster: Cluster
    main: Router  # --max-model-len 64 --max-body-bytes 4096
    key: Router  # --api-key
    one: Router  # --max-concurrency 1
    four: Router  # --max-concurrency 4
    empty: Router  # a prefix without workers (same flags as main)

    def router(self, name: str) -> Router:
        return getattr(self, name)


@pytest.fixture(scope="module")
def stack(redis_server, pd_pair: Cluster) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    """Routers in front of the shared prefill and decode workers, and one with none."""
    c = pd_pair.with_own_routers()
    nobody = Cluster(redis_server.url)  # its prefix never gets a worker
    try:
        s = Stack(
            cluster=c,
            main=spawn_router(c, *TABLE_FLAGS),
            key=spawn_router(c, "--api-key", API_KEY),
            # no waiting for a slot: a full router answers 429 at once; one client (this
            # test's address) may take every slot
            one=spawn_router(c, "--max-concurrency", "1", *NO_WAIT),
            four=spawn_router(c, "--max-concurrency", "4", *NO_WAIT),
            empty=spawn_router(nobody, *TABLE_FLAGS),
        )
        for process in [*c.workers, *c.routers, *nobody.routers]:
            process.wait_ready()
        for router in (s.main, s.one, s.four):
            router.wait_ready(num_workers=2)
        s.key.wait_ready()  # its /v1/workers needs the key; /ready does not
        yield s
    except BaseException:
        c.dump()
        nobody.dump()
        raise
    finally:
        c.stop()
        nobody.stop()


# -- the table ----------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
ANY = object()  # the row does not care about error.param (or error.code)


@dataclass(frozen=True)
class Case:
    router: str  # a Stack attribute
    status: int
    param: Any  # None, ANY, an exact name, or "prefix*"
    message: str  # a substring of error.message (case-insensitive)
    body: Any = None  # dict: sent as JSON; bytes: sent as is; "chunked:N": N bytes, chunked
    path: str = "/v1/completions"
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    code: Any = ANY
    retry_after: bool = False


def row(case_id: str, router: str, status: int, param: Any, message: str, **kw: Any):  # type: ignore[no-untyped-def]
    return pytest.param(Case(router, status, param, message, **kw), id=case_id)


def completion(**fields: Any) -> dict[str, Any]:
    return {**COMPLETION, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {**CHAT, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def user(content: Any, role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": content}]


CHAT_PATH = "/v1/chat/completions"
LONG_TEXT = "hello " * 100  # ~100 tokens, beyond the 64-token context
WRONG_KEY = (("Authorization", "Bearer sk-wrong"),)
BIG_BODY = json.dumps(completion(prompt="x" * (MAX_BODY_BYTES + 100))).encode()

# fmt: off
CASES = [
    # 404: unknown model and unknown route
    row("unknown-model", "main", 404, "model", "does not exist", body=completion(model="gpt-9"),
        code="model_not_found"),
    row("unknown-model-chat", "main", 404, "model", "does not exist", body=chat(model="gpt-9"),
        path=CHAT_PATH, code="model_not_found"),
    row("unknown-route-post", "main", 404, None, "no route", body={}, path="/v1/nope"),
    # vLLM's /tokenize and /detokenize: the same checks as the completions they stand for
    row("tokenize-nothing", "main", 400, "prompt", "required", body={}, path="/tokenize"),
    row("tokenize-no-messages", "main", 400, "messages", "at least 1",
        body={"messages": []}, path="/tokenize"),
    row("tokenize-unknown-model", "main", 404, "model", "does not exist",
        body={"model": "gpt-9", "prompt": "Hi"}, path="/tokenize"),
    row("tokenize-bad-role", "main", 400, "messages.0.role", "'user'",
        body={"messages": user("hi", role="robot")}, path="/tokenize"),
    row("tokenize-continue-and-generation-prompt", "main", 400, "continue_final_message",
        "add_generation_prompt", body={"messages": user("hi"), "continue_final_message": True},
        path="/tokenize"),
    row("detokenize-outside-vocabulary", "main", 400, "tokens", "outside the vocabulary",
        body={"tokens": [1, 10**9]}, path="/detokenize"),
    row("detokenize-negative", "main", 400, "tokens.0", "greater than or equal to 0",
        body={"tokens": [-1]}, path="/detokenize"),
    row("unknown-route-get", "main", 404, None, "no route", method="GET", path="/v2/models"),
    row("wrong-method", "main", 405, None, "method not allowed", method="GET"),
    # 400: each bad field, named
    row("temperature-3", "main", 400, "temperature", "less than or equal to 2",
        body=completion(temperature=3)),
    row("temperature-string", "main", 400, "temperature", "number",
        body=completion(temperature="hot")),
    row("top_p-0", "main", 400, "top_p", "greater than 0", body=completion(top_p=0)),
    row("n-0", "main", 400, "n", "greater than or equal to 1", body=completion(n=0)),
    row("n-huge", "main", 400, "n", "less than or equal to", body=completion(n=10**30)),
    row("max_tokens-0", "main", 400, "max_tokens", "at least 1 (0 only with echo)",
        body=completion(max_tokens=0)),
    row("presence_penalty-5", "main", 400, "presence_penalty", "less than or equal to 2",
        body=completion(presence_penalty=5)),
    row("frequency_penalty--3", "main", 400, "frequency_penalty", "greater than or equal to -2",
        body=completion(frequency_penalty=-3)),
    row("logprobs-30", "main", 400, "logprobs", "less than or equal to 20",
        body=completion(logprobs=30)),
    row("seed-2**64", "main", 400, "seed", "less than", body=completion(seed=2**64)),
    row("top_k-2**31", "main", 400, "top_k", "top_k", body=completion(top_k=2**31)),
    row("stop-empty", "main", 400, "stop", "must not be empty", body=completion(stop=[""])),
    row("stop-lone-surrogate", "main", 400, "stop", "", body=completion(stop="\ud800")),
    row("prompt-wrong-type", "main", 400, "prompt",
        "Input should be a string, a list of strings, a list of integers or a list of lists of "
        "integers", body=completion(prompt=5)),
    row("prompt-mixed-list", "main", 400, "prompt", "a list of lists of integers",
        body=completion(prompt=[[1, 2], "Hello"])),
    row("prompt-empty-list", "main", 400, "prompt", "at least 1 item", body=completion(prompt=[])),
    row("prompt-token-too-large", "main", 400, "prompt.1", "less than 2147483648",
        body=completion(prompt=[1, 2**40])),
    row("prompt-batch-token-not-int", "main", 400, "prompt.0.0", "valid integer",
        body=completion(prompt=[["Hello"]])),
    row("prompt-empty", "main", 400, "prompt", "empty", body=completion(prompt="")),
    row("prompt-lone-surrogate", "main", 400, "prompt", "", body=completion(prompt="\ud800")),
    row("prompt-token-outside-vocab", "main", 400, "prompt", "outside the vocabulary",
        body=completion(prompt=[1, 49152])),
    row("prompt-token-outside-vocab-batch", "main", 400, "prompt", "outside the vocabulary",
        body=completion(prompt=[[1, 2], [10**6]])),
    row("prompt-token-negative", "main", 400, "prompt.0", "greater than or equal to 0",
        body=completion(prompt=[-1])),
    row("missing-model", "main", 400, "model", "required", body=without(COMPLETION, "model")),
    row("model-wrong-type", "main", 400, "model", "valid string", body=completion(model=5)),
    row("missing-prompt", "main", 400, "prompt", "required", body=without(COMPLETION, "prompt")),
    row("logit_bias-101", "main", 400, "logit_bias.1", "less than or equal to 100",
        body=completion(logit_bias={"1": 101})),
    row("logit_bias-key", "main", 400, "logit_bias", "token ids",
        body=completion(logit_bias={"9" * 12: 1})),
    row("prompt_logprobs-stream", "main", 400, "prompt_logprobs", "stream",
        body=completion(prompt_logprobs=1, stream=True)),
    row("suffix", "main", 400, "suffix", "not supported", body=completion(suffix="!")),
    row("best_of", "main", 400, "best_of", "best_of", body=completion(best_of=3)),
    # vLLM's fields pdserve does not honour: refused when they ask for something, not ignored
    row("use_beam_search", "main", 400, "use_beam_search", "beam search",
        body=completion(use_beam_search=True)),
    row("guided_json", "main", 400, "guided_json", "use structured_outputs",
        body=chat(guided_json={"type": "object"}), path=CHAT_PATH),
    row("guided_choice", "main", 400, "guided_choice", "removed in vLLM v0.12",
        body=completion(guided_choice=["a"])),
    row("allowed_token_ids", "main", 400, "allowed_token_ids", "logit_bias is",
        body=completion(allowed_token_ids=[1, 2])),
    row("priority", "main", 400, "priority", "priority scheduling",
        body=chat(priority=3), path=CHAT_PATH),
    row("kv_transfer_params", "main", 400, "kv_transfer_params", "--disaggregation",
        body=completion(kv_transfer_params={"do_remote_decode": True})),
    row("logprob_token_ids", "main", 400, "logprob_token_ids", "top_logprobs is",
        body=chat(logprobs=True, logprob_token_ids=[5, 7]), path=CHAT_PATH),
    row("repetition_detection", "main", 400, "repetition_detection", "not supported",
        body=completion(repetition_detection={"max_pattern_size": 8})),
    row("watermarking", "main", 400, "watermarking", "not supported",
        body=completion(watermarking=True)),
    row("thinking_token_budget", "main", 400, "thinking_token_budget", "reasoning parser",
        body=chat(thinking_token_budget=64), path=CHAT_PATH),
    row("return_prompt_text", "main", 400, "return_prompt_text", "/tokenize",
        body=chat(return_prompt_text=True), path=CHAT_PATH),
    row("chat-echo", "main", 400, "echo", "not supported on chat", body=chat(echo=True),
        path=CHAT_PATH),
    row("chat-own-template", "main", 400, "chat_template", "--chat-template",
        body=chat(chat_template="{{ messages }}"), path=CHAT_PATH),
    row("continue_final_message-and-generation-prompt", "main", 400, "continue_final_message",
        "add_generation_prompt: false", body=chat(continue_final_message=True), path=CHAT_PATH),
    row("chat_template_kwargs-messages", "main", 400, "chat_template_kwargs", "cannot set messages",
        body=chat(chat_template_kwargs={"messages": []}), path=CHAT_PATH),
    row("stream_options-without-stream", "main", 400, "stream_options", "only allowed when stream",
        body=completion(stream_options={"include_usage": True})),
    row("invalid-json", "main", 400, None, "not valid JSON", body=b'{"model": "x", prompt'),
    row("body-not-an-object", "main", 400, None, "", body=b"[1, 2, 3]"),
    row("messages-empty", "main", 400, "messages", "at least 1", body=chat(messages=[]),
        path=CHAT_PATH),
    row("messages-wrong-type", "main", 400, "messages", "valid list", body=chat(messages="hi"),
        path=CHAT_PATH),
    row("content-wrong-type", "main", 400, "messages.0.content",
        "Input should be a string or a list of content parts",
        body=chat(messages=[{"role": "user", "content": 5}]), path=CHAT_PATH),
    row("content-part-text-not-a-string", "main", 400, "messages.0.content.0.text", "valid string",
        body=chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        path=CHAT_PATH),
    row("missing-messages", "main", 400, "messages", "required", body=without(CHAT, "messages"),
        path=CHAT_PATH),
    row("missing-model-chat", "main", 400, "model", "required", body=without(CHAT, "model"),
        path=CHAT_PATH),
    row("role-robot", "main", 400, "messages.0.role", "'user'",
        body=chat(messages=user("hi", role="robot")), path=CHAT_PATH),
    row("image-content-part", "main", 400, "messages.0.content.0.type", "only text content",
        body=chat(messages=user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
        path=CHAT_PATH),
    row("content-lone-surrogate", "main", 400, "messages*", "", body=chat(messages=user("\ud800")),
        path=CHAT_PATH),
    row("top_logprobs-without-logprobs", "main", 400, "top_logprobs", "logprobs",
        body=chat(top_logprobs=2), path=CHAT_PATH),
    row("top_logprobs-30", "main", 400, "top_logprobs", "less than or equal to 20",
        body=chat(logprobs=True, top_logprobs=30), path=CHAT_PATH),
    row("tool_choice-unknown-function", "main", 400, "tool_choice.function.name",
        "no function named 'g'",
        body=chat(tools=[{"type": "function", "function": {"name": "f"}}],
                  tool_choice={"type": "function", "function": {"name": "g"}}), path=CHAT_PATH),
    row("response_format-xml", "main", 400, "response_format*", "",
        body=chat(response_format={"type": "xml"}), path=CHAT_PATH),
    row("response_format-schema-missing", "main", 400, "response_format", "json_schema.schema",
        body=chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        path=CHAT_PATH),
    row("structured_outputs-two", "main", 400, "structured_outputs", "exactly one",
        body=completion(structured_outputs={"regex": "a", "choice": ["a"]})),
    # the grammar ends the output: held-back EOS would leave nothing to sample, then free text
    row("min_tokens-with-a-grammar", "main", 400, "min_tokens", "with a structured output",
        body=completion(max_tokens=4, min_tokens=2, structured_outputs={"choice": ["a"]})),
    row("ignore_eos-with-json", "main", 400, "ignore_eos", "with a structured output",
        body=chat(ignore_eos=True, response_format={"type": "json_object"}), path=CHAT_PATH),
    row("min_tokens-with-a-required-tool", "main", 400, "min_tokens", "structured output",
        body=chat(max_tokens=4, min_tokens=2, tool_choice="required",
                  tools=[{"type": "function", "function": {"name": "f"}}]), path=CHAT_PATH),
    row("chat-stream_options-without-stream", "main", 400, "stream_options",
        "only allowed when stream", body=chat(stream_options={"include_usage": True}),
        path=CHAT_PATH),
    row("chat-temperature-3", "main", 400, "temperature", "less than or equal to 2",
        body=chat(temperature=3), path=CHAT_PATH),
    # the context length: prompt + max_tokens over it is a 400, a prompt alone over it a 413
    row("prompt+max_tokens-over-context", "main", 400, "max_tokens", "context length",
        body=completion(max_tokens=MAX_MODEL_LEN), code="context_length_exceeded"),
    row("chat+max_tokens-over-context", "main", 400, "max_tokens", "context length",
        body=chat(max_tokens=MAX_MODEL_LEN), path=CHAT_PATH, code="context_length_exceeded"),
    row("chat+max_completion_tokens-over-context", "main", 400, "max_completion_tokens",
        "context length", body=chat(max_completion_tokens=MAX_MODEL_LEN), path=CHAT_PATH,
        code="context_length_exceeded"),
    row("prompt-too-long", "main", 413, "prompt", "context length",
        body=completion(prompt=LONG_TEXT), code="context_length_exceeded"),
    row("prompt-ids-too-long", "main", 413, "prompt", "context length",
        body=completion(prompt=[1] * MAX_MODEL_LEN), code="context_length_exceeded"),
    row("chat-prompt-too-long", "main", 413, "messages", "context length",
        body=chat(messages=user(LONG_TEXT)), path=CHAT_PATH, code="context_length_exceeded"),
    # 413: the body itself, announced by Content-Length or sent chunked
    row("body-too-large-content-length", "main", 413, None, "larger than the limit",
        body=BIG_BODY),
    row("body-too-large-chunked", "main", 413, None, "larger than the limit",
        body=f"chunked:{2 * MAX_BODY_BYTES}"),
    row("chat-body-too-large-chunked", "main", 413, None, "larger than the limit",
        body=f"chunked:{2 * MAX_BODY_BYTES}", path=CHAT_PATH),
    # 401 when the router runs with --api-key
    row("no-key", "key", 401, None, "missing API key", body=COMPLETION, code="invalid_api_key"),
    row("wrong-key", "key", 401, None, "incorrect API key", body=COMPLETION, headers=WRONG_KEY,
        code="invalid_api_key"),
    row("wrong-scheme", "key", 401, None, "API key", body=COMPLETION,
        headers=(("Authorization", f"Basic {API_KEY}"),), code="invalid_api_key"),
    row("no-key-chat", "key", 401, None, "missing API key", body=CHAT, path=CHAT_PATH,
        code="invalid_api_key"),
    row("no-key-models", "key", 401, None, "missing API key", method="GET", path="/v1/models",
        code="invalid_api_key"),
    row("wrong-key-models", "key", 401, None, "incorrect API key", method="GET",
        path="/v1/models", headers=WRONG_KEY, code="invalid_api_key"),
    row("wrong-key-workers", "key", 401, None, "incorrect API key", method="GET",
        path="/v1/workers", headers=WRONG_KEY, code="invalid_api_key"),
    row("no-key-tokenize", "key", 401, None, "missing API key", body={"prompt": "Hi"},
        path="/tokenize", code="invalid_api_key"),
    row("no-key-detokenize", "key", 401, None, "missing API key", body={"tokens": [1]},
        path="/detokenize", code="invalid_api_key"),
    # the key is checked before the body: nothing about the request leaks without it
    row("no-key-bad-body", "key", 401, None, "missing API key", body=completion(temperature=3),
        code="invalid_api_key"),
    row("no-key-invalid-json", "key", 401, None, "missing API key", body=b"{nope",
        code="invalid_api_key"),
    # 503 + Retry-After when no worker is alive
    row("no-workers", "empty", 503, None, "no prefill or decode worker", body=COMPLETION,
        retry_after=True),
    row("no-workers-chat", "empty", 503, None, "no prefill or decode worker", body=CHAT,
        path=CHAT_PATH, retry_after=True),
    row("no-workers-stream", "empty", 503, None, "no prefill or decode worker",
        body=completion(stream=True), retry_after=True),
    row("no-workers-chat-stream", "empty", 503, None, "no prefill or decode worker",
        body=chat(stream=True), path=CHAT_PATH, retry_after=True),
    row("no-workers-ready", "empty", 503, None, "no prefill or decode worker", method="GET",
        path="/ready", retry_after=True),
    # validation still comes first when nothing could serve the request
    row("no-workers-bad-field", "empty", 400, "temperature", "less than or equal to 2",
        body=completion(temperature=3)),
]
# fmt: on


def chunks(size: int, piece: int = 1024) -> Iterator[bytes]:
    sent = 0
    while sent < size:
        yield b"x" * min(piece, size - sent)
        sent += piece


def send(client: httpx.Client, router: Router, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    content: Any = None
    if case.body is not None:
        headers["Content-Type"] = "application/json"
    if isinstance(case.body, dict):
        content = json.dumps(case.body).encode()  # ASCII escapes: lone surrogates survive
    elif isinstance(case.body, bytes):
        content = case.body
    url = router.url + case.path
    try:
        if isinstance(case.body, str) and case.body.startswith("chunked:"):
            content = chunks(int(case.body.split(":", 1)[1]))
        return client.request(case.method, url, content=content, headers=headers)
    except httpx.TransportError:  # the router closed a keep-alive connection (after a 500?)
        if isinstance(case.body, str):
            content = chunks(int(case.body.split(":", 1)[1]))
        return client.request(case.method, url, content=content, headers=headers)


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    """The body is exactly ``{"error": {"message": str, "type": str, "param", "code"}}``."""
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body
    return error


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.mark.parametrize("case", CASES)
def test_bad_input(stack: Stack, http: httpx.Client, case: Case) -> None:
    response = send(http, stack.router(case.router), case)
    assert response.status_code == case.status, response.text
    if isinstance(case.body, str):  # the chunked rows really were sent without a length
        assert response.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in response.request.headers
    error = assert_openai_error(response)
    assert error["type"] == ERROR_TYPES[case.status], error
    assert case.message.lower() in error["message"].lower(), error
    if isinstance(case.param, str) and case.param.endswith("*"):
        assert (error["param"] or "").startswith(case.param[:-1]), error
    elif case.param is not ANY:
        assert error["param"] == case.param, error
    if case.code is not ANY:
        assert error["code"] == case.code, error
    if case.retry_after:
        assert int(response.headers["retry-after"]) >= 1, response.headers
    else:
        assert "retry-after" not in response.headers, response.headers


def test_the_neutral_values_of_vllms_fields_pass(stack: Stack, http: httpx.Client) -> None:
    """A client written for ``vllm serve`` may send every field vLLM takes at the value that
    asks nothing (``use_beam_search: false``, ``priority: 0``, ``logprob_token_ids: []``...):
    answered, not refused. Each table row's neutral values, and null."""
    for path, body, table in [
        ("/v1/completions", COMPLETION, _VLLM_NOT_HONOURED),
        (CHAT_PATH, CHAT, {**_VLLM_NOT_HONOURED, **_VLLM_CHAT_NOT_HONOURED}),
    ]:
        for name, (neutral, _) in table.items():
            for value in (*neutral, None):
                response = http.post(stack.main.url + path, json={**body, name: value})
                assert response.status_code == 200, (path, name, value, response.text)


def test_api_key_accepted(stack: Stack, http: httpx.Client) -> None:
    """The right key opens /v1/*; /health and /metrics never need one."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = http.get(stack.key.url + "/v1/models", headers=auth)
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == [MODEL]
    assert http.get(stack.key.url + "/health").status_code == 200
    assert http.get(stack.key.url + "/metrics").status_code == 200
    models = stack.key.client(api_key=API_KEY).models.list()
    assert [m.id for m in models.data] == [MODEL]
    answer = stack.key.client(api_key=API_KEY).completions.create(
        model=MODEL, prompt="Hello", max_tokens=2
    )
    assert answer.choices[0].finish_reason == "length"


# -- the official client's exception classes ---------------------------------------------------


def _unknown_model(c: openai.OpenAI) -> Any:
    return c.completions.create(model="gpt-9", prompt="Hello", max_tokens=1)


def _bad_temperature(c: openai.OpenAI) -> Any:
    return c.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=3)


def _no_messages(c: openai.OpenAI) -> Any:
    return c.chat.completions.create(model=MODEL, messages=[], max_tokens=1)


def _long_prompt(c: openai.OpenAI) -> Any:
    return c.completions.create(model=MODEL, prompt=LONG_TEXT, max_tokens=1)


def _models(c: openai.OpenAI) -> Any:
    return c.models.list()


def _completion(c: openai.OpenAI) -> Any:
    return c.completions.create(model=MODEL, prompt="Hello", max_tokens=1)


def _chat(c: openai.OpenAI) -> Any:
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )


def _chat_stream(c: openai.OpenAI) -> Any:
    return list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, stream=True
        )
    )


# fmt: off
CLIENT_CASES = [
    pytest.param("main", "x", _unknown_model, openai.NotFoundError, 404, "model", id="404"),
    pytest.param("main", "x", _bad_temperature, openai.BadRequestError, 400, "temperature",
                 id="400-temperature"),
    pytest.param("main", "x", _no_messages, openai.BadRequestError, 400, "messages",
                 id="400-messages"),
    pytest.param("main", "x", _long_prompt, openai.APIStatusError, 413, "prompt", id="413"),
    pytest.param("key", "sk-wrong", _models, openai.AuthenticationError, 401, None,
                 id="401-models"),
    pytest.param("key", "sk-wrong", _chat, openai.AuthenticationError, 401, None,
                 id="401-chat"),
    pytest.param("empty", "x", _completion, openai.InternalServerError, 503, None,
                 id="503-completion"),
    pytest.param("empty", "x", _chat, openai.InternalServerError, 503, None, id="503-chat"),
    pytest.param("empty", "x", _chat_stream, openai.InternalServerError, 503, None,
                 id="503-chat-stream"),
]
# fmt: on


@pytest.mark.parametrize(
    ("router", "api_key", "call", "exception", "status", "param"), CLIENT_CASES
)
def test_openai_client_raises(
    stack: Stack, router: str, api_key: str, call: Any, exception: type, status: int, param: Any
) -> None:
    with pytest.raises(exception) as raised:
        call(stack.router(router).client(api_key=api_key))
    error = raised.value
    assert isinstance(error, openai.APIStatusError)
    assert error.status_code == status
    assert error.param == param
    assert error.type == ERROR_TYPES[status]


# -- 429: the router's concurrency bound --------------------------------------------------------


def test_429_when_concurrency_bound_is_full(stack: Stack, http: httpx.Client) -> None:
    """With --max-concurrency 1 and one streaming request in flight, the next request gets a
    429 with Retry-After (and the client a RateLimitError); the slot comes back when the first
    client leaves."""
    router = stack.one
    slow = completion(max_tokens=300, ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as holder:
        with holder.stream("POST", router.url + "/v1/completions", json=slow) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            first = next(lines)
            assert first.startswith("data: "), first
            for body, path in ((COMPLETION, "/v1/completions"), (CHAT, CHAT_PATH)):
                response = http.post(router.url + path, json=body)
                assert response.status_code == 429, response.text
                assert int(response.headers["retry-after"]) >= 1
                error = assert_openai_error(response)
                assert error["type"] == "rate_limit_error"
                assert "in flight" in error["message"]
            with pytest.raises(openai.RateLimitError) as raised:
                _completion(router.client())
            assert raised.value.status_code == 429
            # validation still comes first: a bad request is a 400 even when the router is full
            response = http.post(router.url + "/v1/completions", json=completion(temperature=3))
            assert response.status_code == 400, response.text
            # the request in flight goes on, untouched
            more = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert more and all('"error"' not in line for line in more), more
        # the streaming client left mid-generation: its slot is freed

    def served() -> bool:
        return http.post(router.url + "/v1/completions", json=COMPLETION).status_code == 200

    assert wait_until(served, timeout=10), "the slot never came back"


IN_FLIGHT = "pdserve_router_requests_in_flight"
# (path, body, sub-requests): each takes one slot per prompt x n
FAN_OUTS = [
    ("/v1/completions", completion(n=3), 3),
    ("/v1/completions", completion(n=3, stream=True), 3),
    ("/v1/completions", completion(prompt=["Hello", "Hi", "Hey"]), 3),
    ("/v1/completions", completion(prompt=["Hello", "Hi"], n=2, stream=True), 4),
    (CHAT_PATH, chat(n=3), 3),
]


def test_a_fan_out_takes_one_slot_per_sub_request(stack: Stack, http: httpx.Client) -> None:
    """With --max-concurrency 4 and a streaming n=2 request holding 2 slots, requests with 3 or 4
    sub-requests (n=3, three prompts, 2 prompts x n=2; streamed or not, completions or chat) get
    a 429 naming the 2 in flight and the slots they need, and take none; n=2 (exactly the 2
    left) is served; every slot comes back afterwards."""
    router = stack.four
    holding = completion(max_tokens=300, ignore_eos=True, stream=True, n=2)
    with httpx.Client(timeout=60) as holder:
        with holder.stream("POST", router.url + "/v1/completions", json=holding) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")
            assert router.metric(IN_FLIGHT) == 2
            for path, body, needs in FAN_OUTS:
                response = http.post(router.url + path, json=body)
                assert response.status_code == 429, (body, response.text)
                assert int(response.headers["retry-after"]) >= 1
                error = assert_openai_error(response)
                assert error == {
                    "message": f"the router has 2 sub-requests in flight and this request needs "
                    f"{needs} more; its limit is 4: retry later",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": None,
                }, body
                assert router.metric(IN_FLIGHT) == 2, "a refused request kept slots"
            fits = http.post(router.url + "/v1/completions", json=completion(n=2))
            assert fits.status_code == 200, fits.text
            assert len(fits.json()["choices"]) == 2
            more = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert more and all('"error"' not in line for line in more), more
    assert wait_until(lambda: router.metric(IN_FLIGHT) == 0, timeout=10), router.metric(IN_FLIGHT)
    four = http.post(router.url + "/v1/completions", json=completion(prompt=["Hello", "Hi"], n=2))
    assert four.status_code == 200, four.text  # all 4 slots, once free
    assert len(four.json()["choices"]) == 4


# (router, path, body, sub-requests, the router's --max-concurrency)
# fmt: off
TOO_WIDE = [
    pytest.param("four", "/v1/completions", completion(n=5), 5, 4, id="n-5"),
    pytest.param("four", "/v1/completions", completion(n=5, stream=True), 5, 4, id="n-5-stream"),
    pytest.param("four", "/v1/completions", completion(prompt=["a", "b", "c"], n=2), 6, 4,
                 id="3-prompts-x-n-2"),
    pytest.param("four", "/v1/completions", completion(prompt=["a"] * 5), 5, 4, id="5-prompts"),
    pytest.param("four", CHAT_PATH, chat(n=5), 5, 4, id="chat-n-5"),
    pytest.param("one", "/v1/completions", completion(n=2), 2, 1, id="n-2-one-slot"),
]
# fmt: on


@pytest.mark.parametrize(("router", "path", "body", "count", "limit"), TOO_WIDE)
def test_a_fan_out_wider_than_every_slot_is_a_400(
    stack: Stack, http: httpx.Client, router: str, path: str, body: Any, count: int, limit: int
) -> None:
    """A request with more sub-requests than --max-concurrency could never be admitted: an idle
    router refuses it at once with a 400 naming the count, the limit and the flag (not a 429
    that a client would retry forever)."""
    target = stack.router(router)
    assert wait_until(lambda: target.metric(IN_FLIGHT) == 0, timeout=10)
    response = http.post(target.url + path, json=body)
    assert response.status_code == 400, response.text
    assert "retry-after" not in response.headers
    assert assert_openai_error(response) == {
        "message": f"the number of sub-requests (prompts x n) is {count}, over this server's "
        f"limit of {limit} (--max-concurrency)",
        "type": "invalid_request_error",
        "param": "n" if body.get("n", 1) > 1 else "prompt",
        "code": "request_too_large",
    }


# -- the fuzz tests -----------------------------------------------------------------------------

# Strings with what JSON can carry and tokenizers and protobuf may choke on: lone surrogates
# (json.dumps writes them as \ud800 escapes), NUL and other controls, astral characters.
ODD_STRINGS = ["", "\ud800", "a\udfffb", "\x00", "\u202e\U0001f600", "<|im_end|>", "\\", " " * 9]
any_text = (
    st.text(max_size=24)
    | st.text(st.characters(codec=None, categories=["Cs", "Cc", "So", "Zs"]), max_size=6)
    | st.sampled_from(ODD_STRINGS)
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, -(2**63) - 1, 2**64, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=8,
)
INT32_EDGES = [-1, 0, 2**31 - 1, 2**31, 2**32]
small_floats = st.floats(min_value=-3, max_value=3, allow_nan=False)
token_ids = st.integers(min_value=-2, max_value=60_000) | st.sampled_from([2**31, 2**63])


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(valid, valid, valid, junk)


SAMPLING = {
    "n": field(st.integers(min_value=-1, max_value=20)),
    "temperature": field(small_floats),
    "top_p": field(small_floats),
    "top_k": field(st.integers(min_value=-2, max_value=2**40) | st.sampled_from(INT32_EDGES)),
    "min_p": field(small_floats),
    "presence_penalty": field(small_floats),
    "frequency_penalty": field(small_floats),
    "repetition_penalty": field(st.floats(min_value=-1, max_value=20, allow_nan=False)),
    "seed": field(st.integers() | st.sampled_from([-(2**63), 2**63 - 1, 2**63])),
    "stop": field(any_text | st.lists(any_text, max_size=20)),
    "stop_token_ids": field(st.lists(token_ids, max_size=4)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "logit_bias": field(st.dictionaries(st.sampled_from(["1", "2", "x"]), small_floats)),
    "user": field(any_text),
}
models = field(st.just(MODEL) | st.just(MODEL) | st.sampled_from(["", "gpt-4o", MODEL.lower()]))
prompts = (
    any_text
    | st.lists(any_text, min_size=0, max_size=4)
    | st.lists(token_ids, min_size=0, max_size=8)
    | st.lists(st.lists(token_ids, max_size=4), max_size=3)
    | st.integers(min_value=1, max_value=300).map(lambda n: "word " * n)
)
COMPLETION_FIELDS = {
    **SAMPLING,
    "model": models,
    "prompt": field(prompts),
    "max_tokens": field(st.integers(min_value=-1, max_value=100) | st.sampled_from([2**31])),
    "logprobs": field(st.integers(min_value=-1, max_value=25)),
    "echo": field(st.booleans()),
    "suffix": field(any_text),
    "best_of": field(st.integers(min_value=0, max_value=20)),
}
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", ""]) | junk},
    optional={"text": any_text | junk, "image_url": junk},
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": field(
                st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
            ),
            "content": field(any_text | st.none() | st.lists(parts, max_size=3)),
            "name": field(any_text),
        },
    ),
    max_size=4,
)
CHAT_FIELDS = {
    **SAMPLING,
    "model": models,
    "messages": field(messages),
    "max_tokens": field(st.integers(min_value=-1, max_value=100)),
    "max_completion_tokens": field(st.integers(min_value=-1, max_value=100)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(min_value=-1, max_value=25)),
    "tools": field(st.lists(junk, max_size=2)),
    "response_format": field(st.fixed_dictionaries({"type": any_text | junk})),
}
extras = st.dictionaries(any_text, junk, max_size=3)


def broad(fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...]) -> Any:
    """Objects with any of the endpoint's fields (the required ones most of the time), plus
    unknown keys: mostly refused, some field or other being off."""
    present = st.fixed_dictionaries({k: fields[k] for k in required})
    return st.builds(
        lambda base, rest, extra: {**extra, **base, **rest},
        st.one_of(present, present, present, st.just({})),
        st.fixed_dictionaries({}, optional={k: v for k, v in fields.items() if k not in required}),
        extras,
    )


def deep(base: st.SearchStrategy[dict[str, Any]], fields: dict[str, Any]) -> Any:
    """A valid model and a rich prompt or conversation, with at most two other fields: these
    get past validation, to tokenization, the chat template and the context checks."""
    optional = sorted(k for k in fields if k not in ("model", "prompt", "messages"))
    others = st.lists(st.sampled_from(optional), max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})
    )
    return st.builds(lambda b, o: {**o, **b, "model": MODEL}, base, others)


def bodies(objects: st.SearchStrategy[dict[str, Any]]) -> Any:
    """Request bodies: usually an object, sometimes another JSON value, or bytes that are not
    JSON at all."""
    as_json = st.builds(
        lambda value: json.dumps(value).encode(), st.one_of(objects, objects, objects, junk)
    )
    return st.one_of(as_json, as_json, as_json, st.binary(max_size=64))


ROLES = ["system", "developer", "user", "assistant", "tool"]
rich_prompts = (
    any_text
    | st.lists(any_text, min_size=1, max_size=3)
    | st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=8)
    | st.integers(min_value=1, max_value=80).map(lambda n: "word " * n)
)
rich_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": any_text
            | st.none()
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": any_text}) | parts,
                min_size=1,
                max_size=2,
            ),
        },
        optional={"name": any_text},
    ),
    min_size=1,
    max_size=3,
)
requests = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        bodies(
            st.one_of(
                deep(st.fixed_dictionaries({"prompt": rich_prompts}), COMPLETION_FIELDS),
                deep(st.fixed_dictionaries({"prompt": rich_prompts}), COMPLETION_FIELDS),
                broad(COMPLETION_FIELDS, ("model", "prompt")),
            )
        ),
    ),
    st.tuples(
        st.just(CHAT_PATH),
        bodies(
            st.one_of(
                deep(st.fixed_dictionaries({"messages": rich_messages}), CHAT_FIELDS),
                deep(st.fixed_dictionaries({"messages": rich_messages}), CHAT_FIELDS),
                broad(CHAT_FIELDS, ("model", "messages")),
            )
        ),
    ),
)


def post_raw(client: httpx.Client, url: str, content: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    try:
        return client.post(url, content=content, headers=headers)
    except httpx.TransportError:  # the server dropped a keep-alive connection; once more
        return client.post(url, content=content, headers=headers)


def check_error(response: httpx.Response, allowed: set[int], sent: bytes) -> None:
    shown = sent[:400]
    assert response.status_code in allowed, (response.status_code, response.text, shown)
    error = assert_openai_error(response)
    assert error["type"] == ERROR_TYPES[response.status_code], (error, shown)
    if response.status_code == 503:
        assert int(response.headers["retry-after"]) >= 1, shown


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_fuzz_no_workers(stack: Stack, http: httpx.Client, request: tuple[str, bytes]) -> None:
    """Anything POSTed to completions or chat on a router without workers gets a 400, 404, 413
    or 503 (valid bodies), always in OpenAI's error format; never a 500."""
    path, content = request
    response = post_raw(http, stack.empty.url + path, content)
    check_error(response, {400, 404, 413, 503}, content)


# Valid, cheap requests (one short prompt, at most 2 tokens) with fuzzed sampling fields, served
# by the real workers: the fields the router must convert for them (protobuf int32s, strings).
some_sampling = st.lists(
    st.sampled_from(sorted(k for k in SAMPLING if k != "n")), max_size=3, unique=True
).flatmap(lambda keys: st.fixed_dictionaries({k: SAMPLING[k] for k in keys}))
served_completions = st.builds(
    lambda fields, prompt, max_tokens, n: {
        **fields,
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n": n,
    },
    some_sampling,
    st.sampled_from(["Hello", [1, 2, 3]]) | any_text,
    st.integers(min_value=1, max_value=2),
    st.integers(min_value=1, max_value=2),
)
served_chats = st.builds(
    lambda fields, content, max_tokens: {
        **fields,
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    },
    some_sampling,
    st.just("Hi") | any_text,
    st.integers(min_value=1, max_value=2),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    request=st.tuples(st.just("/v1/completions"), served_completions)
    | st.tuples(st.just(CHAT_PATH), served_chats)
)
def test_fuzz_sampling_fields_with_workers(
    stack: Stack, http: httpx.Client, request: tuple[str, dict[str, Any]]
) -> None:
    """Fuzzed sampling fields on otherwise valid requests to real workers: a 200 with all ``n``
    choices finished, or a 400/413 naming a field; never a 500."""
    path, body = request
    content = json.dumps(body).encode()
    response = post_raw(http, stack.main.url + path, content)
    if response.status_code != 200:
        check_error(response, {400, 413}, content)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", (response.text[-500:], content)
        assert not any('"error"' in e for e in events), (response.text[-500:], content)
    else:
        choices = response.json()["choices"]
        assert len(choices) == body.get("n", 1), (response.text, content)
        assert all(c["finish_reason"] for c in choices), (response.text, content)


def test_fuzz_from_the_openapi_document(stack: Stack) -> None:
    """schemathesis derives requests from the router's published schema, valid and not, for
    every operation: none gets a 500, and every error is in OpenAI's format. (Its pytest
    plugin does not run under pytest 9, so its hypothesis strategy is driven directly.)"""
    schema = schemathesis.openapi.from_url(stack.empty.url + "/openapi.json")
    operations = {f"{r.ok().method.upper()} {r.ok().path}" for r in schema.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= operations
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    seen: set[tuple[str, int]] = set()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(*(schema.as_strategy(mode) for mode in modes)), ours=st.booleans())
    def check(case, ours: bool) -> None:  # type: ignore[no-untyped-def]
        if ours and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every valid body stops at 404 (no model)
        response = case.call(timeout=10)
        seen.add((case.path, response.status_code))
        shown = (case.method, case.path, str(case.body)[:300], response.text[:300])
        assert response.status_code < 500 or response.status_code == 503, shown
        if response.status_code >= 400 and case.path.startswith("/v1/"):
            assert response.status_code in ERROR_TYPES, shown
            assert response.json()["error"]["type"] == ERROR_TYPES[response.status_code], shown

    check()
    # The fuzz got past the schema both ways: bodies refused (400), and bodies accepted that
    # then stopped at the model check (404) or at the missing workers (503).
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert (path, 400) in seen and {(path, 404), (path, 503)} & seen, sorted(seen)
    # And a minimal valid body, built by the same schema, goes all the way (503: no workers).
    valid = {
        "/v1/completions": {"model": MODEL, "prompt": "hi"},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    }
    for path, body in valid.items():
        operation = schema[path]["POST"]
        response = operation.Case(body=body).call(timeout=10)
        assert response.status_code == 503, response.text


def test_no_nagle_delay(stack: Stack) -> None:
    """Keep-alive requests are answered in well under the ~40 ms that Nagle's algorithm and the
    client's delayed ACK add to each response when the router writes its headers and body
    separately on a socket without TCP_NODELAY (every SSE event would wait the same way). The
    first request on a connection is fast either way (Linux's quick-ACK mode), so the median
    of several counts."""
    timings = []
    with httpx.Client() as client:
        for _ in range(11):
            start = time.perf_counter()
            assert client.get(stack.empty.url + "/health").status_code == 200
            timings.append(time.perf_counter() - start)
    median = sorted(timings)[len(timings) // 2]
    shown = [round(t * 1000, 1) for t in timings]
    assert median < 0.02, f"/health round trips on one connection (ms): {shown}"


# -- last: nothing leaked -----------------------------------------------------------------------


def test_workers_hold_no_kv_blocks(stack: Stack) -> None:
    """After every request above (refused, served, or abandoned mid-stream), the workers hold
    no KV blocks."""
    for worker in stack.cluster.workers:
        assert wait_until(lambda w=worker: blocks_in_use(w) == 0, timeout=10), (
            f"{worker.role} holds {blocks_in_use(worker)} KV blocks"
        )
    for router in (stack.main, stack.key, stack.one, stack.four, stack.empty):
        assert router.process.is_alive(), router.process.output_tail()
