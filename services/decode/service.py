"""The DecodeService gRPC servicer (also the colocated worker's entry point).

A disaggregated request's life here: waiting-for-blocks (admission: blocks for the incoming KV
are reserved in the pool, so pulls in flight count against capacity) -> pulling (only the blocks
the local prefix cache lacks; checksums verified) -> running (continuous batch, tokens streamed)
-> finished | aborted. If the pull fails, the prompt is recomputed here (or the request fails,
``on_pull_failure="fail"``); unverified blocks are never decoded from. The prefill worker is told
to release its blocks as soon as the pull is over, whatever its outcome.

Without a KVHandle (a colocated worker, or a request sent straight to it) the prompt is computed
here.

Traced as a ``decode`` span (a child of the router's call, from the call's metadata) with the
phases as children: ``decode.reserve`` (waiting for blocks), ``kv.transfer`` (the pull: transport,
blocks, bytes, seconds, outcome), ``decode.queue`` (KV in place -> first step), ``decode.prefill``
(only when the prompt is computed here) and ``decode.generate`` (-> finished). The last three are
built after the fact from the engine sequences' timestamps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import ParamSpec

import grpc
import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from kvtransfer.base import KVLayout, KVTransferClient, TransferError, adapt_layout
from pdserve import tracing
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.engine.llm_engine import PullPlan
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import FinishReason, Sequence
from services.prefill.service import layout_from_proto
from services.worker.async_engine import AsyncEngine
from services.worker.config import WorkerConfig
from services.worker.convert import chunks_from_output, logprobs_from_proto, params_from_proto
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_SECONDS = 2.0
P = ParamSpec("P")


@dataclass
class _Timeline:
    """One request's ``decode`` span and what its phases are built from once it is over."""

    span: Span
    seqs: list[Sequence] = field(default_factory=list)  # the engine's (live list)
    ready: float | None = None  # time.monotonic() when it could join the batch (KV in place)
    kv_source: str = "local"  # pulled | recomputed | local

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span started now under the decode span (end it, e.g. with ``tracing.ending``)."""
        return tracing.TRACER.start_span(
            name, context=trace.set_span_in_context(self.span), kind=kind
        )


class DecodeService(pb_grpc.DecodeServiceServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        client: KVTransferClient | None,
        layout: KVLayout,
        config: WorkerConfig,
        metrics: WorkerMetrics,
    ):
        self.engine = engine
        self.client = client
        self.layout = layout
        self.config = config
        self.metrics = metrics
        self.num_active = 0
        self.draining = False
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        span = tracing.start_grpc_server_span(
            "decode",
            context.invocation_metadata(),
            {
                "pdserve.request_id": request.request_id,
                "pdserve.prompt_tokens": len(request.prompt_token_ids),
            },
        )
        timeline = _Timeline(span)
        with tracing.ending(span):  # the span stays open while the tokens stream
            if self.draining or self.num_active >= self.config.max_pending_requests:
                self.metrics.requests.labels(outcome="rejected").inc()
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "decode worker is draining or full"
                )
            try:
                params = params_from_proto(request.sampling)
            except ValueError as exc:
                self.metrics.requests.labels(outcome="invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.num_active += 1
            try:
                async for chunk in self._generate(request, params, context, timeline):
                    yield chunk
            finally:
                self.num_active -= 1
                if span.is_recording():
                    _trace_decode(timeline)

    async def _generate(
        self,
        request: pb.GenerateRequest,
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        timeline: _Timeline,
    ) -> AsyncIterator[pb.GenerateChunk]:
        rid = request.request_id
        queue = self.engine.open_stream(rid)
        try:
            if request.HasField("kv"):
                finished, kv_source = await self._admit_prefilled(
                    request, params, context, timeline
                )
            else:
                timeline.seqs = await self.engine.call(
                    self.engine.engine.add_request, rid, list(request.prompt_token_ids), params
                )
                timeline.ready = timeline.seqs[0].arrival
                finished, kv_source = None, "local"
            timeline.kv_source = kv_source
        except ValueError as exc:
            self.engine.close_stream(rid)
            self.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BaseException:
            self.engine.close_stream(rid)
            await asyncio.shield(self.engine.call(self.engine.engine.abort_request, rid))
            raise
        if finished is not None:  # ended by its first token: nothing to decode
            self.engine.close_stream(rid)
            for chunk in chunks_from_output(finished, kv_source, first=True):
                yield chunk
            self.metrics.requests.labels(outcome="finished").inc()
            return
        first, last = True, time.perf_counter()
        async for output in self.engine.outputs(rid, queue):
            for chunk in chunks_from_output(output, kv_source, first):
                yield chunk
            now = time.perf_counter()
            if not first:
                self.metrics.itl_seconds.observe(now - last)
            first, last = False, now
        self.metrics.requests.labels(outcome="finished").inc()

    async def _admit_prefilled(
        self,
        request: pb.GenerateRequest,
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        timeline: _Timeline,
    ) -> tuple[RequestOutput | None, str]:
        """Reserve, pull and commit the prompt's KV; returns (final output if done, source)."""
        handle, rid = request.kv, request.request_id
        engine = self.engine.engine

        def add() -> tuple[RequestOutput | None, list[Sequence]]:
            finished = engine.add_prefilled_request(
                rid,
                list(request.prompt_token_ids),
                request.first_token,
                params,
                logprobs_from_proto(request.first_logprobs),
            )
            return finished, engine.sequences(rid)

        try:
            finished, timeline.seqs = await self.engine.call(add)
            if finished is not None:
                return finished, "pulled"
            with self.metrics.pull_seconds.time():
                reserve = timeline.child("decode.reserve")
                with tracing.ending(reserve):
                    plan = await self._reserve(rid)
                    reserve.set_attributes(
                        {
                            "pdserve.kv_blocks": len(plan.dest_block_ids),
                            "pdserve.cached_tokens": plan.num_cached_tokens,
                        }
                    )
                return None, await self._pull(plan, handle, timeline, context)
        finally:
            self._spawn(self._release(handle))

    async def _reserve(self, rid: str) -> PullPlan:
        """Wait for room in the pool (backpressure, not failure) and reserve it."""
        while True:
            plan = await self.engine.call(self.engine.engine.reserve_pull, rid)
            if plan is not None:
                return plan
            await self.engine.wait_for_step(timeout=0.5)

    async def _pull(
        self,
        plan: PullPlan,
        handle: pb.KVHandle,
        timeline: _Timeline,
        context: grpc.aio.ServicerContext,
    ) -> str:
        engine = self.engine.engine
        span = timeline.child("kv.transfer", SpanKind.CLIENT)
        with tracing.ending(span):  # cancelled mid-pull: an error, outcome "failed"
            span.set_attributes(
                {
                    "pdserve.kv.transport": handle.transport,
                    "pdserve.kv.blocks": len(plan.block_indices),
                    "pdserve.kv.source_worker_id": handle.prefill_worker_id,
                    "pdserve.kv.outcome": "failed",
                }
            )
            start = time.perf_counter()
            try:
                blocks, num_bytes = await self._fetch(plan, handle)
                error: Exception | None = None
            except (TransferError, ValueError) as exc:
                blocks, num_bytes, error = None, 0, exc
            outcome = "pulled" if error is None else "recomputed"
            if error is not None and self.config.on_pull_failure == "fail":
                outcome = "failed"
            span.set_attributes(
                {
                    "pdserve.kv.bytes": num_bytes,
                    "pdserve.kv.duration_s": time.perf_counter() - start,
                    "pdserve.kv.outcome": outcome,
                }
            )
            if error is not None:
                tracing.set_error(span, f"KV pull failed: {error}")
        if error is not None:
            if outcome == "failed":
                self.metrics.pulls.labels(outcome="failed").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV pull failed: {error}")
            log.warning("KV pull of %s failed (%s); recomputing the prompt", plan.request_id, error)
            recompute = _stamped(engine.recompute_pull)
            timeline.ready = await self.engine.call(recompute, plan.request_id)
            self.metrics.pulls.labels(outcome="recomputed").inc()
            return "recomputed"
        timeline.ready = await self.engine.call(_stamped(engine.commit_pull), plan, blocks)
        self.metrics.pulls.labels(outcome="pulled").inc()
        return "pulled"

    async def _fetch(self, plan: PullPlan, handle: pb.KVHandle) -> tuple[torch.Tensor, int]:
        """The planned blocks in this worker's layout, pulled and verified, and how many bytes
        came over the transport."""
        if self.client is None:
            raise TransferError("unsupported", "this worker has no KV transport client")
        if not plan.block_indices:
            return self.layout.empty_blocks(0), 0
        source_layout = layout_from_proto(handle.layout)
        same = source_layout == self.layout
        # Same layout: just the blocks we lack. Different block size/dtype: all, then adapt.
        indices = plan.block_indices if same else list(range(len(handle.block_ids)))
        block_ids = [handle.block_ids[i] for i in indices]
        timeout = self.config.pull_timeout_seconds
        if self.config.verify_checksums:
            if len(handle.checksums) != len(handle.block_ids):
                raise TransferError("checksum", "the KVHandle carries no checksums")
            expected = [handle.checksums[i] for i in indices]
            blocks = await self.client.pull_verified(
                handle.address, handle.request_id, block_ids, source_layout, timeout, expected
            )
        else:
            blocks = await self.client.pull(
                handle.address, handle.request_id, block_ids, source_layout, timeout
            )
        if same:
            return blocks, blocks.nbytes
        adapted = adapt_layout(blocks, source_layout, self.layout, handle.num_tokens)
        return adapted[plan.block_indices], blocks.nbytes

    async def _release(self, handle: pb.KVHandle) -> None:
        """Tell the prefill worker its blocks may go (best effort: its lease is the backstop)."""
        if not handle.release_address:
            return
        channel = self._channels.get(handle.release_address)
        if channel is None:
            channel = grpc.aio.insecure_channel(handle.release_address)
            self._channels[handle.release_address] = channel
        stub = pb_grpc.PrefillServiceStub(channel)
        try:
            await stub.Release(
                pb.ReleaseRequest(request_id=handle.request_id),
                timeout=RELEASE_TIMEOUT_SECONDS,
                metadata=self._metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            log.info("Release of %s not delivered (%s)", handle.request_id, exc.code().name)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.config.cluster_token
        return (("x-pdserve-token", token),) if token else ()

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()


def _stamped(fn: Callable[P, object]) -> Callable[P, float]:
    """``fn`` returning the time it ran at: an engine call's moment, not when its caller resumed
    (a step may have started in between)."""

    def run(*args: P.args, **kwargs: P.kwargs) -> float:
        fn(*args, **kwargs)
        return time.monotonic()

    return run


def _trace_decode(timeline: _Timeline) -> None:
    """The decode span's attributes and its phases after the KV was in place: queue (until the
    first step), prefill (only when the prompt was computed here) and generate (until done)."""
    span, seqs = timeline.span, timeline.seqs
    span.set_attribute("pdserve.kv_source", timeline.kv_source)
    if not seqs:  # refused, or ended by the prefill worker's first token
        return
    first_step = _earliest(s.first_scheduled_time for s in seqs)
    finished = None
    if all(s.finished_time is not None for s in seqs):
        finished = max(s.finished_time for s in seqs if s.finished_time is not None)
    num_output_tokens = sum(s.num_output_tokens for s in seqs)
    num_preemptions = sum(s.num_preemptions for s in seqs)
    reasons = [s.finish_reason.value if s.finish_reason else "none" for s in seqs]
    span.set_attributes(
        {
            "pdserve.output_tokens": num_output_tokens,
            "pdserve.preemptions": num_preemptions,
            "pdserve.finish_reasons": reasons,
        }
    )
    if any(s.finish_reason is FinishReason.ABORT for s in seqs):
        tracing.set_error(span, "aborted")
    tracing.add_span("decode.queue", span, timeline.ready, first_step)
    generate_start = first_step
    if timeline.kv_source != "pulled":  # the prompt was computed here first
        generate_start = _earliest(s.first_token_time for s in seqs)
        tracing.add_span("decode.prefill", span, first_step, generate_start)
    tracing.add_span(
        "decode.generate",
        span,
        generate_start,
        finished,
        {"pdserve.output_tokens": num_output_tokens, "pdserve.preemptions": num_preemptions},
    )


def _earliest(times: Iterable[float | None]) -> float | None:
    return min((t for t in times if t is not None), default=None)
