"""Request tracing with OpenTelemetry: one trace per request across the router, the prefill
worker, the KV transfer and the decode worker.

Each process calls `setup_tracing` once, at its start, and `TracerProvider.shutdown` (which
flushes) at its end. Finished spans go to

- a JSON-lines file (``--trace-file``, `JsonLinesSpanExporter`): one object per span; several
  processes may append to the same file, each batch of lines being one ``write`` on an
  ``O_APPEND`` descriptor, so lines never interleave;
- an OpenTelemetry collector over OTLP/gRPC (``--otlp-endpoint``).

With neither, no SDK is installed: `TRACER` is then the API's no-op tracer, its spans do not
record (``is_recording()`` is False) and callers skip what they would only compute for a span.

The trace context crosses processes as W3C ``traceparent`` (and ``tracestate``): in gRPC
metadata from the router to the workers (`grpc_metadata`, `context_from_grpc`), and from a
client's HTTP headers into the router (`context_from_headers`).

The engine records plain ``time.monotonic()`` timestamps on its sequences (queued, first
scheduled, first token, finished); `add_span` turns two of them into a span after the fact.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

# A proxy: it records once `setup_tracing` installed a provider, and is a no-op until then.
TRACER = trace.get_tracer("pdserve")
TRACE_ID_HEADER = "x-pdserve-trace-id"
FILE_EXPORT_DELAY_MS = 500  # a local append is cheap: export often, so files are fresh
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C only, whatever OTEL_PROPAGATORS says
_FIELDS = frozenset(_PROPAGATOR.fields)  # traceparent, tracestate


def setup_tracing(
    service_name: str, trace_file: str | None = None, otlp_endpoint: str | None = None
) -> TracerProvider | None:
    """Install this process's tracer provider; None (and nothing installed) without a sink.

    ``service_name`` names the process in every span ("pdserve-router", "pdserve-prefill"...).
    Call it once per process, before serving; shut the provider down at exit to flush."""
    if not trace_file and not otlp_endpoint:
        return None
    resource = Resource.create({"service.name": service_name, "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if trace_file:
        exporter = JsonLinesSpanExporter(trace_file)
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=FILE_EXPORT_DELAY_MS)
        )
    if otlp_endpoint:
        # Imported here: grpc exporter modules are only worth loading when used.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    trace.set_tracer_provider(provider)
    log.info("tracing on as %s: file %s, OTLP %s", service_name, trace_file, otlp_endpoint)
    return provider


def is_enabled() -> bool:
    """Whether a recording tracer provider is installed in this process."""
    return not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


# -- the JSON-lines file -----------------------------------------------------------------------


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file that other processes may share."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the batch with one ``os.write``: with ``O_APPEND`` the kernel places it at the
        end of the file as a whole, so another process's lines never land inside it."""
        if self._fd is None:
            return SpanExportResult.FAILURE
        data = "".join(
            json.dumps(span_record(s), separators=(",", ":"), default=str) + "\n" for s in spans
        ).encode()
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # only when the disk is full or a signal cut it short
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            log.warning("cannot append spans to %s: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here: export writes at once

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a JSON-ready dict (ids in hex, times in unix nanoseconds)."""
    context, parent = span.context, span.parent
    assert context is not None
    start, end = span.start_time or 0, span.end_time or 0
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
        "parent_span_id": trace.format_span_id(parent.span_id) if parent is not None else None,
        "kind": span.kind.name,
        "start_unix_ns": start,
        "end_unix_ns": end,
        "duration_ms": round((end - start) / 1e6, 3),
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "unix_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
    }


# -- context across processes ------------------------------------------------------------------


def grpc_metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """``span``'s context as gRPC metadata (``traceparent``...); empty when tracing is off.

    A span that is valid but not recording (a client's ``traceparent`` asked not to sample) is
    passed on too, so the workers do not record that request either."""
    if not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def context_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The caller's trace context from a call's metadata (None: the call carries none)."""
    if metadata is None:
        return None
    carrier = {k: v for k, v in metadata if k in _FIELDS and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier) if carrier else None


def start_grpc_server_span(
    name: str, metadata: Iterable[tuple[str, str | bytes]] | None, attributes: dict[str, Any]
) -> Span:
    """A worker's span for one gRPC call, continuing the caller's trace from its metadata."""
    return TRACER.start_span(
        name, context=context_from_grpc(metadata), kind=SpanKind.SERVER, attributes=attributes
    )


def context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
    """A client's trace context from ASGI headers (None: the request carries none)."""
    carrier = {
        key: value.decode("latin-1")
        for name, value in headers
        if (key := name.decode("latin-1")) in _FIELDS
    }
    return _PROPAGATOR.extract(carrier) if carrier else None


def trace_id_of(span: Span) -> str:
    """``span``'s trace id in hex, as clients see it in ``x-pdserve-trace-id``."""
    return trace.format_trace_id(span.get_span_context().trace_id)


# -- spans -------------------------------------------------------------------------------------


@contextmanager
def ending(span: Span, answered: Callable[[], bool] = lambda: False) -> Iterator[Span]:
    """End ``span`` when the block exits; an exception escaping it marks the span an error,
    except a cancellation once ``answered()``: a stream whose last message is out may be
    cancelled by a client that needs nothing more, before the server has returned.

    Unlike ``start_as_current_span`` this does not make the span current, so the block may
    contain the ``yield``s of an async generator (which may resume in another context); pass
    the span to children explicitly (``trace.set_span_in_context``)."""
    try:
        yield span
    except BaseException as exc:  # GeneratorExit and CancelledError too: closed early
        cancelled = isinstance(exc, GeneratorExit | asyncio.CancelledError)
        if span.is_recording() and not (cancelled and answered()):
            if isinstance(exc, Exception):
                span.record_exception(exc)
            set_error(span, _describe(exc))
        raise
    finally:
        span.end()


def set_error(span: Span, description: str) -> None:
    """Mark ``span`` failed, saying why."""
    span.set_status(Status(StatusCode.ERROR, description))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return "cancelled"
    return f"{type(exc).__name__}: {exc}"


def add_span(
    name: str,
    parent: Span,
    start: float | None,
    end: float | None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A finished child of ``parent`` from two ``time.monotonic()`` readings taken in this
    process (skipped when one is missing: the phase never happened)."""
    if start is None or end is None or not parent.is_recording():
        return
    start_ns = unix_ns(start)
    span = TRACER.start_span(
        name,
        context=trace.set_span_in_context(parent),
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        start_time=start_ns,
    )
    span.end(end_time=max(start_ns, unix_ns(end)))


def unix_ns(monotonic_seconds: float) -> int:
    """A ``time.monotonic()`` reading of this process as unix time in nanoseconds."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_seconds * 1e9)
