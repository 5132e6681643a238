"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` + status.

Every failure the gateway reports goes through `APIError`, so clients (the official ``openai``
package included) raise the matching exception class: 400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 413, 429 RateLimitError, 503 InternalServerError.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the client gets as an OpenAI error object with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """The first pydantic error, naming the field (``messages.0.role``) and what is wrong; a body
    that is not JSON names why: its Content-Type (``content_type``: the request's header), or
    where the JSON goes wrong."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = _union_error(errors)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to the location ("prompt.str"): keep the field path.
    loc = [part for part in loc if not _is_type_tag(part)]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return _json_invalid(first, exc.body)
    if first.get("type") == "missing":
        if not param:
            return APIError(400, "the request body must be a JSON object")
        return APIError(400, f"'{param}' is a required field", param=param)
    if first.get("type") in _NOT_AN_OBJECT and param is None:
        if not _is_json(content_type):  # FastAPI left the body unparsed
            said = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
            return APIError(
                400,
                "the request body must be JSON sent with 'Content-Type: application/json' "
                f"(this request has {said})",
            )
        return APIError(400, "the request body must be a JSON object")
    prefix = f"'{param}': " if param else ""
    return APIError(400, prefix + message, param=param)


_NOT_AN_OBJECT = ("model_attributes_type", "dict_type")


def _union_error(errors: Sequence[Any]) -> dict[str, Any]:
    """The error to report. pydantic lists a failed union's members in order, and the first is
    usually "not a string" whatever the value (``prompt: [-1]``). Report instead the member the
    value fits: the deepest broken constraint (``prompt.0``: greater than or equal to 0), else
    the one member the value got deepest into; when it fits none, every shape the field takes."""
    first = errors[0]
    field, members = _union_members(first, errors)
    if len(members) < 2:
        return dict(first)
    broken = [e for e in members if not _is_shape_mismatch(e)]
    if broken:
        return dict(max(broken, key=lambda e: len(e["loc"])))
    depths = sorted((len(e["loc"]) for e in members), reverse=True)
    if depths[0] > depths[1]:
        return dict(max(members, key=lambda e: len(e["loc"])))
    shapes = [_shape(_plain_tag(str(e["loc"][len(field)]))) for e in members]
    named = list(dict.fromkeys(shape for shape in shapes if shape))
    if len(named) < 2:
        return dict(first)
    message = "Input should be " + ", ".join(named[:-1]) + " or " + named[-1]
    return {**first, "loc": field, "msg": message}


def _union_members(first: Any, errors: Sequence[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """The field of the first error when it is a union member's, and its members' errors."""
    loc = tuple(first.get("loc", ()))
    tagged = [i for i, part in enumerate(loc) if isinstance(part, str) and _is_type_tag(part)]
    if not tagged:
        return loc, []
    field = loc[: tagged[0]]
    n = len(field)
    members = [e for e in errors if tuple(e.get("loc", ()))[:n] == field and len(e["loc"]) > n]
    return field, members


def _is_shape_mismatch(error: Any) -> bool:
    """The value is not of this member's kind at all (a list where a string goes, a string
    among integers), as opposed to a value of its kind that breaks a constraint."""
    return str(error.get("type", "")).endswith(("_type", "_parsing"))


# How a message names a union member's type, by its tag without validators and constraints.
_SHAPES = {
    "str": "a string",
    "int": "an integer",
    "list[str]": "a list of strings",
    "list[int]": "a list of integers",
    "list[list[int]]": "a list of lists of integers",
    "list[TextPart]": "a list of content parts",
}


def _shape(tag: str) -> str:
    return "an object" if tag.startswith("dict[") else _SHAPES.get(tag, "")


def _plain_tag(tag: str) -> str:
    """``list[function-after[_encodable(), str]]`` -> ``list[str]``; ``constrained-int``: int."""
    tag = tag.replace("constrained-", "")
    while True:
        plain = re.sub(r"function-[a-z-]+\[[^\[\]]*?, ([^\[\]]+)\]", r"\1", tag)
        if plain == tag:
            return plain
        tag = plain


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test: application/json or application/*+json, parameters aside."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def _json_invalid(error: dict[str, Any], doc: Any) -> APIError:
    """Invalid JSON, with the parser's reason and where: line and column (1-based)."""
    reason = str(error.get("ctx", {}).get("error", "JSON decode error"))
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(doc, str):
        return APIError(400, f"request body is not valid JSON: {reason}")
    line = doc.count("\n", 0, pos) + 1
    column = pos - (doc.rfind("\n", 0, pos) + 1) + 1
    return APIError(
        400, f"request body is not valid JSON: {reason} at line {line}, column {column}"
    )


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "float", "bool") or (
        part.startswith(("function-", "list[", "dict[", "("))  # "(chat)": a tagged union's
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every error (ours, FastAPI's validation, Starlette's 404/405, bugs) to OpenAI's
    format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
