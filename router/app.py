"""The HTTP API: OpenAI's completions, chat completions and models, plus health, readiness,
metrics and the worker list. Handlers validate and tokenize; `Gateway` and `Orchestrator` do
the routing; `ResponseBuilder` does the formatting. With tracing on, each API request's root span
(`router.edge.TraceMiddleware`) gets the request's id, model, token counts and finish reasons."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common import tracing
from router.access_log import AccessEntry, AccessLogMiddleware, entry_of
from router.admission import Admission, Ticket
from router.chat_template import chat_text_length
from router.clients import Client
from router.edge import EdgeMiddleware, TraceMiddleware, arrival
from router.errors import APIError, install_error_handlers
from router.gateway import Gateway, now_unix
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.responses import DONE, Prompt, ResponseBuilder
from router.tokenize_api import add_tokenize_routes
from router.tool_output import ToolOutput
from router.tool_parsers import parser_for
from router.worker_calls import Chunk, SubRequest

T = TypeVar("T")
log = logging.getLogger(__name__)


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app over ``gateway`` (which it starts and closes with the app)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="pdserve", version="0.1.0", lifespan=lifespan, **_without_fastapi_telemetry()
    )
    install_error_handlers(app)
    app.add_middleware(
        EdgeMiddleware,
        max_body_bytes=gateway.config.max_body_bytes,
        max_body_depth=gateway.config.max_body_depth,
        metrics=gateway.metrics,
        keys=gateway.keys,
        ops_token=gateway.config.cluster_token if gateway.config.ops_need_token else None,
    )
    app.add_middleware(AccessLogMiddleware, log_format=gateway.config.log_format)  # sees all
    if tracing.is_enabled():  # added last: outermost, so 401/413 answers carry the trace id
        app.add_middleware(TraceMiddleware)

    admission = gateway.admission
    tool_parser = parser_for(gateway.config.tool_call_parser, gateway.model.tokenizer.chat_template)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        entry_of(request.scope).take_body_id(body.request_id)
        arrival, client, deadline = _arrival(gateway, request)
        gateway.check_model(body.model)
        body.check_supported()
        body = gateway.model.generation.apply(body)  # the model's sampling defaults
        texts = body.prompts()
        admission.check_shape(client, len(texts), body.n, body.stop)
        lengths = [len(p) for p in texts if isinstance(p, str)]
        admission.check_text(lengths, gateway.model.max_model_len, "prompt")
        special = body.add_special_tokens
        tokenized = (_tokenized(gateway, client, deadline, p, special) for p in texts)
        prompts = await asyncio.gather(*tokenized)

        def params(prompt_len: int):  # type: ignore[no-untyped-def]
            max_tokens = gateway.max_tokens_for(prompt_len, body.max_tokens, "max_tokens", "prompt")
            return body.sampling_params(max_tokens, body.logprobs)

        salt = _salt(client, body.cache_salt)
        rid = entry_of(request.scope).worker_request_id("cmpl")
        subs = gateway.sub_requests(rid, list(prompts), params, salt)
        _check_tokens(admission, subs, "max_tokens")
        response_id = entry_of(request.scope).response_id("cmpl")
        builder = _builder(gateway, "completion", response_id, subs, body.n, body.logprobs, body)
        admit = _Admit(admission, client, deadline)
        return await _respond(gateway, request, subs, builder, body.stream, arrival, admit)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        entry_of(request.scope).take_body_id(body.request_id)
        arrival, client, deadline = _arrival(gateway, request)
        gateway.check_model(body.model)
        body.check_supported()
        body = gateway.model.generation.apply(body)  # the model's sampling defaults
        admission.check_shape(client, 1, body.n, body.stop, len(body.messages))
        messages, tools = body.template_messages(), body.tool_plan().template_tools
        num_chars = chat_text_length(messages, tools)
        admission.check_text([num_chars], gateway.model.max_model_len, "messages")
        chat_prompt, options = gateway.chat_prompt, body.template_options()
        prompt = await admission.run_tokenizer(
            client, deadline, chat_prompt, messages, tools, options
        )
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"

        def params(prompt_len: int):  # type: ignore[no-untyped-def]
            max_tokens = gateway.max_tokens_for(prompt_len, body.max_new_tokens, param, "messages")
            return body.sampling_params(max_tokens, body.num_logprobs)

        salt = _salt(client, body.cache_salt)
        rid = entry_of(request.scope).worker_request_id("chatcmpl")
        subs = gateway.sub_requests(rid, [prompt], params, salt)
        _check_tokens(admission, subs, param)
        response_id = entry_of(request.scope).response_id("chatcmpl")
        builder = _builder(gateway, "chat", response_id, subs, body.n, body.num_logprobs, body)
        if tools:  # tool_choice other than none: the answers are read for calls
            builder.expect_tool_calls(ToolOutput(body.tool_plan(), tool_parser))
        admit = _Admit(admission, client, deadline)
        return await _respond(gateway, request, subs, builder, body.stream, arrival, admit)

    add_tokenize_routes(app, gateway)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = gateway.model
        card = {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/workers")
    async def workers() -> dict[str, Any]:
        return _workers(gateway)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) liveness probe
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")  # as vLLM's: the serving software's version
    async def version() -> dict[str, str]:
        return {"version": _installed_version()}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, why = gateway.orchestrator.is_ready()
        if ok:
            return JSONResponse({"status": "ready"})
        error = APIError(503, why, retry_after=gateway.config.retry_after_seconds)
        return error.response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _without_fastapi_telemetry() -> dict[str, Any]:
    """Recent FastAPI versions trace requests themselves once a tracer provider is installed:
    a second HTTP span and per-endpoint ones. The request's root span is ours on every version
    (`TraceMiddleware`, which also covers the edge's 401/413), so FastAPI's is turned off."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def _arrival(gateway: Gateway, request: Request) -> tuple[float, Client, float]:
    return arrival(request.scope, gateway.admission_wait_seconds)


async def _tokenized(
    gateway: Gateway,
    client: Client,
    deadline: float,
    prompt: str | list[int],
    add_special_tokens: bool,
) -> list[int]:
    if isinstance(prompt, str):  # text: tokenized in the pool, at the client's turn
        work = gateway.tokenize
        return await gateway.admission.run_tokenizer(  # chat=False
            client, deadline, work, prompt, False, add_special_tokens
        )
    return gateway.tokenize(prompt)  # ids: only checked against the vocabulary


def _salt(client: Client, requested: str | None) -> str | None:
    """The request's cache salt: its own, within its API key's (no key can reach another's)."""
    if client.cache_salt is None:
        return requested
    if requested is None:
        return client.cache_salt
    # hashed: within the salt's length limit, and no two (key, salt) pairs give the same salt
    return hashlib.sha256(f"{client.cache_salt}\0{requested}".encode()).hexdigest()


def _check_tokens(admission: Admission, subs: list[SubRequest], param: str) -> None:
    lens = [len(sub.prompt_token_ids) for sub in subs]
    admission.check_tokens(lens, [s.params.max_tokens for s in subs], subs[0].params.n, param)


def _builder(gateway: Gateway, kind, response_id, subs, n, num_logprobs, body) -> ResponseBuilder:  # type: ignore[no-untyped-def]
    builder = ResponseBuilder(
        kind,
        response_id,
        now_unix(),
        gateway.model.name,
        len(subs) * n,
        gateway.model.tokenizer,
        num_logprobs,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
    )
    builder.usage.prompt_tokens = sum(len(s.prompt_token_ids) for s in subs)
    builder.tokens_as_ids = body.return_tokens_as_token_ids
    builder.return_token_ids = bool(body.return_token_ids)
    _expect_prompts(builder, subs, body)
    return builder


def _expect_prompts(builder: ResponseBuilder, subs: list[SubRequest], body: Any) -> None:
    """What the builder shows of the prompts: echo (completions) and their logprobs."""
    echo = bool(getattr(body, "echo", False))
    texts = body.prompts() if echo else [""] * len(subs)
    decode = builder.tokenizer.decode
    prompts = [
        Prompt(
            s.prompt_token_ids, t if isinstance(t, str) else decode(t, skip_special_tokens=False)
        )
        for s, t in zip(subs, texts)
    ]
    drop = echo and body.max_tokens == 0
    builder.expect_prompts(prompts, echo, drop, body.num_prompt_logprobs)


async def _respond(
    gateway: Gateway,
    request: Request,
    subs: list[SubRequest],
    builder: ResponseBuilder,
    stream: bool,
    arrival: float,
    admit: _Admit,
) -> Response:
    if gateway.config.log_requests:
        _log_prompts(gateway, subs)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "pdserve.request_id": builder.id,
                "pdserve.model": gateway.model.name,
                "pdserve.prompt_tokens": builder.usage.prompt_tokens,
                "pdserve.num_prompts": len(subs),
                "pdserve.n": subs[0].params.n,
                "pdserve.stream": stream,
            }
        )
    slots = len(subs) * subs[0].params.n  # every sub-request takes one
    entry = entry_of(request.scope)  # the access log's line: filled in as the request goes
    entry.model, entry.subs = gateway.model.name, subs
    if not stream:
        clock = _Clock(gateway, arrival, span, entry)
        try:
            await _unless_disconnected(
                request, _collect(gateway, subs, builder, clock, admit, slots)
            )
        except _ClientLeft:  # nobody is listening; the status only shows in metrics and logs
            return Response(status_code=499)
        finally:
            clock.finish(builder)
        return JSONResponse(builder.response())
    events = _events(gateway, subs, builder, _Clock(gateway, arrival, span, entry), admit, slots)
    try:  # errors before the first event get their HTTP status; a client gone cancels it
        first = await _unless_disconnected(request, anext(events))
    except BaseException as exc:
        await events.aclose()
        if isinstance(exc, _ClientLeft):  # before the first token: nothing runs any more
            return Response(status_code=499)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _collect(
    gateway: Gateway,
    subs: list[SubRequest],
    builder: ResponseBuilder,
    clock: _Clock,
    admit: _Admit,
    slots: int,
) -> None:
    async with admit(slots) as ticket, aclosing(gateway.chunks(subs)) as chunks:
        async for index, chunk in chunks:
            _check_not_aborted(chunk)
            clock.tick(chunk, ticket)
            builder.add(index, chunk)
    _finish_usage(builder, subs)


