"""The gateway's edge, as plain ASGI middleware (cheap on every request): the API key on
``/v1/*`` (checked before the body is read), a bound on the request body (413 before it is
read when Content-Length says so, or as soon as a chunked body grows past it) and on its JSON
nesting (400), and a count of responses by endpoint and status (probes and scrapes excluded).

The body is read here, whole, and handed to the app again: FastAPI would turn an error raised
while it reads the body into a 400.

With tracing on, `TraceMiddleware` (outermost) opens each ``/v1/*`` request's root span,
continuing the client's ``traceparent``, and returns the trace id in ``x-pdserve-trace-id`` on
every response it sees start, errors and streams included."""

from __future__ import annotations

import hmac
from typing import Any

from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import tracing
from router.errors import APIError
from router.limits import check_body_depth
from router.metrics import RouterMetrics

ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/workers",
    "/health",
    "/ready",
    "/metrics",
}
PROBES = {"/health", "/ready", "/v1/workers", "/metrics"}  # not counted as client requests


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        max_body_depth: int,
        metrics: RouterMetrics,
        api_key: str | None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_body_depth = max_body_depth
        self.metrics = metrics
        self.api_key = api_key

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

        try:
            try:
                if self.api_key is not None and path.startswith("/v1/"):
                    _check_key(scope, self.api_key)
                body = await _read_body(receive, self.max_body_bytes, _content_length(scope))
                if body and scope["method"] == "POST":
                    check_body_depth(body, self.max_body_depth)
            except APIError as error:
                await error.response()(scope, receive, send_counted)
                return
            await self.app(scope, _replay(body, receive), send_counted)
        finally:
            if path not in PROBES:
                self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


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


def _check_key(scope: Scope, expected: str) -> None:
    """401 unless the request carries ``Authorization: Bearer <expected>``."""
    header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
    scheme, _, key = header.partition(b" ")
    if not header:
        raise APIError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), expected.encode()):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


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
