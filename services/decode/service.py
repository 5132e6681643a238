"""The DecodeService gRPC servicer (also the colocated worker's entry point).

A disaggregated request's life here: waiting-for-blocks (admission: blocks for the incoming KV
are reserved in the pool, so pulls in flight count against capacity) -> pulling (only the blocks
the local prefix cache lacks; checksums verified) -> running (continuous batch, tokens streamed)
-> finished | aborted. If the pull fails, the prompt is recomputed here (or the request fails,
``on_pull_failure="fail"``); unverified blocks are never decoded from. The prefill worker is told
to release its blocks as soon as the pull is over, whatever its outcome.

Without a KVHandle (a colocated worker, or a request sent straight to it) the prompt is computed
here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvtransfer.base import KVLayout, KVTransferClient, TransferError, adapt_layout
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from services.engine.llm_engine import PullPlan
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.prefill.service import layout_from_proto
from services.worker.async_engine import AsyncEngine
from services.worker.config import WorkerConfig
from services.worker.convert import chunks_from_output, logprobs_from_proto, params_from_proto
from services.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_SECONDS = 2.0


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
        if self.draining or self.num_active >= self.config.max_pending_requests:
            self.metrics.requests.labels(outcome="rejected").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining or full")
        try:
            params = params_from_proto(request.sampling)
        except ValueError as exc:
            self.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.num_active += 1
        try:
            async for chunk in self._generate(request, params, context):
                yield chunk
        finally:
            self.num_active -= 1

    async def _generate(
        self, request: pb.GenerateRequest, params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        rid = request.request_id
        queue = self.engine.open_stream(rid)
        try:
            if request.HasField("kv"):
                finished, kv_source = await self._admit_prefilled(request, params, context)
            else:
                await self.engine.call(
                    self.engine.engine.add_request, rid, list(request.prompt_token_ids), params
                )
                finished, kv_source = None, "local"
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
        self, request: pb.GenerateRequest, params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> tuple[RequestOutput | None, str]:
        """Reserve, pull and commit the prompt's KV; returns (final output if done, source)."""
        handle, rid = request.kv, request.request_id
        try:
            finished = await self.engine.call(
                self.engine.engine.add_prefilled_request,
                rid,
                list(request.prompt_token_ids),
                request.first_token,
                params,
                logprobs_from_proto(request.first_logprobs),
            )
            if finished is not None:
                return finished, "pulled"
            with self.metrics.pull_seconds.time():
                plan = await self._reserve(rid, context)
                return None, await self._pull(plan, handle, context)
        finally:
            self._spawn(self._release(handle))

    async def _reserve(self, rid: str, context: grpc.aio.ServicerContext) -> PullPlan:
        """Wait for room in the pool (backpressure, not failure) and reserve it."""
        while True:
            plan = await self.engine.call(self.engine.engine.reserve_pull, rid)
            if plan is not None:
                return plan
            await self.engine.wait_for_step(timeout=0.5)

    async def _pull(
        self, plan: PullPlan, handle: pb.KVHandle, context: grpc.aio.ServicerContext
    ) -> str:
        engine = self.engine.engine
        try:
            blocks = await self._fetch(plan, handle)
        except (TransferError, ValueError) as exc:
            if self.config.on_pull_failure == "fail":
                self.metrics.pulls.labels(outcome="failed").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV pull failed: {exc}")
            log.warning("KV pull of %s failed (%s); recomputing the prompt", plan.request_id, exc)
            await self.engine.call(engine.recompute_pull, plan.request_id)
            self.metrics.pulls.labels(outcome="recomputed").inc()
            return "recomputed"
        await self.engine.call(engine.commit_pull, plan, blocks)
        self.metrics.pulls.labels(outcome="pulled").inc()
        return "pulled"

    async def _fetch(self, plan: PullPlan, handle: pb.KVHandle):  # type: ignore[no-untyped-def]
        """The planned blocks in this worker's layout, pulled and verified."""
        if self.client is None:
            raise TransferError("unsupported", "this worker has no KV transport client")
        if not plan.block_indices:
            return self.layout.empty_blocks(0)
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
            return blocks
        adapted = adapt_layout(blocks, source_layout, self.layout, handle.num_tokens)
        return adapted[plan.block_indices]

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
