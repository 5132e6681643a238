"""The PrefillService gRPC servicer.

A request's life here: queued -> computing (chunked prefill in the engine's batch, prefix cache
reused) -> first token sampled -> pinned (lease granted, KVHandle returned) -> released by the
decode worker, or expired when its lease runs out. Nothing stays pinned past its lease, and
nothing is freed while a transfer reads it: the pins' one owner (``TensorBlockSource``) makes
every transition and calls back to free the engine's blocks once the last transfer reading them
is done. A pin is named by a handle unique to it (``pin_key``: the KVHandle's ``request_id``),
so a late Release of an earlier attempt with the same request id cannot end a newer pin.

A prefill that cannot finish ends its call at once with ABORTED: a streamed one whose pin ended
(lease expired, released) while it still computed, or one the engine aborted (a failed step).

Traced as a ``prefill`` span (a child of the router's call, from the call's metadata) with
``prefill.queue`` (admitted -> first scheduled) and ``prefill.compute`` (first scheduled -> first
token), built after the fact from the engine sequence's timestamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from opentelemetry.trace import Span

from common import tracing
from common.sampling_params import SamplingParams
from common.wire import (
    logprobs_to_proto,
    params_from_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
)
from kvtransfer.base import KVLayout, block_checksums
from kvtransfer.source import TensorBlockSource, pin_key
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.engine.outputs import RequestOutput
from services.engine.sequence import Sequence
from services.worker.async_engine import AsyncEngine
from services.worker.convert import layout_to_proto
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrefillIdentity:
    """What a KVHandle says about where the blocks are."""

    worker_id: str
    grpc_address: str
    kv_transport: str
    kv_address: str
    layout: KVLayout
    fingerprint: str


class PrefillService(pb_grpc.PrefillServiceServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        leases: TensorBlockSource,
        identity: PrefillIdentity,
        metrics: WorkerMetrics,
        max_pending: int,
    ):
        self.engine = engine
        self.leases = leases
        self.identity = identity
        self.metrics = metrics
        self.max_pending = max_pending
        self.num_active = 0
        self.draining = False

    async def Prefill(  # noqa: N802 (gRPC method name)
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        span = _span(request, context)
        with tracing.ending(span):
            params = await self._admit(request, context)
            self.num_active += 1
            try:
                with _logged(request):
                    return await self._prefill(request, params, context, span)
            finally:
                self.num_active -= 1

    async def PrefillStream(  # noqa: N802
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        span = _span(request, context)
        answered = False  # the router cancels the call once it has the answer: not an error
        with tracing.ending(span, lambda: answered):
            params = await self._admit(request, context)
            self.num_active += 1
            try:
                with _logged(request):
                    async for event in self._prefill_streamed(request, params, context, span):
                        answered = event.HasField("done")
                        yield event
            finally:
                self.num_active -= 1

    async def _admit(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> SamplingParams:
        if self.draining or self.num_active >= self.max_pending:
            self.metrics.requests.labels(outcome="rejected").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining or full")
        try:
            params = dataclasses.replace(params_from_proto(request.sampling), n=1)
            await self.engine.compile_grammar(params)  # off the step thread
            return params
        except ValueError as exc:
            self.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: abort raises

    async def _prefill(self, request, params, context, span: Span):  # type: ignore[no-untyped-def]
        final = None
        seqs: list[Sequence] = []
        rid = request.request_id
        with self.metrics.prefill_seconds.time():
            try:
                stream, seqs = await self.engine.add_request(
                    rid, list(request.token_ids), params, True, request.cache_salt or None
                )
                async for output in self.engine.outputs(rid, stream):
                    final = output if final is None else _merged(final, output)
            except ValueError as exc:
                self.metrics.requests.labels(outcome="invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert final is not None
        if final.kv_block_ids is None:  # aborted (a failed engine step): nothing to lend
            await asyncio.shield(self.engine.abort(rid))  # frees what it kept pinned
            await self._aborted(context, "the prefill was aborted (engine failure)")
        assert final.kv_block_ids is not None
        if span.is_recording():
            _trace_prefill(span, seqs[0], final.num_cached_tokens, len(final.kv_block_ids))
        response = _response(final, seqs[0])
        if response.finish_reason:  # the first token ended the request: nothing to pull
            await asyncio.shield(self.engine.release_pinned(rid))
            self.metrics.requests.labels(outcome="finished").inc()
            return response
        # Grant the lease before any await: from here on the reaper frees the blocks even if
        # this call is cancelled.
        key = pin_key(rid)
        self.leases.pin(key, final.kv_block_ids, with_checksums=False, request_id=rid)
        blocks = self.leases.read_blocks(key, final.kv_block_ids)
        checksums = await asyncio.to_thread(block_checksums, blocks)
        response.kv.CopyFrom(self._handle(key, final.kv_block_ids, len(seqs[0].prompt_token_ids)))
        response.kv.checksums.extend(checksums)
        self.metrics.requests.labels(outcome="pinned").inc()
        return response

    async def _prefill_streamed(self, request, params, context, span: Span):  # type: ignore[no-untyped-def]
        """The handle as soon as the prompt's blocks are reserved (they are pulled while the
        rest is computed), then the answer. The lease decides when the blocks go: a call that
        ends early releases it, and the engine frees (or aborts) once no transfer reads them.
        A pin that ends while the prompt computes aborts the prefill: the call ends ABORTED."""
        rid, tokens = request.request_id, list(request.token_ids)
        key = pin_key(rid)
        added, leased, final = False, False, None
        try:
            with self.metrics.prefill_seconds.time():
                try:
                    salt = request.cache_salt or None
                    stream, seqs = await self.engine.add_request(rid, tokens, params, True, salt)
                    added = True
                except ValueError as exc:
                    self.metrics.requests.labels(outcome="invalid").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                block_ids = await self.engine.prefill_admitted(rid)
                seq = seqs[0]
                progress = lambda: seq.num_computed_tokens  # noqa: E731
                self.leases.pin(
                    key, block_ids, progress=progress, num_tokens=len(tokens), request_id=rid
                )
                leased = True
                yield pb.PrefillEvent(kv=self._handle(key, block_ids, len(tokens), streaming=True))
                async for output in self.engine.outputs(rid, stream, abort_on_exit=False):
                    final = output if final is None else _merged(final, output)
            assert final is not None
            if final.outputs[0].finish_reason == "abort":
                ended = not self.leases.is_pinned(key)  # else the engine failed a step
                await self._aborted(context, _LEASE_ENDED if ended else "the prefill was aborted")
            if span.is_recording():
                _trace_prefill(span, seq, final.num_cached_tokens, len(block_ids))
            response = _response(final, seq)
            self.leases.finish(key, _final(response))
            if response.finish_reason:  # nothing to decode: the blocks may go
                self.leases.release(key)
            outcome = "finished" if response.finish_reason else "pinned"
            self.metrics.requests.labels(outcome=outcome).inc()
        except BaseException:
            if leased:  # freed (or aborted) once no transfer reads the blocks
                self.leases.release(key)
            elif added:  # never abort a refused call's id: it may name another live request
                await asyncio.shield(self.engine.abort(rid))
            raise
        # Out of the try: a caller that goes away once it has the answer (the router cancels
        # the call) must not end the lease the decode worker still pulls under.
        yield pb.PrefillEvent(done=response)

    async def _aborted(self, context: grpc.aio.ServicerContext, detail: str) -> None:
        self.metrics.requests.labels(outcome="aborted").inc()
        log.info("prefill aborted: %s", detail)
        await context.abort(grpc.StatusCode.ABORTED, detail)

    def _handle(
        self, key: str, block_ids: list[int], num_tokens: int, streaming: bool = False
    ) -> pb.KVHandle:
        ident = self.identity
        return pb.KVHandle(
            request_id=key,  # the pin's handle: what pulls, Release and RenewLease name
            prefill_worker_id=ident.worker_id,
            transport=ident.kv_transport,
            address=ident.kv_address,
            block_ids=block_ids,
            num_tokens=num_tokens,
            layout=layout_to_proto(ident.layout),
            lease_expires_unix_ms=_unix_ms_in(self.leases.lease_seconds),
            fingerprint=ident.fingerprint,
            release_address=ident.grpc_address,
            streaming=streaming,
        )

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        # ``request_id`` is the handle's: the pin's key. The blocks go back to the engine when
        # no transfer reads them any more (``on_unpin``).
        return pb.ReleaseResponse(released=self.leases.release(request.request_id))

    async def RenewLease(  # noqa: N802
        self, request: pb.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewLeaseResponse:
        if not self.leases.renew_lease(request.request_id):
            return pb.RenewLeaseResponse(renewed=False)
        expires = _unix_ms_in(self.leases.lease_seconds)
        return pb.RenewLeaseResponse(renewed=True, lease_expires_unix_ms=expires)

    async def reap_expired_leases(self, interval: float = 0.2) -> None:
        """End every lease that ran out (runs for the worker's lifetime); the blocks go back
        to the engine once no transfer reads them (``on_unpin``)."""
        while True:
            for request_id in self.leases.expire():
                log.info("lease of %s expired; freeing its blocks", request_id)
                self.metrics.lease_expirations.inc()
            await asyncio.sleep(interval)


_LEASE_ENDED = "the lease ended (expired or released) before the prefill finished"


@contextlib.contextmanager
def _logged(request: pb.PrefillRequest) -> Iterator[None]:
    """One line per request when it ends, by the id in the router's access log."""
    start, outcome = time.perf_counter(), "failed"
    try:
        yield
        outcome = "done"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"
        raise
    finally:
        ms = (time.perf_counter() - start) * 1e3
        log.info(
            "request %s %s: %d prompt tokens, %.0f ms",
            request.request_id,
            outcome,
            len(request.token_ids),
            ms,
        )


def _span(request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> Span:
    return tracing.start_grpc_server_span(
        "prefill",
        context.invocation_metadata(),
        {"pdserve.request_id": request.request_id, "pdserve.prompt_tokens": len(request.token_ids)},
    )


def _response(final: RequestOutput, seq: Sequence) -> pb.PrefillResponse:
    """The answer: the first token, its text (less what could start a stop string), whether it
    ended the request, and the phases."""
    out = final.outputs[0]
    response = pb.PrefillResponse(
        first_token=out.token_ids[0] if out.token_ids else 0,  # none at a grammar's dead end
        first_text=out.text,
        num_cached_tokens=final.num_cached_tokens,
        finish_reason=out.finish_reason or "",
        timings=prefill_timings(seq),
    )
    set_stop_reason(response, out.stop_reason)
    if out.logprobs:
        response.logprobs.CopyFrom(logprobs_to_proto(out.logprobs[0]))
    response.prompt_logprobs.extend(
        prompt_logprobs_to_proto(final.prompt_logprobs, final.prompt_logprob_ranks)
    )
    return response


def _final(response: pb.PrefillResponse) -> dict[str, Any]:
    """What a streamed pull's last part carries to the decode worker."""
    logprobs = {str(e.token_id): e.logprob for e in response.logprobs.entries}
    return {
        "first_token": response.first_token,
        "logprobs": logprobs or None,
        "finish_reason": response.finish_reason,
    }


def prefill_timings(seq: Sequence) -> pb.PhaseTimings:
    """Queue (admitted -> first scheduled) and compute (-> first token) of a prefill."""
    if seq.first_scheduled_time is None or seq.first_token_time is None:
        return pb.PhaseTimings()
    return pb.PhaseTimings(
        queue_s=seq.first_scheduled_time - seq.arrival,
        compute_s=seq.first_token_time - seq.first_scheduled_time,
    )


def _merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    first.merge(later)
    return first


def _trace_prefill(span: Span, seq: Sequence, num_cached_tokens: int, num_blocks: int) -> None:
    """The prefill span's attributes and its queue and compute phases."""
    span.set_attributes(
        {
            "pdserve.cached_tokens": num_cached_tokens,
            "pdserve.kv_blocks": num_blocks,
            "pdserve.preemptions": seq.num_preemptions,
        }
    )
    tracing.add_span("prefill.queue", span, seq.arrival, seq.first_scheduled_time)
    tracing.add_span(
        "prefill.compute",
        span,
        seq.first_scheduled_time,
        seq.first_token_time,
        {"pdserve.computed_tokens": seq.num_prompt_tokens - num_cached_tokens},
    )


def _unix_ms_in(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)
