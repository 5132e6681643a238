"""Calls to workers, for the router's flows (``router/orchestrator.py``): choosing a worker of a
pool by its policy, one call after another until one produces output (retries), each call
counted in the worker's and its pool's load and traced as a client span, failures classified.

What a flow hands back to the gateway is here too: ``Chunk`` (new output of one sequence) and
``SubRequest`` (one prompt of an API request, filled in with how it was served).

No tensors here: token ids and text only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span, SpanKind

from common import tracing
from common.channels import ChannelPool
from common.prefill_client import PrefillClient
from common.sampling_params import SamplingParams
from common.wire import token_metadata
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.policies import RouteRequest, RoutingPolicy
from services.registry import ROLES, Role, WorkerRecord

log = logging.getLogger(__name__)

# Codes after which another worker may well succeed; anything else is the request's own fault.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}


@dataclass
class Chunk:
    """New output of one of a request's ``n`` sequences."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[tuple[int, float]]]  # per token: (token, logprob), sampled token first
    finish_reason: str | None = None


@dataclass
class SubRequest:
    """One prompt of an API request, as the workers see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_cached_tokens: int = 0  # filled in: prompt tokens a worker's prefix cache already held
    worker_ids: list[str] = field(default_factory=list)  # filled in: who served it
    kv_source: str = ""  # filled in: pulled | recomputed | local | colocated
    timings: dict[str, float] = field(default_factory=dict)  # filled in: phase -> seconds


class MidStreamError(APIError):
    """A worker failed after the client already got part of the answer."""


class WorkerCalls:
    """The router's calls to its workers: channels, load counters, retries, failures."""

    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, policies: dict[Role, RoutingPolicy]
    ):
        self.config = config
        self.metrics = metrics
        self.policies = policies
        self.channels = ChannelPool()
        self.prefill_client = PrefillClient(self.channels, config.cluster_token)
        self.metadata = token_metadata(config.cluster_token)
        self.in_flight: Counter[str] = Counter()
        # worker id -> prompt tokens it has yet to compute, from this router (prefill workers, and
        # decode workers computing prompts themselves)
        self.prefill_tokens: Counter[str] = Counter()
        # Calls open on each pool's workers: the requests this router has in that pool's hands.
        self.num_pool_requests: dict[Role, int] = dict.fromkeys(ROLES, 0)
        self._background: set[asyncio.Task[None]] = set()

    async def choose(
        self, pool: Role, candidates: list[WorkerRecord], route: RouteRequest
    ) -> WorkerRecord:
        policy = self.policies[pool]
        worker = await policy.choose(candidates, route)
        self.metrics.routing.labels(pool=pool, policy=policy.name).inc()
        return worker

    async def stream(
        self,
        pool: Role,
        sub: SubRequest,
        route: RouteRequest,
        request: pb.GenerateRequest,
        candidates_fn,  # type: ignore[no-untyped-def]
        first_choice: WorkerRecord | None = None,
        id_base: str = "",
        first_token_known: asyncio.Event | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Generate on a worker of ``pool`` (``first_choice`` first, when it is still a
        candidate), moving to another one until the first chunk. Attempts are numbered after
        ``id_base`` (the request's id by default). A worker that answers ABORTED (its streamed
        pull failed before the first token came) is asked again once ``first_token_known``."""
        failed: set[str] = set()
        last = f"no {pool} worker is alive"
        deadline = time.monotonic() + self.config.request_timeout_seconds
        for attempt in range(self.config.max_attempts):
            if attempt and first_token_known is not None:
                await first_token_known.wait()  # the request carries it from then on
            candidates = [w for w in candidates_fn() if w.worker_id not in failed]
            if not candidates:
                break
            if first_choice is not None and first_choice in candidates:
                worker, first_choice = first_choice, None
            else:
                worker = await self.choose(pool, candidates, route)
            request.request_id = attempt_id(id_base or sub.request_id, pool[0], attempt)
            span = attempt_span(pool, worker, attempt, request.request_id)
            started, num_tokens = False, 0
            call = None
            with tracing.ending(span):
                try:
                    with self.tracked(worker) as channel:
                        call = pb_grpc.DecodeServiceStub(channel).Generate(
                            request,
                            timeout=max(1.0, deadline - time.monotonic()),
                            metadata=self.metadata + tracing.grpc_metadata(span),
                        )
                        async for message in call:
                            if not started:
                                started = True
                                sub.worker_ids.append(worker.worker_id)
                                first_message(sub, pool, message)
                            num_tokens += len(message.token_ids)
                            yield chunk_of(message, sub.params.logprobs is not None)
                    span.set_attribute("pdserve.output_tokens", num_tokens)
                    return
                except grpc.aio.AioRpcError as exc:
                    tracing.set_error(span, f"{exc.code().name}: {exc.details()}")
                    reason = self.failed(pool, worker, exc)
                    if started:
                        raise MidStreamError(
                            502, f"{pool} worker failed mid-stream: {reason}"
                        ) from exc
                    last = reason
                    if exc.code() != grpc.StatusCode.ABORTED:  # else the worker is fine
                        failed.add(worker.worker_id)
                        first_choice = None
                    else:
                        first_choice = worker
                finally:
                    if call is not None:
                        call.cancel()  # a no-op once finished; on client disconnect: abort there
        raise APIError(503, f"{pool} failed: {last}", retry_after=self.config.retry_after_seconds)

    # -- helpers -------------------------------------------------------------------------------

    def failed(self, pool: Role, worker: WorkerRecord, exc: grpc.aio.AioRpcError) -> str:
        """Classify a worker's failure: raise for the request's own errors, else describe it."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise APIError(400, details or "invalid request") from exc
        if code == grpc.StatusCode.UNAUTHENTICATED:
            log.error(
                "%s refused the router's cluster token: check PDSERVE_CLUSTER_TOKEN",
                worker.worker_id,
            )
        elif code not in RETRYABLE:
            raise APIError(500, f"{pool} worker error: {code.name}: {details}") from exc
        self.metrics.retries.labels(pool=pool, reason=code.name.lower()).inc()
        log.warning(
            "%s worker %s failed (%s: %s); trying another",
            pool,
            worker.worker_id,
            code.name,
            details,
        )
        return f"{worker.worker_id}: {code.name}: {details}"

    @contextmanager
    def queued(self, worker: WorkerRecord, sub: SubRequest) -> Iterator[None]:
        """``sub``'s prompt counts in the prefill worker's queue while its Prefill call runs."""
        self.add_prefill_tokens(worker, len(sub.prompt_token_ids))
        try:
            yield
        finally:
            self.add_prefill_tokens(worker, -len(sub.prompt_token_ids))

    def add_prefill_tokens(self, worker: WorkerRecord, tokens: int) -> None:
        """Count ``tokens`` more (or fewer) prompt tokens in ``worker``'s prefill queue: a
        prefill worker's Prefill calls, or the prompts a decode worker computes itself."""
        self.prefill_tokens[worker.worker_id] += tokens
        if not self.prefill_tokens[worker.worker_id]:
            del self.prefill_tokens[worker.worker_id]

    @contextmanager
    def tracked(self, worker: WorkerRecord) -> Iterator[grpc.aio.Channel]:
        """The worker's channel, kept open while the call runs; the call counts in the worker's
        in-flight load and its pool's. A request has at most one call open per pool: retries
        are sequential."""
        self.in_flight[worker.worker_id] += 1
        self.num_pool_requests[worker.role] += 1
        try:
            with self.channels.using(worker.grpc_address) as channel:
                yield channel
        finally:
            self.num_pool_requests[worker.role] -= 1
            self.in_flight[worker.worker_id] -= 1
            if not self.in_flight[worker.worker_id]:
                del self.in_flight[worker.worker_id]

    def spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def forget_channels(self, addresses: Iterable[str]) -> None:
        """Close channels to addresses not in ``addresses`` that no call uses."""
        await self.channels.prune(addresses)

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.channels.close()


def attempt_span(pool: Role, worker: WorkerRecord, attempt: int, request_id: str) -> Span:
    """The client span of one call to ``worker`` (a child of the current span: the request's)."""
    return tracing.TRACER.start_span(
        f"router.{pool}",
        kind=SpanKind.CLIENT,
        attributes={
            "pdserve.request_id": request_id,
            "pdserve.worker_id": worker.worker_id,
            "pdserve.worker_address": worker.grpc_address,
            "pdserve.attempt": attempt,
        },
    )


def attempt_id(request_id: str, pool: str, attempt: int) -> str:
    return f"{request_id}-{pool}{attempt}"


def entries(message: pb.TokenLogprobs) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in message.entries]


def first_message(sub: SubRequest, pool: Role, message: pb.GenerateChunk) -> None:
    """What the first chunk of a Generate stream says about the request's way to it."""
    t = message.timings
    if pool == "colocated":
        sub.num_cached_tokens = message.num_cached_tokens
        sub.kv_source = "colocated"
    elif not sub.kv_source:  # n > 1 after a finished sequence 0 keeps "pulled"
        sub.kv_source = message.kv_source
    if sub.kv_source in ("local", "colocated"):
        sub.num_cached_tokens = message.num_cached_tokens
        sub.timings.update(decode_queue=t.queue_s, decode_first_step=t.compute_s)
        return
    sub.timings.update(
        kv_transfer=t.transfer_s,
        kv_transfer_exposed=t.transfer_exposed_s,
        decode_queue=t.queue_s,
        decode_first_step=t.compute_s,
    )


def chunk_of(message: pb.GenerateChunk, with_logprobs: bool) -> Chunk:
    return Chunk(
        index=message.index,
        text=message.text,
        token_ids=list(message.token_ids),
        logprobs=[entries(lp) for lp in message.logprobs] if with_logprobs else [],
        finish_reason=message.finish_reason or None,
    )