async def _events(
    gateway: Gateway,
    subs: list[SubRequest],
    builder: ResponseBuilder,
    clock: _Clock,
    admit: _Admit,
    slots: int,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of a streaming response: takes the concurrency slots when it starts and
    frees them when it ends."""
    started = False
    try:
        async with admit(slots) as ticket, aclosing(gateway.chunks(subs)) as chunks:
            async for index, chunk in chunks:
                _check_not_aborted(chunk)
                clock.tick(chunk, ticket)
                event = builder.stream_event(index, chunk)
                if event is not None:
                    started = True
                    yield event
        _finish_usage(builder, subs)
        if builder.include_usage:
            yield builder.usage_event()
        yield DONE
    except APIError as error:
        if not started:
            raise
        tracing.set_error(clock.span, f"error event {error.status}: {error.message}")
        yield builder.error_event(error.message, error.status, error.type)
        yield DONE
    finally:
        clock.finish(builder)


def _finish_usage(builder: ResponseBuilder, subs: list[SubRequest]) -> None:
    builder.usage.cached_tokens = sum(s.num_cached_tokens for s in subs)
    builder.usage.timings = [
        {"kv_source": s.kv_source, **{f"{k}_ms": round(v * 1e3, 2) for k, v in s.timings.items()}}
        for s in subs
    ]


def _check_not_aborted(chunk: Chunk) -> None:
    """A chunk whose finish reason is not an answer's becomes the request's error."""
    if chunk.finish_reason == "abort":
        raise APIError(503, "the worker aborted the request (it is shutting down); retry")
    if chunk.finish_reason == "grammar_dead_end":
        raise APIError(400, GRAMMAR_DEAD_END, code="grammar_dead_end")


GRAMMAR_DEAD_END = (
    "the structured output cannot be completed with this model's vocabulary: after the output "
    "so far its grammar allows no token (the next character needs a byte no token of the model "
    "holds, such as some control characters or unassigned code points)"
)


def _installed_version() -> str:
    try:
        return package_version("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _ClientLeft(Exception):
    """The client disconnected before the awaited work was done."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """What ``work`` returns or raises; ``_ClientLeft`` when the client left first, and then
    ``work`` is cancelled (which aborts its request on the workers)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _ClientLeft
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class _Admit:
    """The last step of a request's admission, taken when its response starts: its slots."""

    admission: Admission
    client: Client
    deadline: float

    def __call__(self, slots: int) -> AbstractAsyncContextManager[Ticket]:
        return self.admission.admitted(self.client, slots, self.deadline)


class _Clock:
    """TTFT, inter-token and end-to-end latency of one request, into the router's histograms,
    and the request judged against the latency SLOs that are set: TTFT at its first token, its
    mean time between the tokens after the first (TPOT, all choices together) when it ends."""

    def __init__(self, gateway: Gateway, arrival: float, span: trace.Span, entry: AccessEntry):
        self.metrics = gateway.metrics
        self.arrival = arrival
        self.span = span  # the request's root span (a no-op one when tracing is off)
        self.entry = entry
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0

    def tick(self, chunk: Chunk, ticket: Ticket) -> None:
        if not chunk.token_ids:
            return
        now = time.perf_counter()
        if self.last is None:
            ticket.start()
            self.first = now
            self.metrics.ttft_seconds.observe(now - self.arrival)
            self.metrics.judge("ttft", now - self.arrival)
        else:
            per_token = (now - self.last) / len(chunk.token_ids)
            for _ in chunk.token_ids:
                self.metrics.itl_seconds.observe(per_token)
        self.last = now
        self.num_tokens += len(chunk.token_ids)

    def finish(self, builder: ResponseBuilder) -> None:
        now = time.perf_counter()
        self.metrics.e2e_seconds.observe(now - self.arrival)
        if self.first is None:
            self.metrics.judge_unanswered(now - self.arrival)
        elif self.last is not None and self.num_tokens > 1:
            self.metrics.judge("itl", (self.last - self.first) / (self.num_tokens - 1))
        self.metrics.prompt_tokens.inc(builder.usage.prompt_tokens)
        self.metrics.generation_tokens.inc(builder.usage.completion_tokens)
        self.entry.prompt_tokens = builder.usage.prompt_tokens
        self.entry.output_tokens = builder.usage.completion_tokens
        self.entry.first_token = self.first
        if self.span.is_recording():
            reasons = [c.finish_reason or "none" for c in builder.choices]
            self.span.set_attributes(
                {
                    "pdserve.output_tokens": builder.usage.completion_tokens,
                    "pdserve.cached_tokens": builder.usage.cached_tokens,
                    "pdserve.finish_reasons": reasons,
                }
            )


def _log_prompts(gateway: Gateway, subs: list[SubRequest]) -> None:
    """``--log-requests``: each prompt's length and text (off by default: prompts are private)."""
    for sub in subs:
        text = gateway.model.tokenizer.decode(sub.prompt_token_ids, skip_special_tokens=False)
        log.info("%s: prompt of %d tokens: %r", sub.request_id, len(sub.prompt_token_ids), text)


def _workers(gateway: Gateway) -> dict[str, Any]:
    view, orchestrator = gateway.view, gateway.orchestrator
    rows = []
    for w in view.workers(include_draining=True):
        rejection = gateway.rejection(w)
        rows.append(
            {
                "id": w.worker_id,
                "role": w.role,
                "host": w.host,
                "pid": w.pid,
                "grpc_address": w.grpc_address,
                "kv_address": w.kv_address,
                "kv_transport": w.kv_transport,
                "healthy": not w.draining and rejection is None,
                "draining": w.draining,
                "rejected_because": rejection,
                "fingerprint": {**asdict(w.fingerprint), "key": w.fingerprint.key()},
                "kv_blocks_total": w.kv_blocks_total,
                "kv_blocks_used": w.kv_blocks_used,
                "kv_blocks_cached": w.kv_blocks_cached,
                "prefix_caching": w.prefix_caching,
                "num_running": w.num_running,
                "num_waiting": w.num_waiting,
                "router_in_flight": orchestrator.in_flight.get(w.worker_id, 0),
                "updated_at": w.updated_at,
            }
        )
    return {
        "object": "list",
        "data": rows,
        "incompatible_pairs": [
            {"prefill": p.worker_id, "decode": d.worker_id, "reason": reason}
            for p, d, reason in view.incompatible_pairs()
        ],
        "registry": {
            "stale": view.is_stale,
            "last_error": view.last_error,
            "age_seconds": view.age_seconds,
        },
    }
