"""The router's access log: one line per HTTP request (probes and scrapes aside), when it ends,
and each request's id.

The id is the client's ``X-Request-Id`` when it sends a usable one (at most 128 characters of
letters, digits and ``._:-``; else a new one), or else the body's ``request_id`` (vLLM's field;
the header wins, as in vLLM; an unusable one is a 400), and every response carries it back in
``X-Request-Id``, and the response's ``id`` is ``chatcmpl-<id>`` (vLLM's form). The id of the
request the workers see contains it too (with a random suffix when the client chose the id: two
clients may choose the same one), so a grep for it finds the request's lines in the workers'
logs.

`AccessLogMiddleware` sits outside the edge, so it sees every answer: refusals (401, 413, 400,
429, 503), successes, and clients that left (499, also when a stream loses its client after it
started). The handler fills in what only it knows (model, tokens, how the KV came, the time to
the first token) on the request's `AccessEntry`, ``scope["state"][ENTRY]``. A line names the
client by its id (``key:<name>`` or ``addr:<host>``), never by its API key, and holds no prompt
text.

``--log-format text`` (default) writes ``key=value`` fields after the usual log prefix;
``json`` writes one JSON object per line, alone, for log pipelines.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import APIError
from router.worker_calls import SubRequest

log = logging.getLogger("pdserve.access")
HEADER = b"x-request-id"
ENTRY = "access_entry"  # scope["state"] key of the request's AccessEntry
QUIET = {
    "/health",
    "/ping",
    "/ready",
    "/version",
    "/metrics",
    "/v1/workers",
}  # probes and scrapes: no line
_USABLE_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_PLAIN = re.compile(r"[^\s\"=]+")


@dataclass
class AccessEntry:
    """What one request's access line says; the handler fills in the middle fields."""

    request_id: str
    chosen_by_client: bool
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    model: str | None = None
    subs: list[SubRequest] = field(default_factory=list)  # how each prompt's KV came
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    first_token: float | None = None  # time.perf_counter() at the first token

    def take_body_id(self, request_id: str | None) -> None:
        """vLLM's body field ``request_id`` names the request unless the header did."""
        if request_id is None:
            return
        if not _USABLE_ID.fullmatch(request_id.encode()):
            msg = "request_id must be 1 to 128 letters, digits or any of ._:-"
            raise APIError(400, msg, param="request_id")
        if not self.chosen_by_client:
            self.request_id, self.chosen_by_client = request_id, True

    def response_id(self, prefix: str) -> str:
        """The response's ``id``: ``<prefix>-<request id>``, as vLLM's (no suffix: the workers'
        ids keep requests apart, not this one)."""
        return f"{prefix}-{self.request_id}"

    def worker_request_id(self, prefix: str) -> str:
        """The id the workers see (its prompts' ids add ``-<index>``): unique even when the
        client chose the id."""
        if self.chosen_by_client:
            return f"{prefix}-{self.request_id}-{uuid.uuid4().hex[:8]}"
        return f"{prefix}-{self.request_id}"

    def fields(self, client: str | None, status: int) -> dict[str, Any]:
        now = time.perf_counter()
        routes = list(dict.fromkeys(s.kv_source for s in self.subs if s.kv_source))
        ttft = None if self.first_token is None else (self.first_token - self.start) * 1e3
        return {
            "request_id": self.request_id,
            "client": client,
            "method": self.method,
            "path": self.path,
            "model": self.model,
            "route": "+".join(routes) or None,
            "status": status,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": None if ttft is None else round(ttft, 1),
            "total_ms": round((now - self.start) * 1e3, 1),
        }


def entry_of(scope: Scope) -> AccessEntry:
    """The request's entry (a detached one where no middleware made one: tests' apps)."""
    entry = scope.get("state", {}).get(ENTRY)
    if entry is None:
        entry = AccessEntry(uuid.uuid4().hex, False, scope.get("method", ""), scope["path"])
    return entry


class AccessLogMiddleware:
    """Names each request (``X-Request-Id``), echoes the id, writes its line when it ends."""

    def __init__(self, app: ASGIApp, log_format: str):
        self.app = app
        self.write = _json_line if log_format == "json" else _text_line
        _configure(log, log_format)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _request_id(scope.get("headers", ()))
        entry = AccessEntry(
            sent or uuid.uuid4().hex, sent is not None, scope["method"], scope["path"]
        )
        scope.setdefault("state", {})[ENTRY] = entry
        response = {"status": 500, "started": False, "complete": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"], response["started"] = message["status"], True
                header = (HEADER, entry.request_id.encode())  # the body may have named it
                message = {**message, "headers": [*message.get("headers", ()), header]}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                response["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if scope["path"] not in QUIET:
                status = response["status"]
                if response["started"] and not response["complete"]:
                    status = 499  # the client left while the answer was sent
                client = scope["state"].get("client")
                self.write(entry.fields(client.id if client is not None else None, status))


def _request_id(headers: Any) -> str | None:
    """The client's ``X-Request-Id`` when it is usable as one, else None."""
    for name, value in headers:
        if name == HEADER:
            return value.decode() if _USABLE_ID.fullmatch(value) else None
    return None


def _text_line(fields: dict[str, Any]) -> None:
    log.info("access %s", " ".join(f"{k}={_text_value(v)}" for k, v in fields.items()))


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def _json_line(fields: dict[str, Any]) -> None:
    time_ = datetime.now(UTC).isoformat(timespec="milliseconds")
    log.info("%s", json.dumps({"time": time_, **fields}))


def _configure(logger: logging.Logger, log_format: str) -> None:
    """JSON lines go alone to stderr (no log prefix); text ones through the usual handlers."""
    if log_format != "json":
        logger.handlers, logger.propagate = [], True
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
