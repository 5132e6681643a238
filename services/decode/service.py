"""The DecodeService gRPC servicer (also the colocated worker's entry point).

A disaggregated request's life here: waiting-for-blocks (admission: blocks for the incoming KV
are reserved in the pool, so pulls in flight count against capacity) -> pulling (only the blocks
the local prefix cache lacks; checksums verified) -> running (continuous batch, tokens streamed)
-> finished | aborted. If the pull fails, the prompt is recomputed here (or the request fails,
``on_pull_failure="fail"``); unverified blocks are never decoded from. The prefill worker is told
to release its blocks as soon as the pull is over, whatever its outcome, except when this worker
answers ABORTED (a streamed pull failed before the first token came): the router then asks again
with the first token, and a Release now would abort a prefill still computing; the router's own
Release or the lease ends that pin.

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
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.channels import ChannelPool
from common.prefill_client import PrefillClient, renew_delay
from common.sampling_params import SamplingParams
from common.wire import logprobs_from_proto, params_from_proto
from kvtransfer.base import KVLayout, KVTransferClient, TransferError, adapt_layout
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.engine.kv_handoff import PullPlan
from services.engine.outputs import RequestOutput
from services.engine.sequence import FinishReason, Sequence
from services.worker.async_engine import AsyncEngine, OutputStream
from services.worker.config import WorkerConfig
from services.worker.convert import chunks_from_output, layout_from_proto
from services.worker.handles import HandleChecker
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
# A streamed pull that failed before the first token came: this worker could serve the request
# if asked again with the first token (it can then recompute the prompt).
_RETRY_WITH_FIRST_TOKEN = "the prefill's first token never came: ask again with it"


@dataclass
class _Timeline:
    """One request's ``decode`` span and what its phases are built from once it is over."""

    span: Span
    seqs: list[Sequence] = field(default_factory=list)  # the engine's (live list)
    ready: float | None = None  # time.monotonic() when it could join the batch (KV in place)
    kv_source: str = "local"  # pulled | recomputed | local
    transfer_s: float = 0.0  # the KV pull, all of it
    transfer_exposed_s: float = 0.0  # the part of it after the prefill worker was done
    first_token_known: bool = True  # False: streamed KV, the first token comes with it
    # ABORTED back to the router, which asks again with the first token: the prefill worker's
    # blocks are left pinned for that retry (a Release would abort a prefill still computing).
    keep_handle: bool = False

    def timings(self) -> pb.PhaseTimings:
        """Queue (KV in place, or arrival, -> first step), first step, and the pull."""
        seq = self.seqs[0] if self.seqs else None
        if seq is None or seq.first_scheduled_time is None or seq.first_token_time is None:
            return pb.PhaseTimings(transfer_s=self.transfer_s)
        ready = self.ready if self.ready is not None else seq.arrival
        return pb.PhaseTimings(
            queue_s=max(0.0, seq.first_scheduled_time - ready),
            compute_s=seq.first_token_time - seq.first_scheduled_time,
            transfer_s=self.transfer_s,
            transfer_exposed_s=self.transfer_exposed_s,
        )

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> Span:
        """A span started now under the decode span (end it, e.g. with ``tracing.ending``)."""
        return tracing.TRACER.start_span(
            name, context=trace.set_span_in_context(self.span), kind=kind
        )


@dataclass
class _Pulled:
    """What a pull brought: the blocks (this worker's layout), the bytes that came over the
    transport, and for a streamed one what the prefill worker ended with and the part of the
    pull after it had ended."""

    blocks: torch.Tensor
    num_bytes: int = 0
    streamed: bool = False
    final: dict[str, Any] | None = None
    exposed_s: float = 0.0


