"""The gateway's edge, as plain ASGI middleware (cheap on every request): the first step of
admission (`router.admission`). It names the client of each ``/v1/*`` request (its API key,
checked before the body is read, else its address: ``scope["state"]["client"]``), bounds the
request body (413 before it is read when Content-Length says so, or as soon as a chunked body
grows past it) and its JSON nesting (400), keeps the operational endpoints to the cluster token
when asked (``--ops-need-token``), and counts responses by endpoint and status (probes and
scrapes excluded) and refusals by reason.

The body is read here, whole, and handed to the app again: FastAPI would turn an error raised
while it reads the body into a 400.

With tracing on, `TraceMiddleware` (outermost) opens each ``/v1/*`` request's root span,
continuing the client's ``traceparent``, and returns the trace id in ``x-pdserve-trace-id`` on
every response it sees start, errors and streams included."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import tracing
from router.clients import Client, ClientKeys
from router.errors import APIError
from router.limits import check_body_depth
from router.metrics import RouterMetrics

ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/workers",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/ready",
    "/version",
    "/metrics",
}
# not counted as client requests (/ping and /version: vLLM's, for the probes written for it)
PROBES = {"/health", "/ping", "/ready", "/version", "/v1/workers", "/metrics"}
LARGE_BODY_BYTES = 256 << 10  # bodies larger than this are parsed one at a time (_ParseGate)
PARSE_WAIT_SECONDS = 30.0  # a large body waits this long for its turn, then gets 503
PARSED = "release_parse_gate"  # scope["state"] key: the handler calls it once the body is parsed
CLIENT_PATHS = {"/tokenize", "/detokenize"}  # vLLM's, outside /v1/: a client's, as /v1/ is
OPERATIONAL = {"/metrics", "/v1/workers"}  # kept to the cluster token with --ops-need-token


def arrival(scope: Scope, wait_seconds: float) -> tuple[float, Client, float]:
    """For a handler whose body is parsed: when the request came (for its latency), its client
    (named here, at the edge) and the deadline of its admission, ``wait_seconds`` from now. The
    next large body may be parsed from here on."""
    state = scope.get("state", {})
    state.pop(PARSED, lambda: None)()
    client = state.get("client") or Client("addr:unknown")
    return time.perf_counter(), client, time.monotonic() + wait_seconds


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_body_depth: int,
        metrics: RouterMetrics,
        keys: ClientKeys,
        ops_token: str | None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_body_depth = max_body_depth
        self.metrics = metrics
        self.keys = keys
        self.large_bodies = asyncio.Semaphore(1)
        # None: the operational endpoints are open
        self.ops_keys = ClientKeys.single(ops_token) if ops_token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        status: dict[str, Any] = {"code": 500, "sent": False}

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["sent"] = message["status"], True
            await send(message)

        gate = _ParseGate(self.large_bodies)
        try:
            try:
                self._admit(scope, path)
                body = await self._read(scope, receive, gate)
            except APIError as error:
                await error.response()(scope, receive, send_counted)
                return
            await self.app(scope, _replay(body, receive), send_counted)
        finally:
            gate.release()
            if path not in PROBES:
                self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    def _admit(self, scope: Scope, path: str) -> None:
        """Who the client is (``scope["state"]["client"]``); a 401 when it may not ask."""
        headers = scope.get("headers", ())
        if self.ops_keys is not None and path in OPERATIONAL:
            try:
                self.ops_keys.client(headers, None)
            except APIError:
                self.metrics.rejected.labels(reason="unauthenticated").inc()
                raise APIError(
                    401,
                    f"{path} needs 'Authorization: Bearer <cluster token>'",
                    code="invalid_api_key",
                ) from None
            return
        if not path.startswith("/v1/") and path not in CLIENT_PATHS:
            return
        peer = scope.get("client")
        try:
            client = self.keys.client(headers, peer[0] if peer else None)
        except APIError:
            self.metrics.rejected.labels(reason="unauthenticated").inc()
            raise
        scope.setdefault("state", {})["client"] = client

    async def _read(self, scope: Scope, receive: Receive, gate: _ParseGate) -> bytes:
        try:
            body = await _read_body(receive, self.max_body_bytes, _content_length(scope))
        except APIError:
            self.metrics.rejected.labels(reason="body_too_large").inc()
            raise
        if len(body) > LARGE_BODY_BYTES:
            await gate.enter()
            scope.setdefault("state", {})[PARSED] = gate.release
        if body and scope["method"] == "POST":
            try:
                check_body_depth(body, self.max_body_depth)
            except APIError:
                self.metrics.rejected.labels(reason="body_too_deep").inc()
                raise
        return body


class _ParseGate:
    """One large body parsed at a time. Parsing JSON holds the GIL (no thread helps), about
    8 ms per MiB twice over (the depth check, then FastAPI); several at once would stall the
    event loop, every stream and probe with it, for their sum. Entered after the body is read,
    left when the handler starts (``scope["state"][PARSED]``) or the request ends."""

    def __init__(self, semaphore: asyncio.Semaphore):
        self.semaphore = semaphore
        self.held = False

    async def enter(self) -> None:
        try:
            async with asyncio.timeout(PARSE_WAIT_SECONDS):
                await self.semaphore.acquire()
        except TimeoutError:
            raise APIError(
                503, "the router is busy parsing large requests: retry later", retry_after=1
            ) from None
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.semaphore.release()


class TraceMiddleware:
    """A root span per ``/v1/*`` request; its trace id in the ``x-pdserve-trace-id`` header.

    The span is current while the app runs, so the handlers annotate it (request id, tokens,
    finish reasons) and the orchestrator's calls become its children. It ends when the response
    is complete: for a stream, after its last event."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        name = f"{method} {path if path in ENDPOINTS else 'other'}"  # bounded span names
        parent = tracing.context_from_headers(scope.get("headers", ()))
        attributes = {"http.request.method": method, "url.path": path}
        with tracing.TRACER.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            header = (tracing.TRACE_ID_HEADER.encode(), tracing.trace_id_of(span).encode())

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        tracing.set_error(span, f"HTTP {status}")
                    message = {**message, "headers": [*message.get("headers", ()), header]}
                await send(message)

            await self.app(scope, receive, send_traced)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int, length: int | None) -> bytes:
    """The whole request body, or a 413 APIError as soon as it is known to exceed ``limit``."""
    too_large = APIError(413, f"request body is larger than the limit of {limit} bytes")
    if length is not None and length > limit:
        raise too_large
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left; the app sees it on receive
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then waits for the disconnect."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
