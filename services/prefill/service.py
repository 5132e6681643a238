"""The PrefillService gRPC servicer.

A request's life here: queued -> computing (chunked prefill in the engine's batch, prefix cache
reused) -> first token sampled -> pinned (lease granted, KVHandle returned) -> released by the
decode worker, or expired when its lease runs out. Nothing stays pinned past its lease, and
nothing is freed while a transfer reads it: the lease table (``TensorBlockSource``) calls back
to free the engine's blocks once the last transfer reading them is done.

Traced as a ``prefill`` span (a child of the router's call, from the call's metadata) with
``prefill.queue`` (admitted -> first scheduled) and ``prefill.compute`` (first scheduled -> first
token), built after the fact from the engine sequence's timestamps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
from opentelemetry.trace import Span

from common import tracing
from common.wire import logprobs_to_proto, params_from_proto
from kvtransfer.base import KVLayout, block_checksums
from kvtransfer.source import TensorBlockSource
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
        span = tracing.start_grpc_server_span(
            "prefill",
            context.invocation_metadata(),
            {
                "pdserve.request_id": request.request_id,
                "pdserve.prompt_tokens": len(request.token_ids),
            },
        )
        with tracing.ending(span):
            if self.draining or self.num_active >= self.max_pending:
                self.metrics.requests.labels(outcome="rejected").inc()
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "prefill worker is draining or full"
                )
            try:
                params = dataclasses.replace(params_from_proto(request.sampling), n=1)
            except ValueError as exc:
                self.metrics.requests.labels(outcome="invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.num_active += 1
            try:
                return await self._prefill(request, params, context, span)
            finally:
                self.num_active -= 1

    async def _prefill(self, request, params, context, span: Span):  # type: ignore[no-untyped-def]
        final = None
        seqs: list[Sequence] = []
        rid = request.request_id
        with self.metrics.prefill_seconds.time():
            try:
                stream, seqs = await self.engine.add_request(
                    rid, list(request.token_ids), params, pin_blocks=True
                )
                async for output in self.engine.outputs(rid, stream):
                    final = output if final is None else _merged(final, output)
            except ValueError as exc:
                self.metrics.requests.labels(outcome="invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        assert final is not None
        if span.is_recording():
            _trace_prefill(span, seqs[0], final.num_cached_tokens, len(final.kv_block_ids or ()))
        out = final.outputs[0]
        response = pb.PrefillResponse(
            first_token=out.token_ids[0],
            first_text=out.text,
            num_cached_tokens=final.num_cached_tokens,
            timings=prefill_timings(seqs[0]),
        )
        if out.logprobs:
            response.logprobs.CopyFrom(logprobs_to_proto(out.logprobs[0]))
        if final.kv_block_ids is None:  # the first token ended the request: nothing pinned
            response.finish_reason = out.finish_reason or "stop"
            self.metrics.requests.labels(outcome="finished").inc()
            return response
        # Grant the lease before any await: from here on the reaper frees the blocks even if
        # this call is cancelled.
        self.leases.pin(request.request_id, final.kv_block_ids, with_checksums=False)
        expires = _unix_ms_in(self.leases.lease_seconds)
        blocks = self.leases.read_blocks(request.request_id, final.kv_block_ids)
        checksums = await asyncio.to_thread(block_checksums, blocks)
        ident = self.identity
        response.kv.CopyFrom(
            pb.KVHandle(
                request_id=request.request_id,
                prefill_worker_id=ident.worker_id,
                transport=ident.kv_transport,
                address=ident.kv_address,
                block_ids=final.kv_block_ids,
                num_tokens=len(final.prompt_token_ids),
                layout=layout_to_proto(ident.layout),
                checksums=checksums,
                lease_expires_unix_ms=expires,
                fingerprint=ident.fingerprint,
                release_address=ident.grpc_address,
            )
        )
        self.metrics.requests.labels(outcome="pinned").inc()
        return response

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        # The blocks go back to the engine when no transfer reads them any more (``on_unpin``).
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