class DecodeService(pb_grpc.DecodeServiceServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        client: KVTransferClient | None,
        layout: KVLayout,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        handles: HandleChecker,
    ):
        self.engine = engine
        self.handles = handles
        self.client = client
        self.layout = layout
        self.config = config
        self.metrics = metrics
        self.num_active = 0
        self.draining = False
        self.channels = ChannelPool()
        self.prefill_client = PrefillClient(self.channels, config.cluster_token)
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
                await self.engine.compile_grammar(params)  # off the step thread
            except ValueError as exc:
                self.metrics.requests.labels(outcome="invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.num_active += 1
            start, tokens, outcome = time.perf_counter(), 0, "failed"
            try:
                async for chunk in self._generate(request, params, context, timeline):
                    tokens += len(chunk.token_ids)
                    yield chunk
                outcome = "done"
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            finally:
                self.num_active -= 1
                if span.is_recording():
                    _trace_decode(timeline)
                log.info(  # one line per request, by the id in the router's access log
                    "request %s %s: %s KV, %d prompt + %d output tokens, %.0f ms",
                    request.request_id,
                    outcome,
                    timeline.kv_source,
                    len(request.prompt_token_ids),
                    tokens,
                    (time.perf_counter() - start) * 1e3,
                )

    async def _generate(
        self,
        request: pb.GenerateRequest,
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        timeline: _Timeline,
    ) -> AsyncIterator[pb.GenerateChunk]:
        rid = request.request_id
        try:
            if request.HasField("kv"):
                finished, stream = await self._add_prefilled(request, params, timeline)
            else:
                prompt = list(request.prompt_token_ids)
                stream, timeline.seqs = await self.engine.add_request(
                    rid, prompt, params, cache_salt=request.cache_salt or None
                )
                timeline.ready = timeline.seqs[0].arrival
                finished = None
        except ValueError as exc:  # refused: nothing of it was added
            self.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if finished is None and request.HasField("kv"):
            try:
                timeline.kv_source = await self._fill_kv(rid, request.kv, timeline, context)
            except BaseException:
                await asyncio.shield(self.engine.abort(rid))
                raise
        kv_source = timeline.kv_source
        if finished is not None:  # ended by its first token: nothing to decode
            for chunk in chunks_from_output(finished, kv_source, first=True):
                yield chunk
            self.metrics.requests.labels(outcome="finished").inc()
            return
        first, last = True, time.perf_counter()
        async for output in self.engine.outputs(rid, stream):
            for chunk in chunks_from_output(output, kv_source, first):
                if first:
                    chunk.timings.CopyFrom(timeline.timings())
                yield chunk
            now = time.perf_counter()
            if not first:
                self.metrics.itl_seconds.observe(now - last)
            first, last = False, now
        self.metrics.requests.labels(outcome="finished").inc()

    async def _add_prefilled(
        self, request: pb.GenerateRequest, params: SamplingParams, timeline: _Timeline
    ) -> tuple[RequestOutput | None, OutputStream]:
        """Queue the request for admission with its KV to be pulled (ValueError: refused; the
        prefill worker is told to release at once, unless its handle is not to be trusted)."""
        rejection = await self.handles.rejection(request.kv)
        if rejection is not None:
            raise ValueError(f"KV handle refused: {rejection}")
        # A streaming handle may come before the first token: it then comes with the last pull.
        first = request.first_token if request.HasField("first_token") else None
        timeline.first_token_known = first is not None
        try:
            finished, timeline.seqs, stream = await self.engine.add_prefilled(
                request.request_id,
                list(request.prompt_token_ids),
                first,
                params,
                logprobs_from_proto(request.first_logprobs),
                request.cache_salt or None,  # the prefill's salt: the pulled blocks' hashes
            )
        except BaseException:
            self._spawn(self.prefill_client.release(request.kv))
            raise
        timeline.kv_source = "pulled"
        if finished is not None:
            self._spawn(self.prefill_client.release(request.kv))
        return finished, stream

    async def _fill_kv(
        self,
        rid: str,
        handle: pb.KVHandle,
        timeline: _Timeline,
        context: grpc.aio.ServicerContext,
    ) -> str:
        """Wait for admission (renewing the prefill worker's lease meanwhile), then pull and
        commit the prompt's KV; how it got there: pulled | recomputed."""
        try:
            with self.metrics.pull_seconds.time():
                reserve = timeline.child("decode.reserve")
                with tracing.ending(reserve):
                    plan = await self._admitted(rid, handle)
                    if plan is not None:
                        reserve.set_attributes(
                            {
                                "pdserve.kv_blocks": len(plan.dest_block_ids),
                                "pdserve.cached_tokens": plan.num_cached_tokens,
                            }
                        )
                if plan is None:  # the prefill worker's blocks are gone
                    if not timeline.first_token_known:  # nothing to recompute from
                        self.metrics.pulls.labels(outcome="failed").inc()
                        timeline.keep_handle = True
                        await context.abort(grpc.StatusCode.ABORTED, _RETRY_WITH_FIRST_TOKEN)
                    timeline.ready = await self.engine.recompute_pull(rid)
                    self.metrics.pulls.labels(outcome="recomputed").inc()
                    return "recomputed"
                return await self._pull(plan, handle, timeline, context)
        finally:
            if not timeline.keep_handle:
                self._spawn(self.prefill_client.release(handle))

    async def _admitted(self, rid: str, handle: pb.KVHandle) -> PullPlan | None:
        """The plan once the scheduler admits the request (backpressure, not failure). While it
        waits the prefill worker's lease is renewed, so a full pool delays the pull instead of
        losing the prefill; None when the lease could not be renewed (the blocks are gone).
        Renewals come every ``--lease-renew-seconds``, sooner when the lease has less than twice
        that left (the prefill worker's ``--lease-seconds`` may be the shorter)."""
        expires_ms = handle.lease_expires_unix_ms
        while True:
            try:
                wait = renew_delay(expires_ms, self.config.lease_renew_seconds)
                return await self.engine.pull_plan(rid, timeout=wait)
            except asyncio.TimeoutError:
                renewed = await self.prefill_client.renew_lease(handle)
                if renewed is None:
                    log.warning("lease of %s not renewed; computing here", rid)
                    return None
                expires_ms = renewed

    async def _pull(
        self,
        plan: PullPlan,
        handle: pb.KVHandle,
        timeline: _Timeline,
        context: grpc.aio.ServicerContext,
    ) -> str:
        span = timeline.child("kv.transfer", SpanKind.CLIENT)
        with tracing.ending(span):  # cancelled mid-pull: an error, outcome "failed"
            span.set_attributes(
                {
                    "pdserve.kv.transport": handle.transport,
                    "pdserve.kv.blocks": len(plan.block_indices),
                    "pdserve.kv.source_worker_id": handle.prefill_worker_id,
                    "pdserve.kv.streamed": handle.streaming,
                    "pdserve.kv.outcome": "failed",
                }
            )
            start = time.perf_counter()
            try:
                pulled = await self._fetch(plan, handle, context.time_remaining())
                error: Exception | None = None
            except (TransferError, ValueError) as exc:
                pulled, error = None, exc
            # Without the first token (streamed, the prefill worker never answered) there is
            # nothing to recompute from: the router tries again elsewhere.
            recomputable = timeline.first_token_known and self.config.on_pull_failure != "fail"
            outcome = "pulled" if error is None else ("recomputed" if recomputable else "failed")
            timeline.transfer_s = time.perf_counter() - start
            timeline.transfer_exposed_s = timeline.transfer_s
            if pulled is not None and pulled.streamed:
                timeline.transfer_exposed_s = pulled.exposed_s
            span.set_attributes(
                {
                    "pdserve.kv.bytes": pulled.num_bytes if pulled else 0,
                    "pdserve.kv.duration_s": timeline.transfer_s,
                    "pdserve.kv.outcome": outcome,
                }
            )
            if error is not None:
                tracing.set_error(span, f"KV pull failed: {error}")
        if error is not None:
            if outcome == "failed":
                self.metrics.pulls.labels(outcome="failed").inc()
                if not timeline.first_token_known:
                    detail = f"KV pull failed ({error}); {_RETRY_WITH_FIRST_TOKEN}"
                    timeline.keep_handle = True
                    await context.abort(grpc.StatusCode.ABORTED, detail)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV pull failed: {error}")
            log.warning("KV pull of %s failed (%s); recomputing the prompt", plan.request_id, error)
            timeline.ready = await self.engine.recompute_pull(plan.request_id)
            self.metrics.pulls.labels(outcome="recomputed").inc()
            return "recomputed"
        assert pulled is not None
        final = pulled.final or {}
        first_token = final.get("first_token") if not timeline.first_token_known else None
        logprobs = {int(t): v for t, v in (final.get("logprobs") or {}).items()} or None
        try:
            timeline.ready = await self.engine.commit_pull(
                plan, pulled.blocks, first_token, logprobs
            )
        except ValueError as exc:  # the prefill worker's first token is not one of this model's
            self.metrics.pulls.labels(outcome="failed").inc()
            await context.abort(grpc.StatusCode.INTERNAL, f"the prefill worker's answer: {exc}")
        self.metrics.pulls.labels(outcome="pulled").inc()
        return "pulled"

    async def _fetch(
        self, plan: PullPlan, handle: pb.KVHandle, total_timeout: float | None
    ) -> _Pulled:
        """The planned blocks in this worker's layout, pulled and verified (a streaming handle:
        as the prefill worker computes them, with its first token at the end, all within
        ``total_timeout``: the call's time left)."""
        if self.client is None:
            raise TransferError("unsupported", "this worker has no KV transport client")
        source_layout = layout_from_proto(handle.layout)
        same = source_layout == self.layout
        # Same layout: just the blocks we lack. Different block size/dtype: all, then adapt.
        indices = plan.block_indices if same else list(range(len(handle.block_ids)))
        block_ids = [handle.block_ids[i] for i in indices]
        timeout = self.config.pull_timeout_seconds
        address, request_id = handle.address, handle.request_id
        pulled = _Pulled(self.layout.empty_blocks(0))
        if handle.streaming:  # waits for the blocks (and the first token) as they come
            result = await self.client.pull_streamed(
                address, request_id, block_ids, source_layout, timeout, total_timeout
            )
            blocks, pulled.final, pulled.exposed_s = result.blocks, result.final, result.exposed_s
            pulled.streamed = True
        elif not block_ids:
            return pulled
        elif self.config.verify_checksums:
            if len(handle.checksums) != len(handle.block_ids):
                raise TransferError("checksum", "the KVHandle carries no checksums")
            expected = [handle.checksums[i] for i in indices]
            blocks = await self.client.pull_verified(
                address, request_id, block_ids, source_layout, timeout, expected
            )
        else:
            blocks = await self.client.pull(address, request_id, block_ids, source_layout, timeout)
        pulled.num_bytes = blocks.nbytes
        pulled.blocks = blocks
        if not same:
            adapted = adapt_layout(blocks, source_layout, self.layout, handle.num_tokens)
            pulled.blocks = adapted[plan.block_indices]
        return pulled

    async def prune_channels(self, interval: float = 30.0) -> None:
        """Close channels to prefill workers that left (runs for the worker's lifetime)."""
        while True:
            await asyncio.sleep(interval)
            if self.handles.records is not None:
                await self.channels.prune(self.handles.live_addresses(interval))

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.channels.close()


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
